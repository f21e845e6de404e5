"""Server level, continuous batching: 1, 4, 8, 16 concurrent clients through the real server
(official client), structured-output ratio 0 and 1; tokens/s and latency percentiles;
speculation vs plain under load (c8, interleaved); and the peer, mlx-lm's own server (its
continuous batching, unconstrained, no draft) on the same converted model and prompts."""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from bench import results
from bench.harness import minimum_budget
from bench.workloads import CASES
from specdec import blas
from specdec.grammar import Constraint
from tests.serverproc import Server, free_port

LEVELS = (1, 4, 8, 16)
# The levels of the sweeps whose rows no report requires (unstructured, the overhead
# table's): the first alone in smoke mode.
SIDE_LEVELS = LEVELS[:results.size(len(LEVELS), len(LEVELS))]
N_CASES = 6  # the JSON-schema workloads every level sends
# Each client's requests per level: the six workloads once, one in smoke mode.
PER_CLIENT = results.size(N_CASES, N_CASES, 1)
PAIRS = results.size(1, 2, 0)  # extra (c1, c8) pairs for the c8-over-c1 ratios
MAX_TOKENS = 32
MAX_BATCH = 16


@pytest.fixture(scope="module")
def server(engine):  # `engine` makes sure the model is converted first
    for case in [c for c in CASES if c.kind == "json_schema"][:N_CASES]:
        minimum_budget(engine, case.name, engine.chat_prompt(case.messages(), constrained=True),
                       Constraint(case.kind, case.value), MAX_TOKENS)
    s = Server("--max-batch", str(MAX_BATCH))
    warm(s.client())
    yield s
    s.stop()


class MlxLmServer:
    """`python -m mlx_lm.server` on the converted embedded model, with the same BLAS."""

    def __init__(self, model_dir: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        env.pop("SPECDEC_BLAS_REEXEC", None)
        if blas.openblas_path():
            env["LD_PRELOAD"] = blas.openblas_path()  # type: ignore[assignment]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_lm.server", "--model", model_dir, "--port",
             str(self.port), "--max-tokens", str(MAX_TOKENS)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise RuntimeError("mlx_lm.server did not come up")

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                             timeout=300)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=20)


def one(client, i: int, structured: bool, extra_body: dict | None = None,
        model: str = "default", answers: list | None = None) -> tuple[float, int]:
    """Workload i once: (latency, completion tokens); its (workload, text) appended to
    `answers` when given."""
    case = [c for c in CASES if c.kind == "json_schema"][i % N_CASES]
    extra = {"response_format": {"type": "json_schema", "json_schema": {
        "name": case.name, "schema": case.value, "strict": True}}} if structured else {}
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=case.messages(),
                                       max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body=extra_body, **extra)
    if answers is not None:
        answers.append((i % N_CASES, r.choices[0].message.content))
    return time.perf_counter() - t0, r.usage.completion_tokens


def load(client, c: int, structured: bool, extra_body: dict | None = None,
         model: str = "default", answers: list | None = None) -> tuple[float, np.ndarray]:
    """`c` concurrent clients, each sending `PER_CLIENT` workloads in turn (client j starts
    at workload j), so every level does the same mix of work: (aggregate tok/s, latencies
    of all requests). `answers`: gets every (workload, text)."""

    def client_run(j: int) -> list[tuple[float, int]]:
        return [one(client, j + t, structured, extra_body, model, answers)
                for t in range(PER_CLIENT)]

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(c) as pool:
        out = [o for runs in pool.map(client_run, range(c)) for o in runs]
    wall = time.perf_counter() - t0
    return sum(o[1] for o in out) / wall, np.array([o[0] for o in out])


def warm(client, model: str = "default", kinds: tuple[bool, ...] = (False, True)) -> None:
    """Every workload once (the first few in smoke mode), structured and not, before
    anything is measured (the first requests pay one-time costs: grammar compiles, first
    kernels)."""
    for i in results.prompts(range(N_CASES)):
        for structured in kinds:
            one(client, i, structured, model=model)


