"""Server level: 1, 4, 8 concurrent clients through the real server (official client),
structured-output ratio 0 and 1; tokens/s and latency percentiles."""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest

from bench import results
from bench.workloads import CASES
from tests.serverproc import Server

QUICK = results.QUICK
LEVELS = (1, 8) if QUICK else (1, 4, 8)
PER_CLIENT = 1 if QUICK else 2
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def server(engine):  # `engine` makes sure the model is converted first
    s = Server()
    yield s
    s.stop()


def one(client, i: int, structured: bool) -> tuple[float, int]:
    case = [c for c in CASES if c.kind == "json_schema"][i % 6]
    extra = {"response_format": {"type": "json_schema", "json_schema": {
        "name": case.name, "schema": case.value, "strict": True}}} if structured else {}
    t0 = time.perf_counter()
    r = client.chat.completions.create(model="default", messages=case.messages(),
                                       max_tokens=MAX_TOKENS, temperature=0, **extra)
    return time.perf_counter() - t0, r.usage.completion_tokens


@pytest.mark.parametrize("structured", [0, 1])
def test_server_concurrency(benchmark, server, structured):
    def run_all() -> None:
        for c in LEVELS:
            client = server.client()
            jobs = c * PER_CLIENT
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(c) as pool:
                out = list(pool.map(lambda i: one(client, i, bool(structured)), range(jobs)))
            wall = time.perf_counter() - t0
            lat = np.array([o[0] for o in out])
            tok = sum(o[1] for o in out)
            suffix = "" if structured else "_unstructured"
            note = (f"{jobs} requests, {c} clients, structured ratio {structured}, "
                    f"max_tokens {MAX_TOKENS}, one engine thread (no batching)")
            results.add(f"server_tok_s_c{c}{suffix}", tok / wall, "tok/s", note)
            results.add(f"server_p50_latency_s_c{c}{suffix}", float(np.percentile(lat, 50)),
                        "s", note)
            results.add(f"server_p99_latency_s_c{c}{suffix}", float(np.percentile(lat, 99)),
                        "s", note)

    benchmark.pedantic(run_all, rounds=1, iterations=1)
