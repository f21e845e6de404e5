"""Compile cost: a unique schema every request (cache defeated) vs the same schema, as
compile time and as time to first token (seed 002: json vs json-unique)."""

from __future__ import annotations

import copy
import itertools
import os
import statistics
import time

from bench import results
from bench.harness import minimum_budget
from bench.workloads import CASES
from specdec.grammar import Constraint
from specdec.config import DEFAULT_MAX_TOKENS

# The time-to-first-token requests' budget: what a request that names none gets (each is
# cancelled at its first token; the engine requires at least the constraint's minimum).
TTFT_MAX_TOKENS = DEFAULT_MAX_TOKENS
PAIRS = results.size(8, 8, 2)  # time-to-first-token pairs per figure

_counter = itertools.count()


def unique(schema: dict) -> dict:
    """The same schema with a fresh description: a new canonical text, a cache miss."""
    s = copy.deepcopy(schema)
    s["description"] = f"request {next(_counter)} {time.time_ns()}"
    return s


def ttft(engine, ids, constraint) -> float:
    t0 = time.perf_counter()
    req = engine.prepare(ids, constraint=constraint, max_tokens=TTFT_MAX_TOKENS, spec=None)
    stream = engine.submit(req)
    next(iter(stream))  # the first event: the first token's text
    stream.cancel()
    for _ in stream:  # drain to the end (cancelled within a round)
        pass
    return time.perf_counter() - t0


def test_compile_and_ttft_unique_vs_cached(benchmark, engine):
    schemas = [c.value for c in CASES if c.kind == "json_schema"]
    compile_ms = []
    for _ in range(results.size(4, 4)):
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
    minimum_budget(engine, case.name, ids, cached, TTFT_MAX_TOKENS)
    ttft(engine, ids, cached)  # warm: prompt KV and grammar cached
    ratios = []

    def pair() -> None:
        u = ttft(engine, ids, Constraint.json_schema(unique(case.value)))
        c = ttft(engine, ids, cached)
        ratios.append(u / c)

    benchmark.pedantic(pair, rounds=PAIRS, iterations=1)
    results.add("ttft_unique_over_cached", statistics.median(ratios), "ratio",
                f"time to first token, unique schema vs cached, same prompt, median of {PAIRS} "
                "pairs; "
                f"max_tokens {TTFT_MAX_TOKENS}, cancelled at the first token")


def test_ttft_with_a_stored_earlier_turn_vs_cold(benchmark, engine):
    """A conversation's next turn: its prompt starts with the previous turn's, which the
    store holds (`PromptKVCache.restore_prefix`), vs the same kind of prompt with the store
    empty. Every prompt is new (its last message numbered), so no whole prompt is reused."""
    case = CASES[0]
    first = [*case.messages(), {"role": "assistant", "content": "Here is the JSON you asked "
                                "for, with every field filled in from the text above."}]
    count = itertools.count()

    def turn() -> list[int]:
        msgs = [*first, {"role": "user", "content": f"Now the same for entry {next(count)}, "
                                                     "please."}]
        return engine.chat_prompt(msgs, constrained=True)

    c = Constraint.json_schema(case.value)
    head = engine.chat_prompt(first[:-1], constrained=True)
    minimum_budget(engine, case.name, head, c, TTFT_MAX_TOKENS)
    ratios, shared = [], []

    def pair() -> None:
        out = {}
        for arm in (("warm", "cold") if len(ratios) % 2 else ("cold", "warm")):
            engine.kv_store.clear()
            if arm == "warm":  # the previous turn was answered: its prompt is stored
                ttft(engine, head, c)
            ids = turn()
            if arm == "warm":
                shared.append(len(os.path.commonprefix([ids, head])))
            out[arm] = ttft(engine, ids, c)
        ratios.append(out["warm"] / out["cold"])

    ttft(engine, turn(), c)  # warm the grammar
    benchmark.pedantic(pair, rounds=PAIRS, iterations=1)
    results.add("ttft_earlier_turn_stored_over_cold", statistics.median(ratios), "ratio",
                f"time to first token of a next turn ({len(turn())} tokens, "
                f"{statistics.median(shared)} shared with the stored turn) vs the store "
                f"empty, median of {PAIRS} pairs; max_tokens {TTFT_MAX_TOKENS}, cancelled at the "
                "first token")
