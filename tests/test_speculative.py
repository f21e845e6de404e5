"""Speculative decoding on tiny random llamas (real tokenizer): exact acceptance patterns,
the regression scenarios, and the full exactness matrix against plain decoding and the oracle.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from bench.workloads import CASES
from oracle import reference_decode, report
from specdec.errors import GrammarStateError
from specdec.engine import Engine
from specdec.grammar import Constraint
from specdec.models import LoadedModel, MappedDraft
from specdec.lookup import SuffixStore
from specdec.sampling import (SamplingParams, apply_mask, pick, position_noise,
                              unpack_bitmask)
from specdec.request_grammar import single_allowed
from specdec.speculative import DraftConfigError, SpecConfig, SpecStats, space_mask
from tests import tally
from tests.rotation import SEED, half
from tests.tiny import EOS, WIDTH, drain, tiny_llama
from tests.tiny import plain_steps as decode_steps
from tests.tiny import spec_steps as speculative_steps

GREEDY = SamplingParams()
SEEDED = SamplingParams(0.8, top_k=40, seed=77)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(1234)


@pytest.fixture(scope="module")
def bad_draft():
    return tiny_llama(99)  # same vocabulary, unrelated weights: disagrees almost always


@pytest.fixture(scope="module")
def soft_drafts():
    """Drafts unsure enough to branch (token trees): the target's ranking with less sure
    probabilities (its picks agree, its gate ends chains often), and an unrelated one."""
    return {"soft": tiny_llama(1234, head_scale=2), "badsoft": tiny_llama(99, head_scale=2)}


def plain(model, prompt, matcher=None, params=GREEDY, max_tokens=30):
    return drain(decode_steps(model, prompt, vocab_size=WIDTH, eos_token_ids=EOS,
                              max_tokens=max_tokens, matcher=matcher, params=params))


def spec_run(target, draft, prompt, matcher=None, params=GREEDY, max_tokens=30,
             spec=SpecConfig(), draft_width=WIDTH, **kw):
    stats = SpecStats()
    out = drain(speculative_steps(target, draft, prompt, vocab_size=WIDTH,
                                  draft_vocab_size=draft_width, eos_token_ids=EOS,
                                  max_tokens=max_tokens, matcher=matcher, params=params,
                                  spec=spec, stats=stats, **kw))
    return out, stats


def test_target_as_its_own_draft_accepts_every_proposal(target, prompt):
    # Same model, same (seed, position) noise: every proposal equals the target's pick, so
    # each round accepts all k and adds one bonus token: 30 tokens = 6 rounds of 4 + 1.
    for params in (GREEDY, SEEDED):
        (tokens, finish), st = spec_run(target, target, prompt, params=params,
                                        spec=SpecConfig(k=4))
        assert (tokens, finish) == plain(target, prompt, params=params)
        assert (st.rounds, st.proposed, st.accepted) == (6, 24, 24)


def test_bad_draft_is_rejected_almost_always_and_output_is_unchanged(target, bad_draft,
                                                                     prompt):
    (tokens, finish), st = spec_run(target, bad_draft, prompt, spec=SpecConfig(k=4))
    assert (tokens, finish) == plain(target, prompt)
    assert st.proposed >= 30 and st.acceptance_rate < 0.1


def test_draft_proposes_eos_and_target_rejects(target, prompt):
    class EosDraft:  # a draft whose top token is always EOS
        def __init__(self, model):
            self.model, self.layers = model, model.layers

        def __call__(self, ids, cache=None):
            out = self.model(ids, cache=cache)
            return out + mx.zeros((out.shape[-1],)).at[EOS[1]].add(1e4)

    (tokens, finish), st = spec_run(target, EosDraft(target), prompt, max_tokens=12)
    assert (tokens, finish) == plain(target, prompt, max_tokens=12)
    # Every round proposes EOS first and stops drafting; the last round (budget 1) proposes
    # nothing.
    assert finish == "length" and st.rounds == 12 and st.proposed == 11 and st.accepted == 0


def test_grammar_completes_mid_round(target, compiler, prompt):
    g = compiler.compile(Constraint.choice(["alpha", "beta", "gamma"]))
    (tokens, finish), st = spec_run(target, target, prompt, g.matcher(), spec=SpecConfig(k=8))
    assert (tokens, finish) == plain(target, prompt, g.matcher())
    assert finish == "stop" and st.rounds == 1 and len(tokens) < 8


@pytest.mark.parametrize("max_tokens", [1, 3, 5, 9])
def test_max_tokens_lands_mid_round(target, prompt, max_tokens):
    (tokens, finish), st = spec_run(target, target, prompt, max_tokens=max_tokens,
                                    spec=SpecConfig(k=4))
    assert (tokens, finish) == plain(target, prompt, max_tokens=max_tokens)
    assert len(tokens) == max_tokens and finish == "length"


def test_stop_string_spans_a_round_boundary(target, hf_tokenizer, prompt):
    def loaded(model) -> LoadedModel:
        return LoadedModel(model=model, tokenizer=hf_tokenizer, path=None, name="tiny",  # type: ignore[arg-type]
                           eos_token_ids=EOS, vocab_size=WIDTH,
                           config={"max_position_embeddings": 512})

    t = loaded(target)
    engine = Engine(t, t, SpecConfig(k=4))
    base = engine.generate(engine.prepare(prompt, max_tokens=20, spec=None))
    # Round 1 emits tokens 0..4 (4 accepted + bonus): the stop string straddles 4 | 5.
    left = hf_tokenizer.decode(list(base.tokens[:5]))
    right = hf_tokenizer.decode(list(base.tokens[5:6]))
    stop = left[-2:] + right[:2]
    assert len(stop) >= 3 and stop in base.text
    want = engine.generate(engine.prepare(prompt, max_tokens=20, stop=[stop], spec=None))
    got = engine.generate(engine.prepare(prompt, max_tokens=20, stop=[stop]))
    assert got.stats.counters.rounds >= 1 and got.stats.k == 4
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason) == (
        base.text[:base.text.index(stop)], "stop")


def test_unmasked_draft_proposes_an_illegal_token_and_the_backstop_cuts_it(
        target, bad_draft, compiler, prompt):
    schema = Constraint.json_schema({"type": "object", "properties": {"n": {"type": "integer"}},
                                     "required": ["n"], "additionalProperties": False})
    g = compiler.compile(schema)
    (tokens, finish), st = spec_run(target, bad_draft, prompt, g.matcher(),
                                    spec=SpecConfig(4, draft_masking=False,
                                                    forced_drafting=False))
    assert (tokens, finish) == plain(target, prompt, g.matcher())
    assert st.grammar_cuts > 0


def test_matcher_error_state_never_leaks_an_illegal_token(target, compiler, prompt):
    m = compiler.compile(Constraint.choice(["alpha", "beta"])).matcher()
    m.consume_token(5)
    assert m.is_error()
    gen = speculative_steps(target, target, prompt, vocab_size=WIDTH, draft_vocab_size=WIDTH,
                            eos_token_ids=EOS, max_tokens=10, matcher=m)
    with pytest.raises(GrammarStateError):
        next(gen)


class _NoLookAheadMatcher:
    """The request's matcher, refusing every speculative operation: look-ahead must run on a
    `deep_copy` (llguidance's rollback is not exact, tests/test_llguidance_rollback.py)."""

    def __init__(self, m):
        self._m = m

    def rollback(self, n):
        raise AssertionError("rollback on the request's matcher")

    def validate_tokens(self, tokens):
        raise AssertionError("validate_tokens on the request's matcher")

    def try_consume_tokens(self, tokens):
        raise AssertionError("try_consume_tokens on the request's matcher")

    def __getattr__(self, name):
        return getattr(self._m, name)


@pytest.mark.parametrize("spec", [SpecConfig(4), SpecConfig(4, draft_masking=False,
                                                            forced_drafting=False)])
def test_request_matcher_is_never_advanced_speculatively(target, bad_draft, compiler, prompt,
                                                         spec):
    # Unmasked proposals from an unrelated draft: rejections and grammar cuts every round.
    g = compiler.compile(Constraint.json_schema(CASES[0].value))
    m = _NoLookAheadMatcher(g.matcher())
    (tokens, finish), st = spec_run(target, bad_draft, prompt, m, max_tokens=16, spec=spec)
    assert (tokens, finish) == plain(target, prompt, g.matcher(), max_tokens=16)
    assert st.proposed > st.accepted
    fresh = g.matcher()
    assert fresh.try_consume_tokens(tokens) == len(tokens)
    assert fresh.is_accepting() == m.is_accepting()


def test_narrower_draft_vocabulary_is_allowed(target, compiler, prompt):
    narrow = tiny_llama(5, width=49152)
    g = compiler.compile(Constraint.json_schema(CASES[0].value))
    (tokens, finish), st = spec_run(target, narrow, prompt, g.matcher(), draft_width=49152)
    assert (tokens, finish) == plain(target, prompt, g.matcher())
    assert st.proposed > 0


def test_draft_with_a_different_tokenizer_is_refused(embedded, hf_tokenizer):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(
        vocab={"a": 0, "b": 1}, merges=[])))
    draft = LoadedModel(model=embedded.model, tokenizer=other, path=embedded.path, name="other",
                        eos_token_ids=(0,), vocab_size=2, config={})
    with pytest.raises(DraftConfigError, match="different tokenizer"):
        Engine(embedded, draft)


