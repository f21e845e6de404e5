"""Plain decoding: constrained vs unconstrained tok/s on the embedded model, one process,
arms interleaved (A B, then B A), medians over rounds."""

from __future__ import annotations

import os
import statistics

import pytest

from bench import results
from bench.workloads import CASES
from specdec.grammar import Constraint

ROUNDS = int(os.environ.get("SPECDEC_BENCH_ROUNDS", "3"))
MAX_TOKENS = 64
BENCH_CASES = [c for c in CASES if c.kind in ("json_schema", "regex")]


@pytest.fixture(scope="module")
def workload(engine):
    """(prompt ids, constraint, token budget) per case; the budget is what the constrained
    arm generates, so both arms decode about the same number of tokens."""
    items = []
    for case in BENCH_CASES:
        c = Constraint(case.kind, case.value)  # type: ignore[arg-type]
        ids = engine.chat_prompt(case.messages(), constrained=True)
        n = len(engine.generate(engine.prepare(ids, constraint=c, max_tokens=MAX_TOKENS)).tokens)
        items.append((ids, c, n))
    return items


def run_arm(engine, workload, constrained: bool) -> tuple[int, float, float]:
    """Decode every item once; returns (tokens, decode seconds, host mask seconds)."""
    tokens, seconds, mask = 0, 0.0, 0.0
    for ids, c, n in workload:
        r = engine.generate(engine.prepare(ids, constraint=c if constrained else None,
                                           max_tokens=n))
        tokens += r.stats.completion_tokens
        seconds += r.stats.decode_s
        mask += r.stats.mask_s
    return tokens, seconds, mask


def test_plain_constrained_vs_unconstrained(benchmark, engine, workload):
    speeds: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    tokens: dict[str, int] = {}
    mask_per_token: list[float] = []

    def one_round() -> None:
        order = ["unconstrained", "constrained"]
        if len(speeds["constrained"]) % 2:
            order.reverse()
        for arm in order:
            n, s, m = run_arm(engine, workload, arm == "constrained")
            speeds[arm].append(n / s)
            tokens[arm] = n
            if arm == "constrained":
                mask_per_token.append(m / n)

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    un = statistics.median(speeds["unconstrained"])
    co = statistics.median(speeds["constrained"])
    benchmark.extra_info.update({"unconstrained_tok_s": un, "constrained_tok_s": co,
                                 "ratio": co / un, "tokens": tokens})
    note = f"median of {ROUNDS} interleaved rounds, {len(workload)} prompts"
    results.add("plain_unconstrained_tok_s", un, "tok/s",
                f"{note}, {tokens['unconstrained']} tokens/round")
    results.add("plain_constrained_tok_s", co, "tok/s",
                f"{note}, {tokens['constrained']} tokens/round")
    results.add("plain_constrained_over_unconstrained", co / un, "ratio", note)
    results.add("mask_fill_ms_per_token", statistics.median(mask_per_token) * 1e3, "ms",
                "host llguidance fill per constrained token")
    assert un > 0 and co > 0