@pytest.mark.parametrize("structured", [0, 1])
def test_server_concurrency(benchmark, server, structured):
    def run_all() -> None:
        by: dict[int, tuple[float, np.ndarray]] = {}
        for c in (LEVELS if structured else SIDE_LEVELS):
            by[c] = load(server.client(), c, bool(structured))
            tok_s, lat = by[c]
            suffix = "" if structured else "_unstructured"
            note = (f"{c * PER_CLIENT} requests, {c} clients (each sends {PER_CLIENT} of the "
                    f"{N_CASES} workloads), structured ratio {structured}, "
                    f"max_tokens {MAX_TOKENS}, continuous batching (max batch {MAX_BATCH})")
            results.add(f"server_tok_s_c{c}{suffix}", tok_s, "tok/s", note)
            results.add(f"server_p50_latency_s_c{c}{suffix}", float(np.percentile(lat, 50)),
                        "s", note)
            results.add(f"server_p99_latency_s_c{c}{suffix}", float(np.percentile(lat, 99)),
                        "s", note)
        if structured and 8 in by:
            # c8 against c1 in adjacent pairs (the sweep's, then PAIRS more, order
            # alternating), so a burst of load on the machine skews one pair, not the ratio.
            pairs = [(by[1], by[8])]
            for r in range(PAIRS):
                got = {c: load(server.client(), c, True)
                       for c in ((8, 1) if r % 2 == 0 else (1, 8))}
                pairs.append((got[1], got[8]))
            note = (f"c8 over c1, structured, median of {len(pairs)} adjacent pairs "
                    "(order alternating)")
            results.add("server_c8_over_c1",
                        statistics.median(b[0] / a[0] for a, b in pairs), "x", note)
            results.add("server_p99_latency_c8_over_c1",
                        statistics.median(float(np.percentile(b[1], 99) /
                                                np.percentile(a[1], 99)) for a, b in pairs),
                        "x", note)

    benchmark.pedantic(run_all, rounds=1, iterations=1)


def test_constrained_over_unconstrained_by_concurrency(benchmark, server):
    """The overhead table's concurrency rows: at each level, the same clients and workloads
    with and without their JSON schemas (serving defaults), arms adjacent and alternating."""
    rounds = results.size(1, 2)

    def run_all() -> None:
        for c in SIDE_LEVELS:
            ratios = []
            for r in range(rounds):
                got = {s: load(server.client(), c, s)[0]
                       for s in ((True, False) if (r + c) % 2 == 0 else (False, True))}
                ratios.append(got[True] / got[False])
            results.add(f"constrained_over_unconstrained_c{c}", statistics.median(ratios),
                        "ratio", f"{c} clients x {PER_CLIENT} requests per arm, "
                        f"structured vs not, serving defaults, median of {rounds} adjacent "
                        f"pairs; nproc {os.cpu_count()}")

    benchmark.pedantic(run_all, rounds=1, iterations=1)


def test_batched_spec_over_batched_plain_c8(benchmark, server):
    """Speculation still pays under load: 8 clients, structured, the serving defaults vs
    the same requests decoded plainly (num_draft_tokens 0), arms interleaved."""
    rounds = results.size(2, 3)

    def run_all() -> None:
        ratios = []
        for r in range(rounds):
            arms = [("spec", None), ("plain", {"num_draft_tokens": 0})]
            got = {}
            for name, extra in (arms if r % 2 == 0 else arms[::-1]):
                got[name] = load(server.client(), 8, True, extra)[0]
            ratios.append(got["spec"] / got["plain"])
        results.add("batched_spec_over_batched_plain_c8", statistics.median(ratios), "x",
                    f"8 clients, structured, {8 * PER_CLIENT} requests per arm, median of "
                    f"{rounds} interleaved rounds")

    benchmark.pedantic(run_all, rounds=1, iterations=1)


