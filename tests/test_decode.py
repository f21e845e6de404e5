"""The plain decode loop on a tiny random llama with the real tokenizer: shapes, masks wider
than the tokenizer, stopping, fail-closed, and exactness against the oracle."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance.numpy as llnp
import mlx.core as mx
import numpy as np
import pytest

from oracle import reference_decode, report
from oracle.sampler import unpack_mask
from specdec.decode import StepTimings
from specdec.errors import GrammarStateError
from specdec.grammar import Constraint
from specdec.sampling import SamplingParams, unpack_bitmask
from tests import tally
from tests.tiny import EOS, TOKENIZER_VOCAB, WIDTH, drain, tiny_llama
from tests.tiny import plain_steps as decode_steps


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(1234)


def run(model, prompt, matcher=None, params=SamplingParams(), max_tokens=24):
    return drain(decode_steps(model, prompt, vocab_size=WIDTH, eos_token_ids=EOS,
                              max_tokens=max_tokens, matcher=matcher, params=params))


def test_tiny_model_logits_have_the_padded_width(tiny, prompt):
    assert tiny(mx.array([prompt])).shape == (1, len(prompt), WIDTH)


def test_real_mask_bans_ids_past_the_tokenizer_and_unpacks_alike(compiler):
    m = compiler.compile(Constraint.json_object()).matcher()
    bm = llnp.allocate_token_bitmask(1, WIDTH)
    llnp.fill_next_token_bitmask(m, bm)
    dev = np.array(unpack_bitmask(mx.array(bm[0]), WIDTH))
    assert np.array_equal(dev, unpack_mask(bm[0], WIDTH))
    assert dev.any() and not dev[TOKENIZER_VOCAB:].any()


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"},
                                           "b": {"type": "string", "maxLength": 5}},
          "required": ["a", "b"], "additionalProperties": False}
CONSTRAINTS = {
    "schema": Constraint.json_schema(SCHEMA),
    "regex": Constraint.regex(r"[a-z]{2,6}-\d{2}"),
    "choice": Constraint.choice(["alpha", "beta", "gamma"]),
    "grammar": Constraint.grammar('start: "x" ("+" "x")*'),
}


def satisfied(name: str, text: str) -> bool:
    if name == "schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if name == "regex":
        return re.fullmatch(r"[a-z]{2,6}-\d{2}", text) is not None
    if name == "choice":
        return text in ("alpha", "beta", "gamma")
    return re.fullmatch(r"x(\+x)*", text) is not None


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(1.0, top_k=50, seed=5),
                                    SamplingParams(0.9, top_p=0.95, seed=9)],
                         ids=["greedy", "seeded-topk", "seeded-topp"])
@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
def test_random_model_output_obeys_grammar_and_equals_oracle(tiny, compiler, hf_tokenizer,
                                                             prompt, name, params):
    grammar = compiler.compile(CONSTRAINTS[name])
    tokens, finish = run(tiny, prompt, grammar.matcher(), params, max_tokens=40)
    oracle = reference_decode(tiny, prompt, vocab_size=WIDTH, eos_token_ids=EOS, max_tokens=40,
                              matcher=grammar.matcher(), temperature=params.temperature,
                              top_k=params.top_k, top_p=params.top_p, seed=params.seed or 0)
    tally.record("tiny model plain vs oracle",
                 identical=report(oracle, tokens) is None and finish == oracle.finish_reason)
    assert report(oracle, tokens) is None
    assert finish == oracle.finish_reason
    assert all(t < TOKENIZER_VOCAB for t in tokens)
    if finish == "stop":
        assert satisfied(name, hf_tokenizer.decode(tokens))


def test_length_cut_never_claims_stop(tiny, compiler, prompt):
    tokens, finish = run(tiny, prompt, compiler.compile(CONSTRAINTS["schema"]).matcher(),
                         max_tokens=3)
    assert (len(tokens), finish) == (3, "length")


def test_grammar_completion_stops_without_emitting_eos(tiny, compiler, hf_tokenizer, prompt):
    tokens, finish = run(tiny, prompt, compiler.compile(CONSTRAINTS["choice"]).matcher())
    assert finish == "stop" and hf_tokenizer.decode(tokens) in ("alpha", "beta", "gamma")
    assert not set(tokens) & set(EOS)


class EosAfter:
    """The tiny model, but EOS wins from output position n on (a mock for the stop path):
    a row at sequence position p predicts output position p + 1 - len(prompt)."""

    def __init__(self, model, n: int, eos: int, prompt_len: int) -> None:
        self.model, self.n, self.eos, self.prompt_len = model, n, eos, prompt_len

    def __call__(self, ids, cache=None):
        start = cache[0].offset if cache else 0
        out = self.model(ids, cache=cache)
        pos = mx.arange(start, start + ids.shape[1]) + 1 - self.prompt_len  # (T,)
        bump = mx.zeros((out.shape[-1],)).at[self.eos].add(1e4)
        return out + (pos >= self.n)[None, :, None] * bump

    @property
    def layers(self):
        return self.model.layers


@pytest.mark.parametrize("eos", EOS)
def test_any_eos_id_ends_unconstrained_output_and_is_not_emitted(tiny, prompt, eos):
    tokens, finish = run(EosAfter(tiny, 4, eos, len(prompt)), prompt, max_tokens=20)
    assert finish == "stop" and len(tokens) == 4  # output positions 0..3, then EOS wins
    assert eos not in tokens


def test_matcher_already_in_error_fails_closed_before_any_token(tiny, compiler, prompt):
    m = compiler.compile(CONSTRAINTS["choice"]).matcher()
    m.consume_token(hf_is_illegal := 5)  # an illegal first token puts it in error
    assert m.is_error(), hf_is_illegal
    with pytest.raises(GrammarStateError):
        run(tiny, prompt, m)


class BreaksAfter:
    """A matcher proxy that is driven into llguidance's error state after n consumed tokens."""

    def __init__(self, matcher, n: int) -> None:
        self._m, self._n = matcher, n

    def consume_token(self, t: int) -> bool:
        ok = self._m.consume_token(t)
        self._n -= 1
        if self._n == 0:
            self._m.consume_token(49151)  # not allowed anywhere in this grammar
        return ok

    def __getattr__(self, name):
        return getattr(self._m, name)