@pytest.mark.parametrize("k", [0, 17, "4"])
def test_k_out_of_range_is_refused(k):
    with pytest.raises(DraftConfigError, match="k="):
        SpecConfig(k=k)  # type: ignore[arg-type]


def test_single_allowed_finds_the_one_set_bit():
    import numpy as np

    row = np.zeros(5, dtype=np.int32)
    assert single_allowed(row) is None
    row[3] = np.int32(-2**31)  # bit 31 of word 3
    assert single_allowed(row) == 3 * 32 + 31
    row[1] = 4
    assert single_allowed(row) is None
    row[3] = 0
    assert single_allowed(row) == 34


# -- the exactness matrix -------------------------------------------------------------------
KS = (1, 2, 4, 8)
MATRIX_CASES = [c for c in CASES if c.kind != "json_object"]
CELLS = [(k, dm, fd) for k in KS for dm in (True, False) for fd in (True, False)]


LOOKUP_CELLS = [(k, dm, fd) for k, dm, fd in CELLS if k in (2, 8)]
# Each draft decodes half of its cells a run (the other half under the next seed:
# `tests.rotation`, the seed the corpus tests rotate theirs by).


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
@pytest.mark.parametrize("draft_name", ["self", "bad", "none", "none+lookup", "bad+lookup",
                                        "bad+suffix", "soft+tree", "badsoft+tree"])
