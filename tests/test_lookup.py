"""Prompt lookup (n-gram) proposals: the index and the cursor as pure logic, then the drafter
inside speculative decoding on tiny models (output must equal plain decoding)."""

from __future__ import annotations

import pytest

from specdec.lookup import LookupCursor, NgramIndex, SuffixCursor, SuffixStore


def test_longest_suffix_wins_and_latest_occurrence_is_used():
    idx = NgramIndex([1, 2, 3, 9, 2, 3, 7, 5, 2, 3], max_n=3)
    # Suffix (5, 2, 3) never appeared before; (2, 3) did, latest at 4..5 -> continuation 7.
    assert idx.find([5, 2, 3], min_n=2) == (6, 2)
    assert idx.tokens[6] == 7
    # (1, 2, 3) is a 3-gram match: its continuation is 9.
    assert idx.find([1, 2, 3], min_n=2) == (3, 3)


def test_suffix_shorter_than_min_ngram_finds_nothing():
    idx = NgramIndex([4, 5, 6, 4, 8], max_n=4)
    assert idx.find([0, 4], min_n=2) is None  # only the 1-gram (4,) repeats
    assert idx.find([0, 4], min_n=1) == (4, 1)


def test_the_context_tail_never_matches_itself():
    idx = NgramIndex([7, 8, 9], max_n=2)
    assert idx.find([8, 9], min_n=1) is None  # 9 has no continuation yet
    idx.extend([1])
    assert idx.find([8, 9], min_n=2) == (3, 2)


def test_cursor_follows_a_copied_span_and_researches_after_a_mismatch():
    prompt = [10, 11, 12, 13, 14, 15, 90, 10, 11, 20, 21]
    idx = NgramIndex(prompt, max_n=3)
    cur = LookupCursor(idx, min_n=2)
    ctx = [50, 10, 11]  # the output starts copying "10 11 ..."
    # Latest "10 11" is at 7..8, followed by 20.
    assert cur.next(ctx) == 20
    cur.advance(20)
    assert cur.next(ctx + [20]) == 21
    cur.advance(99)  # something else was proposed: the cursor lets go
    assert cur.next([20, 99]) is None


def test_min_ngram_and_max_n_are_validated():
    with pytest.raises(ValueError, match="max_n"):
        NgramIndex([], max_n=0)


def _propose(store: SuffixStore, key, context, n: int) -> list[int]:
    """What a cursor over the store proposes for `n` steps, each proposal taken."""
    cur, ctx, out = SuffixCursor(store.indexes(key), 2), list(context), []
    for _ in range(n):
        t = cur.next(ctx[-4:])
        if t is None:
            break
        out.append(t)
        cur.advance(t)
        ctx.append(t)
    return out


def test_earlier_answers_propose_the_next_one_from_its_first_token():
    store = SuffixStore()
    header = [90, 91]  # the template's answer header ends every prompt
    store.add("schema-a", [1, 2, 3, 4, 5], lead=[7, 8] + header)
    # The next answer to the same schema: its first tokens follow the header.
    assert _propose(store, "schema-a", [6] + header, 9) == [1, 2, 3, 4, 5]
    # No n-gram runs across the end of one answer into the next.
    store.add("schema-a", [30, 31, 32], lead=header)
    assert _propose(store, "schema-a", [4, 5], 3) == []


def test_the_keys_answers_come_first_then_any_answer():
    store = SuffixStore()
    store.add("a", [1, 2, 3, 4])
    store.add("b", [1, 2, 9, 9])
    assert _propose(store, "a", [1, 2], 2) == [3, 4]
    assert _propose(store, "b", [1, 2], 2) == [9, 9]
    # An unseen key falls back to every answer (the latest match)
    assert _propose(store, "c", [1, 2], 2) == [9, 9]
    assert _propose(store, None, [1, 2], 2) == [9, 9]


def test_the_store_is_bounded_in_tokens_and_keys():
    store = SuffixStore(max_tokens=100, key_tokens=100, max_keys=3, max_output=30)
    for i in range(50):
        store.add(f"k{i % 5}", list(range(i, i + 40)))  # cut to 30 tokens each
    assert store.n_tokens <= 4 * 100  # every output index, plus at most 3 keys'
    assert len(store._by_key) == 3
    # the newest answers are the ones kept
    assert _propose(store, "k4", [49, 50], 3) == [51, 52, 53]
    assert _propose(store, None, [1, 2], 3) == []
    store.add("k", [5])  # one token proposes nothing: not kept
    assert store.indexes("k") == store.indexes(None)


