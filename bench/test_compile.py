"""Compile cost: a unique schema every request (cache defeated) vs the same schema, as
compile time and as time to first token (seed 002: json vs json-unique)."""

from __future__ import annotations

import copy
import itertools
import statistics
import time

from bench import results
from bench.workloads import CASES
from specdec.grammar import Constraint

_counter = itertools.count()


def unique(schema: dict) -> dict:
    """The same schema with a fresh description: a new canonical text, a cache miss."""
    s = copy.deepcopy(schema)
    s["description"] = f"request {next(_counter)} {time.time_ns()}"
    return s


def ttft(engine, ids, constraint) -> float:
    t0 = time.perf_counter()
    req = engine.prepare(ids, constraint=constraint, max_tokens=2, spec=None)
    stream = engine.submit(req)
    next(iter(stream))  # the first event: the first token's text
    stream.cancel()
    for _ in stream:  # drain to the end (cancelled within a round)
        pass
    return time.perf_counter() - t0


def test_compile_and_ttft_unique_vs_cached(benchmark, engine):
    schemas = [c.value for c in CASES if c.kind == "json_schema"]
    compile_ms = []
    for _ in range(4):
        for s in schemas:
            t0 = time.perf_counter()
            engine.compiler.compile(Constraint.json_schema(unique(s)))
            compile_ms.append((time.perf_counter() - t0) * 1e3)
    results.add("compile_ms_p50_unique", statistics.median(compile_ms), "ms",
                f"{len(compile_ms)} unique schemas (validate + matcher build)")
    results.add("compile_ms_max_unique", max(compile_ms), "ms", "same")

    case = CASES[0]
    ids = engine.chat_prompt(case.messages(), constrained=True)
    cached = Constraint.json_schema(case.value)
    ttft(engine, ids, cached)  # warm: prompt KV and grammar cached
    ratios = []

    def pair() -> None:
        u = ttft(engine, ids, Constraint.json_schema(unique(case.value)))
        c = ttft(engine, ids, cached)
        ratios.append(u / c)

    benchmark.pedantic(pair, rounds=8, iterations=1)
    results.add("ttft_unique_over_cached", statistics.median(ratios), "ratio",
                "time to first token, unique schema vs cached, same prompt, median of 8 pairs")