@pytest.mark.parametrize("case", MATRIX_CASES, ids=[c.name for c in MATRIX_CASES])
def test_exactness_matrix_tiny(target, bad_draft, soft_drafts, compiler, prompt, case,
                               draft_name, mode):
    """Every {k} x {draft masking} x {forced drafting} cell equals plain decoding and the
    oracle token for token; cuts are 0 whenever draft masking is on. A draft model alone
    ("self", "bad", "none") decodes half of its 16 cells each run, a "+" draft half of its 8,
    the other half under the next seed (`tests.rotation.half`; the seed is in the summary).
    "+lookup": the serving
    defaults on top (forced, then lookup, then the draft model, drafting ends below p=0.3).
    "+suffix": those and proposals from earlier answers (`lookup.SuffixStore`) holding the
    other mode's answer and this answer with every seventh token changed, so runs of them
    are accepted and then rejected mid-round; at k8 with token trees, where the two answers'
    runs become each other's branches. "+tree": the serving defaults with token trees
    (`SpecConfig.tree`) over drafts unsure enough to branch, whose branches are accepted
    and rejected."""
    params = GREEDY if mode == "greedy" else SEEDED
    note = f"tiny matrix seed {SEED} (SPECDEC_CORPUS_SEED): half of each draft's cells"
    if note not in tally.NOTES:
        tally.NOTES.append(note)
    g = compiler.compile(Constraint(case.kind, case.value))  # type: ignore[arg-type]
    model_name, _, lookup = draft_name.partition("+")
    draft = {"self": target, "bad": bad_draft, "none": None, **soft_drafts}[model_name]
    want = plain(target, prompt, g.matcher(), params, max_tokens=40)
    oracle = reference_decode(target, prompt, vocab_size=WIDTH, eos_token_ids=EOS,
                              max_tokens=40, matcher=g.matcher(),
                              temperature=params.temperature, top_k=params.top_k,
                              top_p=params.top_p, seed=params.seed or 0)
    tally.record("tiny: plain vs oracle", report(oracle, want[0]) is None)
    assert report(oracle, want[0]) is None and want[1] == oracle.finish_reason
    failures, cuts_on, suffixed, drafted, branched = [], 0, 0, 0, 0
    store = None
    if lookup == "suffix":
        store = SuffixStore()
        other = plain(target, prompt, g.matcher(), SEEDED if params.greedy else GREEDY, 40)
        store.add(g.text, other[0], lead=prompt)
        store.add(None, [t if i % 7 != 6 else (t + 1) % WIDTH for i, t in enumerate(want[0])],
                  lead=prompt)
    for k, dm, fd in half(LOOKUP_CELLS if lookup else CELLS, case.name, draft_name, mode):
        got, st = spec_run(target, draft, prompt, g.matcher(), params, max_tokens=40,
                           spec=SpecConfig(k, dm, fd, lookup=bool(lookup),
                                           suffix=lookup == "suffix",
                                           draft_min_prob=0.3 if lookup else 0.0,
                                           tree=8 if lookup == "tree" or (
                                               lookup == "suffix" and k == 8) else 0,
                                           tree_min_score=0.02),
                           suffixes=store, suffix_key=g.text)
        counts = st.source_counts()
        suffixed += counts["suffixed"]
        branched += st.branched
        drafted += counts["drafted"]
        same = got == want
        tally.record(f"tiny: spec vs plain ({draft_name} draft)", same)
        tally.record_cuts(dm, st.grammar_cuts)
        tally.record_sources(f"tiny {mode}, {draft_name} draft", st)
        if not same:
            failures.append((k, dm, fd))
        if dm:
            cuts_on += st.grammar_cuts
    assert not failures, f"cells differing from plain decoding: {failures}"
    assert cuts_on == 0
    # earlier answers proposed wherever the grammar left a choice the draft model proposed at
    assert store is None or suffixed > 0 or drafted == 0
    assert lookup != "tree" or branched > 0  # the trees did branch


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.8, top_k=20, seed=3),
                                    SamplingParams(1.2, top_p=0.7, seed=4)],
                         ids=["greedy", "top-k", "top-p"])