def test_continuations_give_one_run_per_first_token_longest_match_first():
    idx = NgramIndex([1, 2, 3, 9, 8, 5, 2, 3, 7, 6, 4, 3, 5], max_n=3)
    # (1, 2, 3) was followed by 9, (2, 3) last by 7, (3,) last by 5: one run each.
    assert idx.continuations([1, 2, 3], min_n=1, depth=2) == [[9, 8], [7, 6], [5]]
    assert idx.continuations([1, 2, 3], min_n=2, depth=4) == [[9, 8, 5, 2], [7, 6, 4, 3]]
    store = SuffixStore()
    store.add(None, [2, 3, 4, 5])
    store.add(None, [1, 2, 3, 8])
    # Older continuations come after the latest; a run stops at an answer's end; the same
    # first token twice is one run.
    every = store.indexes(None)[0]
    assert every.continuations([1, 2, 3], min_n=1, depth=4) == [[8], [4, 5]]
    assert every.continuations([9, 2, 3], min_n=1, depth=4) == [[8], [4, 5]]


def test_older_continuations_are_the_latest_of_each_other_token_bounded():
    idx = NgramIndex([5, 1, 5, 2, 5, 3, 5, 1, 5, 4], max_n=1, older=2)
    # 5 was followed by 1, 2, 3, 1, 4: the latest is 4, then 1 (its latest), then 3.
    assert idx.continuations([5], min_n=1, depth=1) == [[4], [1], [3]]
    assert NgramIndex(idx.tokens, max_n=1, older=0).continuations([5], 1, 1) == [[4]]


def _tree_proposals(store, key, context, **spec):
    from specdec.sampling import SamplingParams
    from specdec.speculative import (DraftSide, Proposer, RequestView, RoundBounds,
                                     SpecConfig, SpecStats)
    req = RequestView(context, 0, {0}, SamplingParams(), SpecConfig(4, suffix=True, **spec),
                      SpecStats(), 64, earlier=store.indexes(key))
    gen = Proposer(req, DraftSide(None, [], 64), RoundBounds(8, tree=8)).steps()
    with pytest.raises(StopIteration) as done:
        next(gen)  # no draft model: nothing to ask for
    return done.value.value


def test_the_other_answers_runs_become_branches_off_the_chain():
    store = SuffixStore()
    store.add("a", [1, 2, 3, 4, 5])
    store.add(None, [5, 6, 1, 2, 3, 9, 9])  # the latest answer: every answer's index
    p = _tree_proposals(store, "a", [7, 1, 2, 3], tree_min_score=0.2)
    # The key's run is the chain; every answer's run hangs off the context as a branch, its
    # tokens kept while the score (the rate so far, a prior of 1/2, per token) stays >= 0.2.
    assert (p.tokens[:p.chain], p.tokens[p.chain:]) == ([4, 5], [9, 9])
    assert p.parents == [-1, 0, -1, 2] and p.sources == ["suffixed"] * 4
    # Under a higher threshold the second run token goes (0.25 < 0.3), then the branch.
    assert _tree_proposals(store, "a", [7, 1, 2, 3], tree_min_score=0.3).tokens == [4, 5, 9]
    assert _tree_proposals(store, "a", [7, 1, 2, 3], tree_min_score=0.6).parents is None


def test_forced_tokens_run_on_past_the_open_share_where_one_request_runs():
    """Forced tokens (certain) do not use up a round's share: where one request runs, they
    run on to 16 proposals in all, the draft model still proposing its k; batched, a round
    proposes k in all as before."""
    from specdec.sampling import SamplingParams
    from specdec.speculative import (DraftSide, Forward, Proposer, RequestView, RoundBounds,
                                     SpecConfig, SpecStats)

    class Forcing:  # a grammar that forces every token but every fifth (free)
        def __init__(self, n=0):
            self.n = n

        def deep_copy(self):
            return Forcing(self.n)

        def is_error(self):
            return False

        def consume_token(self, tok):
            self.n += 1
            return True

        def unsafe_compute_mask_ptr(self, ptr, nbytes):  # (what llguidance's numpy calls)
            row = np.ctypeslib.as_array((ctypes.c_int32 * (nbytes // 4)).from_address(ptr))
            row[:] = -1 if self.n % 5 == 0 else 0
            if self.n % 5:
                row[0] = 1 << 3  # token 3 only

    import ctypes

    import mlx.core as mx
    import numpy as np

    def propose(run_on: bool, k: int = 2) -> list[str]:
        req = RequestView([1, 2], 0, {0}, SamplingParams(), SpecConfig(k), SpecStats(), 32,
                          Forcing())
        gen = Proposer(req, DraftSide(object(), [], 32), RoundBounds(100, run_on=run_on)
                       ).steps()
        ask = next(gen)
        try:
            while True:
                if isinstance(ask, Forward):
                    ask = gen.send(mx.arange(32, dtype=mx.float32))  # picks token 31
                else:
                    mx.eval(*ask.arrays)
                    ask = gen.send(None)
        except StopIteration as done:
            return done.value.sources

    run = ["drafted"] + ["forced"] * 4
    # Two drafted, the forced runs after each (10 in all, past cheap_k = 4); the next open
    # position ends the round (the draft's share is spent).
    assert propose(True) == run * 2
    assert propose(True, k=4) == (run * 4)[:16]  # 16 at most
    assert propose(False) == ["drafted", "forced"]  # batched: k in all
