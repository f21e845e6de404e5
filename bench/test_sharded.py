"""A target sharded over 2 ranks (`specdec launch -n 2 -- serve`, ring backend over loopback)
against the same target in one process: tokens/s of the same requests, arms interleaved.

On one machine this shows the cost of the collectives (every layer's all-sums and rank 0's
per-round broadcast), not a speed-up: sharding is for targets that do not fit one machine.
The model is a random Llama-shaped target (the embedded SmolLM2 has 9 attention heads,
which do not split over 2 ranks)."""

from __future__ import annotations

import statistics
import sys
import time

import httpx

from bench import results
from bench.harness import minimum_budget
from specdec.grammar import Constraint
from tests.families import make_family
from tests.serverproc import Server

LAUNCH = [sys.executable, "-m", "specdec", "launch", "-n", "2", "--"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
MAX_TOKENS = 48


def _ask(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Invent person {i}."}]


def _check_budget(model) -> None:
    """MAX_TOKENS against the schema's minimum on the random model's tokenizer."""
    from specdec.engine import Engine
    from specdec.models import load

    e = Engine(load(str(model)))
    minimum_budget(e, "person", e.chat_prompt(_ask(0), constrained=True),
                   Constraint.json_schema(SCHEMA), MAX_TOKENS)


def _tok_s(s: Server, n: int) -> float:
    tokens, t0 = 0, time.perf_counter()
    for i in range(n):
        body = {"messages": _ask(i), "max_tokens": MAX_TOKENS, "temperature": 0}
        if i % 2:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "p", "schema": SCHEMA}}
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, f"{r.status_code} {r.text}; its log: {s.log()[-3000:]}"
        tokens += r.json()["usage"]["completion_tokens"]
    return tokens / (time.perf_counter() - t0)


def _metric(s: Server, name: str) -> float:
    text = httpx.get(s.url + "/metrics", timeout=30).text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith(name + " "))


def test_sharded2_over_single(benchmark, tmp_path_factory):
    def run_all() -> None:
        model = make_family("llama3-tied", tmp_path_factory.mktemp("sharded-bench") / "m")
        _check_budget(model)
        args = ("--model", str(model), "--draft-model", "none")
        single, sharded = Server(*args), Server(*args, launcher=LAUNCH)
        try:
            n = results.size(4, 8, 2)
            ratios = []
            for r in range(results.rounds(2)):
                arms = [(single, "single"), (sharded, "sharded")][::1 if r % 2 else -1]
                got = {name: _tok_s(s, n) for s, name in arms}
                ratios.append(got["sharded"] / got["single"])
            rounds = _metric(sharded, "specdec_rounds_total")
            bcast = _metric(sharded, "specdec_broadcast_seconds_total")
        finally:
            single.stop()
            sharded.stop(wait_s=60)
        note = (f"2 ranks (ring, loopback) vs 1 process, random Llama (64 wide, 2 layers), "
                f"{n} requests per arm and round (max_tokens {MAX_TOKENS}, every other one "
                f"JSON-schema constrained), rounds {[round(x, 3) for x in ratios]}")
        results.add("sharded2_over_single_tok_s", statistics.median(ratios), "x", note)
        results.add("sharded2_broadcast_ms_per_round", 1000 * bcast / max(rounds, 1), "ms",
                    "rank 0's per-round broadcast of the round's decisions (the layers' own "
                    "all-sums are inside the forward)")

    benchmark.pedantic(run_all, rounds=1, iterations=1)
