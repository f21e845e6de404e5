"""Suffix proposals from earlier answers (`lookup.SuffixStore`) on a repeated-schema workload:
the serving defaults with and without them, and with them and token trees, arms interleaved
per prompt, each arm checked to give the tokens plain decoding gives. Each suffix arm's store
holds only its own earlier answers, to the tickets before (it starts empty)."""

from __future__ import annotations

import dataclasses

from bench import results
from bench.harness import (Arm, budgets_note, checked_arm, interleaved, paired_ratio,
                           plain_answers, workload_items)
from bench.workloads import REPEATED
from specdec.lookup import SuffixStore
from specdec.speculative import SpecConfig

K = 4
MAX_TOKENS = 64
# the shipped defaults' chain (`SpecConfig.serving()` without earlier answers and trees)
SERVING = dataclasses.replace(SpecConfig.serving(), suffix=False, tree=0)


def own_store(arm: Arm) -> Arm:
    """The arm with a store of its own (its own earlier answers only), swapped in for each
    call."""
    store = SuffixStore()

    def run(engine, ids, c, n):
        kept, engine.suffixes = engine.suffixes, store
        try:
            return arm(engine, ids, c, n)
        finally:
            engine.suffixes = kept
    return run


def test_suffix_over_lookup_repeated_schema(benchmark, engine):
    import specdec
    from specdec.engine import Engine

    e = Engine(engine.target, specdec.load("default-draft"), SERVING)
    e.suffixes = SuffixStore()
    items = workload_items(e, REPEATED, MAX_TOKENS)
    want = plain_answers(e, items)

    suffix = dataclasses.replace(SERVING, suffix=True)
    arms = {"lookup": checked_arm(want, SERVING), "suffix": checked_arm(want, suffix),
            "suffix_tree": own_store(checked_arm(want, dataclasses.replace(suffix, tree=8)))}
    # One pass: each ticket's answer proposes for the later tickets only (a second pass
    # would find its own answer in the store).
    rounds = 1
    res = benchmark.pedantic(lambda: interleaved(e, items, arms, rounds), rounds=1,
                             iterations=1)
    note = (f"{len(items)} tickets, one schema, serving defaults (distilled draft k={K}, "
            f"gated p=0.3, lookup) with/without suffix proposals; {rounds} rounds; every "
            f"answer equal to plain decoding's; {budgets_note(items, MAX_TOKENS)}")
    su, lo = res["suffix"], res["lookup"]
    results.add("suffix_over_lookup_repeated_schema", paired_ratio(su, lo), "ratio", note)
    results.add("suffix_tree_over_suffix_repeated_schema", paired_ratio(res["suffix_tree"], su),
                "ratio", "the suffix arm with token trees (tree=8: the earlier answers' other "
                "runs and the draft's alternatives branch), its own store")
    results.add("suffix_acceptance", su.total("suffixed_accepted") / max(su.total("suffixed"), 1),
                "fraction", "suffix proposals accepted")
    results.add("suffix_fraction_of_tokens", su.total("suffixed_accepted")
                / max(sum(su.tokens), 1), "fraction", "output tokens that came from earlier "
                                                     "answers")
    for name, r in res.items():
        results.add(f"accepted_per_round_{name}_repeated_schema",
                    r.total("accepted") / max(r.total("rounds"), 1), "tokens", note)
