"""The overhead table: what a constraint costs against the same request unconstrained, by
schema complexity (flat, nested, a large enum, a hard real-world schema) and by whether the
schema was seen before (repeated: the compiled grammar is cached, only masks cost; unique:
every request sends a schema not seen before and pays its compile too). Plain decoding on
the embedded model, so the grammar's cost is not hidden by speculation; arms interleaved per
prompt; throughput is output tokens over the whole request (prepare included, so a unique
schema's compile counts). The by-concurrency rows (`constrained_over_unconstrained_c*`) are
the server's (bench/test_server_load.py)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from bench import results
from bench.harness import minimum_budget
from bench.workloads import FLAT, NESTED
from specdec.grammar import Constraint

MAX_TOKENS = 48
CORPUS = Path(__file__).resolve().parents[1] / "tests" / "corpus"
COLOURS = [f"{a}-{b}" for a in ("red", "green", "blue", "amber", "teal", "plum", "sand",
                                "slate", "rose", "mint") for b in range(50)]
# kind: (the ask, the schema, max_tokens for both arms). The real-world schema's shortest
# complete answer takes more than MAX_TOKENS (81 tokens on the embedded tokenizer).
KINDS = {
    "flat": ("Invent a person with name, age and email as JSON.", FLAT, MAX_TOKENS),
    "nested": ("Give a company with its address (city, 5-digit zip) as JSON.", NESTED,
               MAX_TOKENS),
    "large_enum": ("Pick a paint colour and a finish as JSON.", {
        "type": "object", "properties": {"colour": {"enum": COLOURS},
                                         "finish": {"enum": ["matte", "gloss", "satin"]}},
        "required": ["colour", "finish"], "additionalProperties": False}, MAX_TOKENS),
    "real_world": ("One example GitHub Actions workflow as JSON.",
                   json.loads((CORPUS / "github-workflow.json").read_text()), 96),
}


def _unique(schema: dict, n: int) -> dict:
    """The same schema under a description no request sent before (a cache miss)."""
    return {**schema, "description": f"variant {n} {time.time_ns()}"}


def test_constrained_over_unconstrained_by_schema_kind(benchmark, engine):
    e = engine
    rounds = results.rounds(2, 3)
    counter = iter(range(1 << 30))

    def run(ids, schema, budget: int, constrained: bool) -> float:
        t0 = time.perf_counter()
        c = Constraint.json_schema(schema, lenient=True) if constrained else None
        r = e.generate(e.prepare(ids, constraint=c, max_tokens=budget, spec=None))
        return r.usage.completion_tokens / (time.perf_counter() - t0)

    def measure() -> dict[str, dict[str, list[float]]]:
        out: dict[str, dict[str, list[float]]] = {}
        for kind in results.prompts(list(KINDS)):
            ask, schema, n = KINDS[kind]
            ids = e.chat_prompt([{"role": "user", "content": ask}], constrained=True)
            run(ids, schema, n, True)  # compiled once: the repeated arm's cache
            arms = {"unconstrained": lambda: run(ids, schema, n, False),
                    "repeated": lambda: run(ids, schema, n, True),
                    "unique": lambda: run(ids, _unique(schema, next(counter)), n, True)}
            got: dict[str, list[float]] = {a: [] for a in arms}
            names = list(arms)
            for r in range(rounds):
                for name in names[r % 3:] + names[:r % 3]:
                    got[name].append(arms[name]())
            out[kind] = got
        return out

    for kind, (ask, schema, n) in KINDS.items():
        minimum_budget(e, kind, e.chat_prompt([{"role": "user", "content": ask}],
                                              constrained=True),
                       Constraint.json_schema(schema, lenient=True), n)
    res = benchmark.pedantic(measure, rounds=1, iterations=1)
    for kind, got in res.items():
        note = (f"plain decoding, max_tokens {KINDS[kind][2]}, {rounds} interleaved rounds; "
                "tok/s over the whole request (compile included)")
        un = statistics.median(got["unconstrained"])
        for arm in ("repeated", "unique"):
            ratios = [a / b for a, b in zip(got[arm], got["unconstrained"])]
            results.add(f"constrained_over_unconstrained_{kind}_{arm}",
                        statistics.median(ratios), "ratio", note)
        results.add(f"unconstrained_tok_s_{kind}", un, "tok/s", note)
