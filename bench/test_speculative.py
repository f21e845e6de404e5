"""Speculative decoding with the target as its own draft (acceptance known in advance):
constrained vs unconstrained, spec vs plain, draft masking on vs off. One process, arms
interleaved per prompt."""

from __future__ import annotations

import os

import pytest

from bench import results
from bench.harness import arm, budgets_note, interleaved, paired_ratio, workload_items
from bench.workloads import CASES
from specdec.speculative import SpecConfig

QUICK = results.QUICK
ROUNDS = results.rounds(1)
K = int(os.environ.get("SPECDEC_BENCH_K", "4"))
MAX_TOKENS = 64
BENCH_CASES = [c for c in CASES if c.kind in ("json_schema", "regex")]


@pytest.fixture(scope="module")
def self_engine(engine):
    from specdec.engine import Engine

    return Engine(engine.target, engine.target, SpecConfig(K))


def test_speculative_arms(benchmark, self_engine):
    items = workload_items(self_engine, BENCH_CASES, MAX_TOKENS)
    arms = {
        "spec_unconstrained": arm(False, SpecConfig(K)),
        "spec_constrained": arm(True, SpecConfig(K)),
        "spec_constrained_unmasked": arm(True, SpecConfig(K, draft_masking=False)),
        "plain_constrained_in_spec_run": arm(True, None),
    }
    res = benchmark.pedantic(lambda: interleaved(self_engine, items, arms, ROUNDS), rounds=1,
                             iterations=1)
    su, sc = res["spec_unconstrained"], res["spec_constrained"]
    off, pc = res["spec_constrained_unmasked"], res["plain_constrained_in_spec_run"]
    note = (f"draft = target, k={K}; {ROUNDS} rounds x {len(items)} prompts; "
            f"{budgets_note(items, MAX_TOKENS)}")
    for name, r in res.items():
        results.add(f"{name}_tok_s", r.median_tok_s, "tok/s", note)
    results.add("spec_constrained_over_unconstrained", paired_ratio(sc, su), "ratio", note)
    results.add("spec_over_plain_constrained", paired_ratio(sc, pc), "ratio", note)
    results.add("draft_masking_on_over_off", paired_ratio(sc, off), "ratio", note)
    for name, r in (("on", sc), ("off", off)):
        results.add(f"draft_masking_acceptance_{name}",
                    r.total("accepted") / max(r.total("proposed"), 1), "fraction", note)
        results.add(f"grammar_cuts_{name}", r.total("grammar_cuts"), "cuts", note)
    results.add("forced_fraction_of_proposals", sc.total("forced") / max(sc.total("proposed"), 1),
                "fraction", "grammar-forced proposals (free drafts), masking on")
    benchmark.extra_info.update({n: r.median_tok_s for n, r in res.items()})
    assert sc.total("grammar_cuts") == 0


def test_forced_drafting_and_k_sweep(benchmark, self_engine):
    items = workload_items(self_engine, BENCH_CASES[:4] if QUICK else BENCH_CASES, MAX_TOKENS)
    ks = (1, 2, 4, 8)
    arms = {f"k{k}": arm(True, SpecConfig(k)) for k in ks}
    arms["k4_no_forced"] = arm(True, SpecConfig(4, forced_drafting=False))
    res = benchmark.pedantic(lambda: interleaved(self_engine, items, arms, ROUNDS), rounds=1,
                             iterations=1)
    note = (f"draft = target, constrained; {ROUNDS} rounds x {len(items)} prompts; "
            f"{budgets_note(items, MAX_TOKENS)}")
    for k in ks:
        r = res[f"k{k}"]
        results.add(f"spec_constrained_k{k}_tok_s", r.median_tok_s, "tok/s", note)
        results.add(f"spec_constrained_k{k}_acceptance",
                    r.total("accepted") / max(r.total("proposed"), 1), "fraction", note)
    results.add("forced_drafting_on_over_off", paired_ratio(res["k4"], res["k4_no_forced"]),
                "ratio", note + ", k=4")
