"""Token trees (`SpecConfig.tree`) against chains, on the embedded model with the distilled
draft and the serving defaults: one request at a time (c1) and eight decoding together in
one batch (c8, continuous-batching rounds), arms interleaved per prompt, every answer
checked equal to plain decoding's; and mean accepted tokens per round for each."""

from __future__ import annotations

import dataclasses
import statistics
import time

import pytest

from bench import results
from bench.harness import (budgets_note, checked_arm, interleaved, paired_ratio, plain_answers,
                           workload_items)
from bench.workloads import CASES, EXTRACTION
from specdec.speculative import SpecConfig

K = 4
MAX_TOKENS = 64
CHAIN = dataclasses.replace(SpecConfig.serving(), suffix=False, tree=0)  # the shipped defaults' chain
TREE = dataclasses.replace(CHAIN, tree=8)  # the threshold priced by the engine (`TreeCosts`)
PINNED = dataclasses.replace(TREE, tree_min_score=0.15)  # a fixed threshold
CASES_C1 = [c for c in CASES if c.kind in ("json_schema", "regex")] + list(EXTRACTION[:2])


@pytest.fixture(scope="module")
def distilled(engine):
    import specdec
    from specdec.engine import Engine

    return Engine(engine.target, specdec.load("default-draft"), CHAIN)


def test_tree_over_chain_c1(benchmark, distilled):
    e = distilled
    items = workload_items(e, CASES_C1, MAX_TOKENS)
    want = plain_answers(e, items)
    arms = {"chain": checked_arm(want, CHAIN), "tree": checked_arm(want, TREE),
            "tree_pinned": checked_arm(want, PINNED)}
    rounds = results.rounds(1)
    res = benchmark.pedantic(lambda: interleaved(e, items, arms, rounds), rounds=1,
                             iterations=1)
    note = (f"{len(items)} prompts x {rounds} rounds, one request at a time; serving defaults "
            f"(distilled draft k={K}, gated p=0.3, lookup), tree={TREE.tree}; every answer "
            f"equal to plain decoding's; {budgets_note(items, MAX_TOKENS)}")
    ch, tr = res["chain"], res["tree"]
    results.add("tree_over_chain_c1", paired_ratio(tr, ch), "ratio", note)
    results.add("tree_pinned_over_chain_c1", paired_ratio(res["tree_pinned"], ch), "ratio",
                note + "; the threshold pinned at 0.15")
    results.add("tree_threshold_c1", e.tree_costs.threshold(), "score",
                "the engine's priced branch threshold after the run (over 1: chains)")
    for name, r in res.items():
        results.add(f"accepted_per_round_{name}", r.total("accepted") / max(r.total("rounds"), 1),
                    "tokens", note)
    results.add("tree_branch_acceptance", tr.total("branched_accepted")
                / max(tr.total("branched"), 1), "fraction", "branch proposals accepted")


def _batch(e, items, spec) -> tuple[list[list[int]], float]:
    """Decode every item at once (one batch of rounds, as the scheduler does): (answers,
    seconds)."""
    from specdec.core import prefill, run_round

    states = [e.new_state(e.prepare(i.ids, constraint=i.constraint, max_tokens=i.budget,
                                    spec=spec)) for i in items]
    for s in states:
        prefill(e.models, s)
    outs = [[] for _ in states]
    t0 = time.perf_counter()
    while not all(s.done for s in states):
        run_round(e.models, states)
        for o, s in zip(outs, states):
            o += s.new_tokens
    dt = time.perf_counter() - t0
    for s in states:
        assert s.error is None, s.error
        s.release()
    return outs, dt


def test_tree_over_chain_c8(benchmark, distilled):
    e = distilled
    items = workload_items(e, CASES_C1, MAX_TOKENS)
    items = (items * 8)[:8]
    plain, _ = _batch(e, items, None)  # the same batch decoded plainly
    pairs = results.rounds(2)

    def run():
        ratios, differ = [], 0
        for r in range(pairs):
            arms = [("chain", CHAIN), ("tree", TREE)]
            speed, outs = {}, {}
            for name, spec in (arms if r % 2 == 0 else arms[::-1]):
                outs[name], dt = _batch(e, items, spec)
                speed[name] = sum(map(len, outs[name])) / dt
            # On a BLAS that is not batch-invariant, rows batched differently may flip a
            # near-tie: answers are counted against the plain batch's (the exactness suite
            # checks equality on the reference BLAS).
            differ += sum(a != b for name in outs for a, b in zip(outs[name], plain))
            ratios.append(speed["tree"] / speed["chain"])
        return ratios, differ
    ratios, differ = benchmark.pedantic(run, rounds=1, iterations=1)
    results.add("tree_over_chain_c8", statistics.median(ratios), "ratio",
                f"8 requests in one batch of rounds, median of {pairs} adjacent pairs (order "
                f"alternating); draft-max-batch {e.draft_max_batch}: a batch past it verifies "
                f"chains; answers differing from the plain batch's: {differ} of "
                f"{2 * pairs * len(items)} (near-ties on a BLAS that is not batch-invariant); "
                f"{budgets_note(items, MAX_TOKENS)}")
