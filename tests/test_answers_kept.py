"""Answers kept hot: a finished request's prompt and answer stay in the prompt store
(`core.keep_answer`), so a conversation's next turn, which sends the answer back in its
history, restores it rather than computing it again; and a request served so is exact.

On the reference BLAS (this suite's), the next turn served from the store gives the tokens
and logprobs of the same request computed cold (no store: its prompt prefilled from position
0 in chunks of `CHUNK` tokens, so the restored prefix ends inside a chunk of the cold
side's), and the oracle's tokens (one whole-prompt forward, one token at a time): plain and
speculative, greedy and seeded (the oracle on greedy), alone and in a batch; its usage
counts the restored positions as cached.
"""

from __future__ import annotations

import dataclasses

import pytest

from oracle import reference_decode
from specdec.engine import Engine
from specdec.grammar import Constraint
from specdec.sampling import SamplingParams
from specdec.speculative import SpecConfig
from tests import tally

SYSTEM = "Answer in plain words, one short line per item. " * 3
CHUNK = 24  # the cold side's prefill chunk: prompts take several
FIRST = [{"role": "system", "content": SYSTEM},
         {"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 16
MODES = {"greedy": SamplingParams(), "seeded": SamplingParams(0.8, top_k=40, seed=11)}
ARMS = {"plain": None, "speculative": SpecConfig(k=3)}
# A first turn whose answer ends where its grammar does (the last token out may follow a
# rejected proposal in the round that ends it): a JSON answer, speculative.
COLOURS = Constraint.json_schema({"type": "object", "properties": {"colours": {
    "type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["colours"], "additionalProperties": False})
# (each mode and arm once; the suite's time is bounded)
CELLS = [("plain", "greedy", None), ("speculative", "seeded", None),
         ("speculative", "greedy", COLOURS)]


def _shared(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _turns(e: Engine, params: SamplingParams, spec, constraint: Constraint | None = None
           ) -> tuple[list[int], list[int], int]:
    """Turn one on `e` (kept in its store), then the next turn's prompt (the history with
    that answer and a new question); and what the store holds of turn one: its prompt and
    answer as far as the caches were fed (the answer's last token only where an end token
    followed it), and the first prompt's length."""
    ids1 = e.chat_prompt(FIRST, constrained=constraint is not None)
    r1 = e.generate(e.prepare(ids1, max_tokens=MAX_TOKENS * 2, sampling=params, spec=spec,
                              logprobs=3, constraint=constraint))
    second = FIRST + [{"role": "assistant", "content": r1.text},
                      {"role": "user", "content": "And three more?"}]
    fed = r1.tokens if r1.finish_reason == "stop" else r1.tokens[:-1]
    return list(ids1) + list(fed), e.chat_prompt(second, constrained=False), len(ids1)


@pytest.fixture(scope="module")
def cold(embedded, distilled):
    e = Engine(embedded, distilled)
    e.kv_store.capacity = 0  # nothing is ever restored: every prompt computed from 0
    e.generate(e.prepare([1, 2, 3], max_tokens=1))  # (makes its scheduler)
    assert e._inline is not None
    e._inline.chunk = CHUNK
    return e


@pytest.mark.parametrize("arm, mode, constraint", CELLS,
                         ids=[f"{a}-{m}{'-json' if c else ''}" for a, m, c in CELLS])
def test_the_next_turn_restores_the_answer_and_decodes_as_cold(embedded, distilled, cold,
                                                               arm, mode, constraint):
    params, spec = MODES[mode], ARMS[arm]
    warm = Engine(embedded, distilled)
    held, ids2, first = _turns(warm, params, spec, constraint)
    expect = _shared(ids2[:-1], held)
    # the answer restored too (all of it but where the template's rendering parts from it)
    assert expect >= len(held) - 1 and expect > first, (expect, len(held), first)
    req = dict(max_tokens=MAX_TOKENS, sampling=params, spec=spec, logprobs=3)
    got = warm.generate(warm.prepare(ids2, **req))
    assert got.usage.cached_tokens == expect and expect % CHUNK and len(ids2) > 2 * CHUNK
    want = cold.generate(cold.prepare(ids2, **req))
    assert want.usage.cached_tokens == 0
    same = (got.tokens, got.finish_reason, got.logprobs) == (want.tokens, want.finish_reason,
                                                             want.logprobs)
    tally.record("answers kept: next turn restored vs cold (tokens, logprobs)", same)
    assert (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason)
    assert got.logprobs == want.logprobs
    if mode != "greedy":
        return  # (the oracle's seeded draw is the engine's: tests/test_decode.py)
    # the oracle: the whole prompt in one forward, then a token at a time
    o = reference_decode(embedded.model, ids2, vocab_size=embedded.vocab_size,
                         eos_token_ids=embedded.eos_token_ids, max_tokens=MAX_TOKENS,
                         temperature=params.temperature, top_k=params.top_k,
                         top_p=params.top_p, seed=params.seed or 0)
    tally.record("answers kept: next turn restored vs oracle", list(o.tokens) == list(got.tokens))
    assert list(o.tokens) == list(got.tokens)


def test_a_next_turn_in_a_batch_decodes_as_alone(embedded, distilled, cold):
    warm = Engine(embedded, distilled)
    _, ids2, _ = _turns(warm, SamplingParams(), None)
    others = [warm.chat_prompt([{"role": "user", "content": q}], constrained=False)
              for q in ("Count to five.", "Name a river.")]
    req = dict(max_tokens=MAX_TOKENS, logprobs=3)
    streams = [warm.submit(warm.prepare(ids, **req)) for ids in [others[0], ids2, *others[1:]]]
    done = [list(s)[-1] for s in streams]
    needle = done[1]
    assert needle.usage.cached_tokens > 0
    alone = cold.generate(cold.prepare(ids2, **req))
    tally.record("answers kept: restored needle in a batch vs cold alone",
                 (needle.tokens, needle.logprobs) == (alone.tokens, alone.logprobs))
    assert (needle.tokens, needle.logprobs) == (alone.tokens, alone.logprobs)


def test_the_prompt_alone_is_dropped_for_the_answer_and_both_count_in_bytes(embedded):
    e = Engine(embedded, None)
    ids1 = e.chat_prompt(FIRST, constrained=False)
    r = e.generate(e.prepare(ids1, max_tokens=MAX_TOKENS))
    fed = r.tokens if r.finish_reason == "stop" else r.tokens[:-1]
    assert not e.kv_store.has(embedded.model, ids1[:-1])
    assert e.kv_store.has(embedded.model, list(ids1) + list(fed))
    assert e.kv_store.nbytes == sum(
        a.nbytes for _, states, _ in e.kv_store._entries.values() for st in states
        for a in st if hasattr(a, "nbytes"))


def test_only_a_request_a_next_turn_likely_follows_keeps_its_answer(embedded):
    # A one-shot request (no tools, no earlier turn) keeps only its prompt's state, as before
    # answers were kept: it pays nothing for a next turn that never comes. Tools, an earlier
    # turn, or `continues` keep the answer; `continues=False` keeps nothing past the prompt.
    from specdec.request import GenerateRequest, Message, Tool

    tool = Tool("colours", "List colours", {"type": "object", "properties": {}})
    msgs = tuple(Message(m["role"], m["content"]) for m in FIRST)
    later = (*msgs, Message("assistant", "Red."), Message("user", "And two more?"))
    # (decoded: the first and the fourth; the others' prompts are long on this BLAS)
    cases = [(GenerateRequest(messages=msgs), False, True),
             (GenerateRequest(messages=msgs, tools=(tool,), tool_choice="none"), True, False),
             (GenerateRequest(messages=later), True, False),
             (GenerateRequest(messages=msgs, continues=True), True, True),
             (GenerateRequest(messages=later, continues=False), False, False)]
    e = Engine(embedded, None)
    for greq, kept, decoded in cases:
        e.kv_store.clear()
        greq = dataclasses.replace(greq, max_tokens=3)
        req = e.prepare(greq)
        assert req.keep is kept and greq.next_turn_likely is kept, greq
        if not decoded:
            continue
        r = e.generate(req)
        longest = max(len(k[1]) for k in e.kv_store._entries)
        assert (longest > len(req.prompt_ids)) is kept, (greq, longest, r.tokens)


def test_every_kept_state_is_its_tokens_prefilled_cold(embedded, distilled):
    # Whatever ends a speculative request (an end token, its budget mid-round, its grammar's
    # end; rejected proposals or a token tree's branch in the last round), the state kept
    # under a key is exactly that key's tokens prefilled from scratch (reference BLAS:
    # bitwise), target and draft.
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    e = Engine(embedded, distilled)
    asks = [("Count from one to ten.", None, n) for n in range(5, 9)] + [
        ("Name three colours.", COLOURS, 40)]
    specs = [SpecConfig(k=4), SpecConfig(k=4, lookup=True, tree=4, tree_min_score=0.0)]
    for i, (text, constraint, budget) in enumerate(asks):
        ids = e.chat_prompt([{"role": "user", "content": text}],
                            constrained=constraint is not None)
        e.generate(e.prepare(ids, max_tokens=budget, spec=specs[i % 2],
                             constraint=constraint))
    checked = 0
    for (_, key), (model, states, _) in list(e.kv_store._entries.items()):
        cache = make_prompt_cache(model)
        model(mx.array([list(key)], dtype=mx.int32), cache=cache)
        keys, values, n = states[0]
        assert n == len(key)
        want = cache[0].state
        assert mx.array_equal(keys[..., :n, :], want[0][..., :n, :]), key[-5:]
        assert mx.array_equal(values[..., :n, :], want[1][..., :n, :]), key[-5:]
        checked += 1
    assert checked >= len(asks)