def test_matcher_error_mid_decode_stops_without_emitting_an_unchecked_token(tiny, compiler,
                                                                            prompt):
    m = BreaksAfter(compiler.compile(CONSTRAINTS["schema"]).matcher(), 3)
    gen = decode_steps(tiny, prompt, vocab_size=WIDTH, eos_token_ids=EOS, max_tokens=30,
                       matcher=m)
    got = [next(gen), next(gen)]
    with pytest.raises(GrammarStateError):
        next(gen)
    assert len(got) == 2


def test_timings_count_steps_and_mask_time(tiny, compiler, prompt):
    t = StepTimings()
    gen = decode_steps(tiny, prompt, vocab_size=WIDTH, eos_token_ids=EOS, max_tokens=5,
                       matcher=compiler.compile(CONSTRAINTS["schema"]).matcher(), timings=t)
    n = sum(1 for _ in gen)
    assert t.steps == n == 5 and t.mask_s > 0 and t.prefill_s > 0


def test_sampling_without_seed_is_refused(tiny, prompt):
    with pytest.raises(ValueError, match="seed"):
        run(tiny, prompt, params=SamplingParams(0.7))


def test_restored_prompt_state_gives_identical_output(tiny, compiler, prompt):
    from specdec.decode import PromptKVCache

    store = PromptKVCache(capacity=2)
    g = compiler.compile(CONSTRAINTS["schema"])
    fresh = run(tiny, prompt, g.matcher())
    runs = [drain(decode_steps(tiny, prompt, vocab_size=WIDTH, eos_token_ids=EOS, max_tokens=24,
                               matcher=g.matcher(), kv_store=store)) for _ in range(3)]
    assert store.hits == 2
    assert all(r == fresh for r in runs)  # the stored state is never mutated by a decode


def test_suite_runs_on_the_reference_blas_despite_numpys_bundled_openblas():
    # conftest re-execs without the OpenBLAS preload; numpy (imported here) maps its own
    # libscipy_openblas, which must not be mistaken for MLX's BLAS.
    import numpy  # noqa: F401

    from specdec import blas

    assert blas.active() == "reference"
