"""Several models served by name (server/fleet.py), in process: time to first token for a
cold model (its load included) and for a loaded one, and the aggregate tok/s of two models
served together against each alone (the embedded model with its draft under two names: two
engines, two schedulers sharing the machine)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from bench import results
from server.app import create_app
from server.door import ServeConfig
from server.fleet import Fleet
from specdec.catalog import Catalog, ModelSpec
from specdec.config import EngineConfig
from specdec.engine import Engine
from tests.serverproc import InProcess

CLIENTS = results.size(4, 4)  # concurrent requests per model
MAX_TOKENS = results.size(64, 64, 16)  # tokens each (unconstrained)


def _ttft(srv: InProcess, model: str) -> float:
    t0 = time.perf_counter()
    with srv.http.stream("POST", "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "Tell me about cats."}],
            "max_tokens": 16, "temperature": 0, "stream": True}) as r:
        for line in r.iter_lines():
            if '"content": "' in line and '"content": ""' not in line:
                break
    return time.perf_counter() - t0


def _tok_s(srv: InProcess, models: list[str]) -> float:
    def one(model: str, i: int) -> int:
        r = srv.http.post("/v1/completions", json={
            "model": model, "prompt": f"Story {i}: Once upon a time", "max_tokens": MAX_TOKENS,
            "temperature": 0})
        return int(r.json()["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(models) * CLIENTS) as pool:
        tokens = sum(pool.map(lambda mi: one(*mi), [(m, i) for m in models
                                                     for i in range(CLIENTS)]))
    return tokens / (time.perf_counter() - t0)


def test_models_by_name(benchmark, engine):  # `engine`: the embedded model converted
    def run_all() -> None:
        specs = (ModelSpec("a", "default", EngineConfig()),
                 ModelSpec("b", "default", EngineConfig()))
        fleet = Fleet(Catalog(specs, "a"), lambda s: Engine.load(s.path, s.config))
        srv = InProcess(create_app(fleet, ServeConfig()), fleet)
        try:
            cold = _ttft(srv, "a")
            loaded = min(_ttft(srv, "a") for _ in range(3))
            _ttft(srv, "b")
            _tok_s(srv, ["a"]), _tok_s(srv, ["b"])  # warm both
            alone = min(_tok_s(srv, ["a"]), _tok_s(srv, ["b"]))
            together = _tok_s(srv, ["a", "b"])
        finally:
            srv.stop()
        note = (f"the embedded model with its draft under two names, in process; "
                f"{CLIENTS} concurrent {MAX_TOKENS}-token requests per model")
        results.add("models_ttft_cold_s", cold, "s", "first streamed token of a model's "
                    "first request, its load included")
        results.add("models_ttft_loaded_s", loaded, "s", "the same once loaded (best of 3)")
        results.add("models_tok_s_each_alone", alone, "tok/s", note + "; the slower model")
        results.add("models_tok_s_two_together", together, "tok/s", note + "; both at once")

    benchmark.pedantic(run_all, rounds=1, iterations=1)