def test_pruned_draft_picks_in_its_own_vocabulary_what_target_width_logits_pick(params):
    # A pruned-vocabulary draft proposes from its own logits (`own_logits`, `DraftSide.space`
    # of the `Proposer`): the mask and the (seed, position) noise read at its ids must give the same
    # token as the target-width logits it maps to (-inf off its vocabulary), exact ties
    # included (half the trials draw integer logits, so many tie; the draft's ids are not in
    # target order, as a distilled vocabulary's are not).
    rng = np.random.default_rng(0)
    V, Vd = 3000, 700
    ids = rng.choice(V, Vd, replace=False)
    draft = MappedDraft(nn.Module(), ids.tolist(), V, Vd)
    assert (np.diff(draft.space) > 0).all() and sorted(draft.space) == sorted(ids)
    ties = 0
    for trial in range(60):
        x = rng.normal(size=(Vd + 1,)) * 3
        raw = mx.array((np.round(x) if trial % 2 else x).astype(np.float32))
        row = rng.integers(-2**31, 2**31, (V + 31) // 32, dtype=np.int64).astype(np.int32)
        noise = position_noise(params.seed or 0, trial, V)
        full = apply_mask(draft.map_logits(raw), unpack_bitmask(mx.array(row), V))
        want = int(pick(full, params, None if params.greedy else mx.array(noise)).item())
        own = apply_mask(draft.own_logits(raw), mx.array(space_mask(row, draft.space)))
        got = pick(own, params, None if params.greedy else mx.array(noise[draft.space]))
        assert int(draft.space[int(got.item())]) == want, trial
        assert (space_mask(row, draft.space)
                == np.array(unpack_bitmask(mx.array(row), V))[draft.space]).all()
        m = np.array(full)
        ties += int((m == m.max()).sum() > 1)
    assert ties >= 10  # the tie trials did tie at the top (greedy's case)
