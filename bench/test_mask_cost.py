"""Mask cost, split as seed 002 says: llguidance fill (host, per token), apply (device, per
token), and what is left visible per token after overlap (from the paired plain run)."""

from __future__ import annotations

import time

import llguidance.numpy as llnp
import mlx.core as mx
import numpy as np

from bench import results
from bench.harness import minimum_budget
from bench.workloads import CASES
from specdec.grammar import Constraint
from specdec.sampling import apply_mask, unpack_bitmask

MAX_TOKENS = 48  # the real outputs replayed: each case decoded plainly within this


def test_mask_fill_and_apply_cost(benchmark, engine):
    # Replay real outputs through fresh matchers, timing every fill.
    fills: list[float] = []
    V = engine.target.vocab_size
    bitmask = llnp.allocate_token_bitmask(1, V)
    cases = [c for c in CASES if c.kind != "json_object"]
    for case in cases:
        minimum_budget(engine, case.name, engine.chat_prompt(case.messages(), constrained=True),
                       Constraint(case.kind, case.value), MAX_TOKENS)
    for case in results.prompts(cases):
        c = Constraint(case.kind, case.value)  # type: ignore[arg-type]
        ids = engine.chat_prompt(case.messages(), constrained=True)
        out = engine.generate(engine.prepare(ids, constraint=c, max_tokens=MAX_TOKENS,
                                             spec=None))
        for _ in range(3):
            m = engine.compiler.compile(c).matcher()
            for t in out.tokens:
                t0 = time.perf_counter()
                llnp.fill_next_token_bitmask(m, bitmask, 0)
                fills.append(time.perf_counter() - t0)
                m.consume_token(t)
    us = np.array(fills) * 1e6
    results.add("mask_fill_us_p50", float(np.percentile(us, 50)), "us",
                f"llguidance numpy fill, {us.size} fills replaying real outputs")
    results.add("mask_fill_us_p99", float(np.percentile(us, 99)), "us", "same fills")

    rng = np.random.default_rng(0)
    logits = mx.array(rng.standard_normal(V).astype(np.float32))
    bm = mx.array(np.packbits(rng.random(V) < 0.05, bitorder="little").view(np.int32))
    mx.eval(logits, bm)

    def masked() -> None:
        mx.eval(mx.argmax(apply_mask(logits, unpack_bitmask(bm, V))))

    def bare() -> None:
        mx.eval(mx.argmax(logits))

    def per_call(f, n: int = 300) -> float:
        for _ in range(20):
            f()
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        return (time.perf_counter() - t0) / n

    benchmark.pedantic(masked, rounds=50, iterations=1)
    apply_ms = (per_call(masked) - per_call(bare)) * 1e3
    results.add("mask_apply_ms_per_token", apply_ms, "ms",
                "device unpack + where, over a bare argmax, one row of V logits")
