"""Plain decoding: constrained vs unconstrained tok/s on the embedded model, one process,
arms interleaved per prompt, medians over rounds."""

from __future__ import annotations

import statistics

from bench import results
from bench.harness import arm, budgets_note, interleaved, paired_ratio, workload_items
from bench.workloads import CASES
from specdec.speculative import SpecConfig

QUICK = results.QUICK
ROUNDS = results.rounds(2)
MAX_TOKENS = 64
BENCH_CASES = [c for c in CASES if c.kind in ("json_schema", "regex")]


def test_plain_constrained_vs_unconstrained(benchmark, engine):
    items = workload_items(engine, BENCH_CASES, MAX_TOKENS)
    arms = {"unconstrained": arm(False), "constrained": arm(True),
            "constrained_jump_forward": arm(True, SpecConfig(8))}
    res = benchmark.pedantic(lambda: interleaved(engine, items, arms, ROUNDS), rounds=1,
                             iterations=1)
    un, co, jf = res["unconstrained"], res["constrained"], res["constrained_jump_forward"]
    ratio = paired_ratio(co, un)
    note = (f"{ROUNDS} rounds x {len(items)} prompts, arms back to back per prompt; "
            f"{budgets_note(items, MAX_TOKENS)}")
    benchmark.extra_info.update({"unconstrained_tok_s": un.median_tok_s,
                                 "constrained_tok_s": co.median_tok_s, "ratio": ratio})
    results.add("plain_unconstrained_tok_s", un.median_tok_s, "tok/s",
                f"{note}; {sum(un.tokens) // ROUNDS} tokens/round")
    results.add("plain_constrained_tok_s", co.median_tok_s, "tok/s",
                f"{note}; {sum(co.tokens) // ROUNDS} tokens/round")
    results.add("plain_constrained_over_unconstrained", ratio, "ratio",
                "median of per-prompt paired tok/s ratios")
    results.add("jump_forward_constrained_tok_s", jf.median_tok_s, "tok/s",
                f"{note}; no draft model: runs of grammar-forced tokens in one forward")
    results.add("jump_forward_constrained_over_unconstrained", paired_ratio(jf, un), "ratio",
                "median of per-prompt paired tok/s ratios")
    results.add("jump_forward_forced_fraction",
                jf.total("forced") / max(sum(jf.tokens), 1), "fraction",
                "output tokens proposed as grammar-forced")
    visible = [1e3 / c - 1e3 / u for c, u in zip(co.tok_s, un.tok_s)]
    results.add("visible_mask_overhead_ms_per_token", statistics.median(visible), "ms",
                "constrained minus unconstrained ms/token, paired per prompt (median)")
    step_ms = 1e3 / un.median_tok_s
    results.add("visible_mask_overhead_fraction_of_step", statistics.median(visible) / step_ms,
                "fraction", f"of an unconstrained decode step ({step_ms:.1f} ms)")
    per_token_mask = [s.counters.mask_s / s.completion_tokens for s in co.stats]
    results.add("mask_fill_ms_per_token", statistics.median(per_token_mask) * 1e3, "ms",
                "host llguidance fill per constrained token (median over prompts)")
    assert un.median_tok_s > 0 and co.median_tok_s > 0