def test_ours_constrained_over_mlxlm_unconstrained_c8(benchmark, server, engine):
    """The peer: mlx-lm's server (continuous batching, no grammar, no draft) at 8 clients on
    the same converted model and prompts, against ours constrained, interleaved."""
    peer = MlxLmServer(str(engine.target.path))
    warm(peer.client(), model=str(engine.target.path), kinds=(False,))
    rounds = results.size(2, 3)
    try:
        def run_all() -> None:
            ratios, peer_tok_s = [], []
            for r in range(rounds):
                arms = [("ours", lambda: load(server.client(), 8, True)),
                        ("peer", lambda: load(peer.client(), 8, False,
                                              model=str(engine.target.path)))]
                got = {name: f()[0] for name, f in (arms if r % 2 == 0 else arms[::-1])}
                ratios.append(got["ours"] / got["peer"])
                peer_tok_s.append(got["peer"])
            results.add("mlxlm_server_unconstrained_tok_s_c8", statistics.median(peer_tok_s),
                        "tok/s", "mlx-lm's server (continuous batching), 8 clients, "
                        "unconstrained, no draft; median over rounds")
            results.add("ours_constrained_c8_over_mlxlm_unconstrained_c8",
                        statistics.median(ratios), "x",
                        f"8 clients, max_tokens {MAX_TOKENS}, median of {rounds} interleaved "
                        "rounds; ours JSON-schema constrained with its serving defaults")

        benchmark.pedantic(run_all, rounds=1, iterations=1)
    finally:
        peer.stop()


def test_draft_left_out_under_load_c8(benchmark, server):
    """The default leaves the draft model out of rounds with more than --draft-max-batch
    drafting requests (4 on the CPU backend): 8 clients, structured, against a server that
    keeps it in every round (--draft-max-batch none), arms interleaved."""
    kept = Server("--max-batch", str(MAX_BATCH), "--draft-max-batch", "none")
    warm(kept.client())
    rounds = results.size(2, 3)
    try:
        def run_all() -> None:
            ratios = []
            for r in range(rounds):
                arms = [("default", server), ("kept", kept)]
                got = {name: load(s.client(), 8, True)[0]
                       for name, s in (arms if r % 2 == 0 else arms[::-1])}
                ratios.append(got["default"] / got["kept"])
            results.add("draft_left_out_over_kept_c8", statistics.median(ratios), "x",
                        f"8 clients, structured, {8 * PER_CLIENT} requests per arm, "
                        f"median of {rounds} interleaved rounds; default --draft-max-batch "
                        "against none")

        benchmark.pedantic(run_all, rounds=1, iterations=1)
    finally:
        kept.stop()


def test_tree_over_chain_serving(benchmark, server):
    """The paired serving run for token trees: the default server (--tree 4) against one
    that verifies chains (--tree 0), 1 and 8 clients, structured, arms interleaved; every
    answer compared with the same workload's from the other arm."""
    chain = Server("--max-batch", str(MAX_BATCH), "--tree", "0")
    warm(chain.client())
    rounds = results.size(2, 3)
    try:
        def run_all() -> None:
            for c in (1, 8):
                ratios, differ, total = [], 0, 0
                for r in range(rounds):
                    arms = [("tree", server), ("chain", chain)]
                    got, texts = {}, {}
                    for name, s in (arms if r % 2 == 0 else arms[::-1]):
                        texts[name] = []
                        got[name] = load(s.client(), c, True, answers=texts[name])[0]
                    ratios.append(got["tree"] / got["chain"])
                    a, b = sorted(texts["tree"]), sorted(texts["chain"])
                    differ += sum(x != y for x, y in zip(a, b))
                    total += len(a)
                # On a BLAS that is not batch-invariant, rows batched differently may flip a
                # near-tie (the exactness suite checks equality on the reference BLAS).
                results.add(f"serving_tree_over_chain_c{c}", statistics.median(ratios), "x",
                            f"{c} clients, structured, {c * PER_CLIENT} requests per arm, "
                            f"median of {rounds} interleaved rounds; serving defaults with "
                            f"--tree 4 against --tree 0; answers differing between the arms: "
                            f"{differ} of {total}")

        benchmark.pedantic(run_all, rounds=1, iterations=1)
    finally:
        chain.stop()
