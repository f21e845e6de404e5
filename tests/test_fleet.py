"""Several models served by name: routing by name and alias through the three APIs, loading
on first use (once, however many requests wait), eviction of the least recently used idle
model under --max-loaded, pinning, idle TTL, a failed load, and the models file's errors.

In process (httpx's ASGI transport against the real app), over two random-weight models of
different families (Qwen 2.5, Llama 3) and the embedded model, on the reference BLAS: a
request's tokens do not depend on the other models' requests.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from server.app import create_app
from server.door import ServeConfig
from server.fleet import Fleet, kv_estimate, weight_bytes
from specdec.catalog import Catalog, ModelSpec, build
from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.errors import ModelConfigError
from tests.families import make_family
from tests.serverproc import InProcess

BASE = replace(EngineConfig(), draft="none")
# a KV budget and a prompt store of a set size (counted in a memory budget as weights are)
SIZED = replace(BASE, max_kv_tokens=2048, prompt_store_mb=0)
ASK = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    return {"qwen": str(make_family("qwen2.5", root / "qwen")),
            "llama": str(make_family("llama3-tied", root / "llama", seed=1)),
            "phi": str(make_family("phi3", root / "phi", seed=2))}


class Loader:
    """Loads a spec's engine (the session's embedded model for "default"), counting loads
    by name; `delay` holds each load that long, `broken` names models that fail."""

    def __init__(self, embedded, delay: float = 0.0, broken: tuple[str, ...] = ()) -> None:
        self.embedded, self.delay, self.broken = embedded, delay, broken
        self.loads: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, spec: ModelSpec) -> Engine:
        with self._lock:
            self.loads[spec.name] = self.loads.get(spec.name, 0) + 1
        time.sleep(self.delay)
        if spec.name in self.broken:
            raise OSError(f"no weights in {spec.path}")
        if spec.path == "default":
            return Engine(self.embedded)
        return Engine.load(spec.path, spec.config)


def serve(specs: list[ModelSpec], loader: Loader, max_loaded: int | None = None
          ) -> InProcess:
    fleet = Fleet(Catalog(tuple(specs), specs[0].name), loader, max_loaded)
    return InProcess(create_app(fleet, ServeConfig()), fleet)


def fleet_of(srv: InProcess) -> Fleet:
    return srv.engine  # type: ignore[return-value]


def loaded(srv: InProcess) -> set[str]:
    return {s.name for s in fleet_of(srv).seats if s.engine is not None}


def ask(srv: InProcess, api: str, model: str | None, max_tokens: int = 8) -> httpx.Response:
    body: dict = {"max_tokens": max_tokens, "temperature": 0}
    if model is not None:
        body["model"] = model
    if api == "chat":
        return srv.http.post("/v1/chat/completions", json={**body, "messages": ASK})
    if api == "responses":
        body["max_output_tokens"] = body.pop("max_tokens")
        return srv.http.post("/v1/responses", json={**body, "input": ASK[0]["content"]})
    return srv.http.post("/v1/messages", json={**body, "messages": ASK})


@pytest.fixture(scope="module")
def three(dirs, embedded):
    loader = Loader(embedded)
    srv = serve([ModelSpec("qwen", dirs["qwen"], BASE, aliases=("fast", "q")),
                 ModelSpec("llama", dirs["llama"], BASE, aliases=("agent",)),
                 ModelSpec("smol", "default", BASE)], loader)
    yield srv, loader
    srv.stop()


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_requests_route_by_name_and_alias_through_every_api(three, api):
    srv, loader = three
    for name, canonical in (("qwen", "qwen"), ("fast", "qwen"), ("agent", "llama"),
                            ("smol", "smol"), ("default", "qwen"), (None, "qwen")):
        if name is None and api == "messages":
            continue  # the Messages API requires a model
        r = ask(srv, api, name)
        assert r.status_code == 200, (api, name, r.text)
        assert r.json()["model"] == canonical
    assert loader.loads == {"qwen": 1, "llama": 1, "smol": 1}  # each loaded once, kept


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_an_unknown_model_is_a_404_in_the_apis_shape_naming_the_models(three, api):
    srv, _ = three
    r = ask(srv, api, "gpt-9")
    assert r.status_code == 404, r.text
    body = r.json()
    if api == "messages":
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    else:
        assert body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    msg = body["error"]["message"]
    assert "'gpt-9'" in msg and all(f"'{n}'" in msg for n in ("qwen", "llama", "smol"))


def test_the_models_list_names_every_model_with_its_card(three, dirs):
    srv, _ = three
    ask(srv, "chat", "smol")
    cards = {m["id"]: m for m in srv.http.get("/v1/models").json()["data"]}
    assert set(cards) == {"qwen", "llama", "smol"}
    assert cards["qwen"]["family"] == "qwen2" and cards["llama"]["family"] == "llama"
    assert cards["smol"]["family"] == "llama" and cards["smol"]["quantization"] is None
    assert cards["qwen"]["aliases"] == ["fast", "q"] and cards["smol"]["aliases"] == []
    assert cards["qwen"]["context_length"] == 4096 and cards["smol"]["context_length"] == 8192
    assert all(c["draft"] == "none" for c in cards.values())
    assert cards["smol"]["loaded"] is True
    # the official client reads the list too
    assert sorted(m.id for m in srv.client().models.list().data) == ["llama", "qwen", "smol"]


def test_named_models_through_the_openai_and_anthropic_clients(serve, dirs):
    # A real `specdec serve` of two models by name, one resident at a time.
    srv = serve("--model", f"qwen={dirs['qwen']}", "--model", f"llama={dirs['llama']}",
                "--draft-model", "none", "--max-loaded", "1")
    client = srv.client()
    assert sorted(m.id for m in client.models.list().data) == ["llama", "qwen"]
    out = client.chat.completions.create(model="llama", messages=ASK, max_tokens=6,
                                         temperature=0)
    assert out.model == "llama" and out.choices[0].message.content
    claude = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0,
                                 timeout=120)
    assert [m.id for m in claude.models.list().data] == ["qwen", "llama"]
    msg = claude.messages.create(model="qwen", max_tokens=6, messages=ASK)
    assert msg.model == "qwen" and msg.content[0].text
    with pytest.raises(anthropic.NotFoundError, match="gpt-9"):
        claude.messages.create(model="gpt-9", max_tokens=6, messages=ASK)
    with pytest.raises(openai.NotFoundError, match="'qwen', 'llama'"):
        client.chat.completions.create(model="gpt-9", messages=ASK, max_tokens=6)
    assert "unloading model 'llama' (to make room for 'qwen')" in srv.log()


def test_concurrent_first_requests_wait_for_one_load(dirs, embedded):
    loader = Loader(embedded, delay=1.0)
    srv = serve([ModelSpec("qwen", dirs["qwen"], BASE), ModelSpec("llama", dirs["llama"],
                                                                  BASE)], loader)
    try:
        with ThreadPoolExecutor(6) as pool:
            rs = list(pool.map(lambda api: ask(srv, api, "llama"),
                               ["chat", "responses", "messages"] * 2))
        assert [r.status_code for r in rs] == [200] * 6
        assert loader.loads == {"llama": 1}
    finally:
        srv.stop()


def test_the_least_recently_used_idle_model_is_unloaded_to_make_room(dirs, embedded):
    loader = Loader(embedded)
    srv = serve([ModelSpec(n, dirs[n], BASE) for n in ("qwen", "llama", "phi")], loader,
                max_loaded=2)
    tokens: dict[str, int] = {}
    try:
        for name, resident in (("qwen", {"qwen"}), ("llama", {"qwen", "llama"}),
                               ("qwen", {"qwen", "llama"}),  # qwen used last now
                               ("phi", {"qwen", "phi"}),  # llama: least recently used
                               ("llama", {"phi", "llama"})):  # qwen's turn
            r = ask(srv, "chat", name)
            assert r.status_code == 200
            tokens[name] = tokens.get(name, 0) + r.json()["usage"]["completion_tokens"]
            assert loaded(srv) == resident, name
        assert loader.loads == {"qwen": 1, "llama": 2, "phi": 1}
        seats = {s.name: s for s in fleet_of(srv).seats}
        assert (seats["qwen"].evictions, seats["llama"].evictions) == (1, 1)
        metrics = srv.http.get("/metrics").text
        assert 'specdec_model_evictions_total{model="llama"} 1' in metrics
        assert 'specdec_model_loaded{model="qwen"} 0' in metrics
        assert 'specdec_model_requests_total{model="qwen"} 2' in metrics
        for name, n in tokens.items():
            assert f'specdec_model_completion_tokens_total{{model="{name}"}} {n}' in metrics
    finally:
        srv.stop()


def test_a_memory_budget_that_holds_two_of_three_unloads_the_least_recently_used(
        tmp_path, embedded):
    names = ("q0", "q1", "q2")  # one family, three seeds: the same size
    specs = [ModelSpec(n, str(make_family("qwen2.5", tmp_path / n, seed=i)), SIZED)
             for i, n in enumerate(names)]
    size = Fleet(Catalog(tuple(specs), "q0"), Loader(embedded)).seats[0].bytes
    loader = Loader(embedded)
    fleet = Fleet(Catalog(tuple(specs), "q0"), loader, memory_budget=int(size * 2.5))
    srv = InProcess(create_app(fleet, ServeConfig()), fleet)
    try:
        for name, resident in (("q0", {"q0"}), ("q1", {"q0", "q1"}), ("q0", {"q0", "q1"}),
                               ("q2", {"q0", "q2"}), ("q1", {"q2", "q1"})):
            assert ask(srv, "chat", name).status_code == 200
            assert loaded(srv) == resident, name
        assert all(0.9 * size < s.bytes <= size for s in fleet.seats)  # measured once loaded
        assert loader.loads == {"q0": 1, "q1": 2, "q2": 1}
    finally:
        srv.stop()
    # A model over the budget alone never loads: a 503 naming it and the sizes.
    fleet = Fleet(Catalog(tuple(specs), "q0"), Loader(embedded), memory_budget=size // 2)
    srv = InProcess(create_app(fleet, ServeConfig()), fleet)
    try:
        r = ask(srv, "messages", "q1")
        assert r.status_code == 503 and "'q1' needs" in r.json()["error"]["message"]
        assert "over the memory budget" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_the_memory_budget_counts_each_models_grammar_cache(tmp_path, embedded):
    """A model holds its weights and, as requests bring grammars, up to its grammar cache's
    size: a budget with room for two models' weights holds two with no grammar cache and
    one with 64 MB each."""
    path = str(make_family("qwen2.5", tmp_path / "q"))
    bare = [ModelSpec(n, path, replace(SIZED, grammar_cache_mb=0)) for n in ("a", "b")]
    weights = Fleet(Catalog(tuple(bare), "a"), Loader(embedded)).seats[0].bytes
    budget = 2 * weights + (64 << 20)
    for mb, both in ((0, True), (64, False)):
        specs = [ModelSpec(n, path, replace(SIZED, grammar_cache_mb=mb)) for n in ("a", "b")]
        fleet = Fleet(Catalog(tuple(specs), "a"), Loader(embedded), memory_budget=budget)
        srv = InProcess(create_app(fleet, ServeConfig()), fleet)
        try:
            assert fleet.seats[0].bytes == weights + (mb << 20)  # before it loads
            for name in ("a", "b"):
                r = srv.http.post("/v1/chat/completions", json={
                    "model": name, "messages": ASK, "max_tokens": 4,
                    "response_format": {"type": "json_object"}})
                assert r.status_code == 200, r.text
            assert loaded(srv) == ({"a", "b"} if both else {"b"}), mb
            seat = fleet.seat("b")
            assert seat.bytes == weight_bytes(seat.engine) + (mb << 20) + (  # loaded: measured
                seat.engine.kv_bytes + (SIZED.prompt_store_mb << 20))
            metrics = srv.http.get("/metrics").text
            assert f'specdec_grammar_cache_limit_bytes{{model="b"}} {mb << 20}' in metrics
            held = seat.engine.compiler.cached_bytes
            assert (held > 0) == (mb > 0)
            assert f'specdec_grammar_cache_bytes{{model="b"}} {held}' in metrics
        finally:
            srv.stop()


def test_a_pinned_model_is_never_unloaded(dirs, embedded):
    loader = Loader(embedded)
    srv = serve([ModelSpec("qwen", dirs["qwen"], BASE, pinned=True),
                 ModelSpec("llama", dirs["llama"], BASE), ModelSpec("phi", dirs["phi"], BASE)],
                loader, max_loaded=2)
    try:
        for name in ("qwen", "llama", "phi", "llama", "phi"):
            assert ask(srv, "chat", name).status_code == 200
            assert "qwen" in loaded(srv) and len(loaded(srv)) <= 2
        assert loader.loads == {"qwen": 1, "llama": 2, "phi": 2}
    finally:
        srv.stop()
    # With room for one and that one pinned, another model cannot load: a 503 saying why.
    srv = serve([ModelSpec("qwen", dirs["qwen"], BASE, pinned=True),
                 ModelSpec("llama", dirs["llama"], BASE)], Loader(embedded), max_loaded=1)
    try:
        assert ask(srv, "chat", "qwen").status_code == 200
        r = ask(srv, "messages", "llama")
        assert r.status_code == 503 and r.headers["retry-after"]
        assert "pinned" in r.json()["error"]["message"]
        assert loaded(srv) == {"qwen"} and fleet_of(srv).seat("llama").leases == 0
    finally:
        srv.stop()


def test_a_request_for_a_model_without_room_waits_for_the_busy_one_then_swaps(dirs, embedded):
    # --max-loaded 1: requests for two models at once all succeed; those for the model that
    # cannot load yet wait in line (counted in /metrics) until the other is idle.
    import concurrent.futures

    loader = Loader(embedded)
    srv = serve([ModelSpec("qwen", dirs["qwen"], BASE), ModelSpec("llama", dirs["llama"],
                                                                  BASE)], loader, max_loaded=1)
    try:
        assert ask(srv, "chat", "qwen").status_code == 200
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            jobs = [pool.submit(ask, srv, api, name, 24) for name, api in (
                ("qwen", "chat"), ("llama", "messages"), ("qwen", "responses"),
                ("llama", "chat"))]
            statuses = [j.result().status_code for j in jobs]
        assert statuses == [200, 200, 200, 200]
        fleet = fleet_of(srv)
        assert fleet.waits >= 1 and fleet.wait_timeouts == 0 and fleet.waiting == 0
        assert loader.loads["llama"] >= 1 and len(loaded(srv)) == 1
        text = srv.http.get("/metrics").text
        assert f"specdec_model_waits_total {fleet.waits}" in text
        assert "specdec_model_waiting 0" in text
    finally:
        srv.stop()
    # the wait is bounded: past --load-wait, the 503
    fleet = Fleet(Catalog((ModelSpec("qwen", dirs["qwen"], BASE),
                           ModelSpec("llama", dirs["llama"], BASE)), "qwen"), Loader(embedded),
                  max_loaded=1, load_wait_s=0.3)
    srv = InProcess(create_app(fleet, ServeConfig()), fleet)
    try:
        assert ask(srv, "chat", "qwen").status_code == 200
        asyncio.run(fleet.acquire(fleet.seat("qwen")))  # a request of qwen in hand
        r = ask(srv, "chat", "llama")
        assert r.status_code == 503 and r.json()["error"]["code"] == "models_busy"
        assert "waited" in r.json()["error"]["message"] and fleet.wait_timeouts == 1
        fleet.release(fleet.seat("qwen"))
        assert ask(srv, "chat", "llama").status_code == 200
    finally:
        srv.stop()


def test_an_idle_model_is_unloaded_after_its_ttl(dirs, embedded):
    loader = Loader(embedded)
    srv = serve([ModelSpec("qwen", dirs["qwen"], BASE),
                 ModelSpec("llama", dirs["llama"], BASE, ttl_s=1.0)], loader)
    try:
        for name in ("qwen", "llama"):
            assert ask(srv, "chat", name).status_code == 200
        assert loaded(srv) == {"qwen", "llama"}
        health = srv.http.get("/health").json()
        assert health["models"]["llama"] == {"status": "ok", "queue_depth": 0, "active": 0,
                                             "pinned": False}
        deadline = time.monotonic() + 10
        while "llama" in loaded(srv) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert loaded(srv) == {"qwen"}  # qwen has no TTL
        assert srv.http.get("/health").json()["models"]["llama"]["status"] == "unloaded"
        assert ask(srv, "chat", "llama").status_code == 200  # loads again
        assert loader.loads == {"qwen": 1, "llama": 2}
    finally:
        srv.stop()


def test_models_are_loaded_unloaded_and_pinned_on_request(dirs, embedded):
    loader = Loader(embedded)
    srv = serve([ModelSpec("qwen", dirs["qwen"], BASE, aliases=("fast",)),
                 ModelSpec("llama", dirs["llama"], BASE)], loader, max_loaded=1)
    post = srv.http.post
    try:
        assert srv.http.get("/v1/models/fast").json()["id"] == "qwen"
        assert srv.http.get("/v1/models/gpt-9").status_code == 404
        assert post("/v1/models/gpt-9/load").status_code == 404
        card = post("/v1/models/qwen/load").json()
        assert card["loaded"] is True and loader.loads == {"qwen": 1}
        assert post("/v1/models/qwen/pin").json()["pinned"] is True
        r = ask(srv, "chat", "llama")  # no room: the one resident model is pinned
        assert r.status_code == 503 and r.json()["error"]["code"] == "models_busy"
        assert post("/v1/models/qwen/unpin").json()["pinned"] is False
        assert ask(srv, "chat", "llama").status_code == 200
        assert loaded(srv) == {"llama"}
        fleet = fleet_of(srv)
        seat = fleet.seat("llama")
        asyncio.run(fleet.acquire(seat))  # a request of it in hand
        r = post("/v1/models/llama/unload")
        assert r.status_code == 503 and "requests in hand" in r.json()["error"]["message"]
        fleet.release(seat)
        assert post("/v1/models/llama/unload").json()["loaded"] is False
        assert loaded(srv) == set()
    finally:
        srv.stop()


def test_model_administration_needs_a_key_beyond_loopback(dirs, embedded):
    specs = (ModelSpec("qwen", dirs["qwen"], BASE), ModelSpec("llama", dirs["llama"], BASE))
    for config, headers, status in ((ServeConfig(host="0.0.0.0"), {}, 401),
                                    (ServeConfig(host="0.0.0.0", api_key="k"), {}, 401),
                                    (ServeConfig(host="0.0.0.0", api_key="k"),
                                     {"Authorization": "Bearer k"}, 200)):
        fleet = Fleet(Catalog(specs, "qwen"), Loader(embedded))
        srv = InProcess(create_app(fleet, config), fleet)
        try:
            r = srv.http.post("/v1/models/llama/pin", headers=headers)
            assert r.status_code == status, r.text
            assert fleet.seat("llama").pinned is (status == 200)
        finally:
            srv.stop()


def test_a_failed_load_names_the_model_and_the_others_keep_serving(dirs, embedded):
    loader = Loader(embedded, broken=("llama",))
    srv = serve([ModelSpec("qwen", dirs["qwen"], BASE), ModelSpec("llama", dirs["llama"],
                                                                  BASE)], loader)
    try:
        for api in ("chat", "messages"):
            r = ask(srv, api, "llama")
            assert r.status_code == 503, r.text
            msg = r.json()["error"]["message"]
            assert "'llama'" in msg and "no weights in" in msg
        assert ask(srv, "responses", "qwen").status_code == 200
        assert loader.loads == {"llama": 2, "qwen": 1}  # each request tried again
    finally:
        srv.stop()


def test_a_request_gives_the_same_tokens_alone_and_in_a_crowd_of_two_models(dirs, embedded):
    # llama's first requests come inside the crowd: it loads while qwen decodes
    loader = Loader(embedded)
    srv = serve([ModelSpec("qwen", dirs["qwen"], BASE), ModelSpec("llama", dirs["llama"],
                                                                  BASE)], loader)

    def needle(model: str, i: int) -> tuple:
        r = srv.http.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": f"Count to {i}."}],
            "max_tokens": 24, "temperature": 0, "logprobs": True})
        assert r.status_code == 200, r.text
        return tuple((t["token"], t["logprob"]) for t in r.json()["choices"][0]["logprobs"]
                     ["content"])

    try:
        alone = needle("qwen", 7)
        assert len(alone) == 24 and loaded(srv) == {"qwen"}
        with ThreadPoolExecutor(8) as pool:
            crowd = [pool.submit(needle, "qwen" if i % 2 else "llama", i) for i in range(12)]
            inside = pool.submit(needle, "qwen", 7)
            [f.result() for f in crowd]
        assert inside.result() == alone
        assert loader.loads == {"qwen": 1, "llama": 1}
    finally:
        srv.stop()


# -- configuration --------------------------------------------------------------------------

def test_model_flags_and_a_models_file_make_one_catalog(tmp_path, dirs):
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    f = tmp_path / "models.toml"
    f.write_text(f'default = "q"\n\n[models.q]\npath = "{dirs["qwen"]}"\naliases = ["fast"]\n'
                 f'chat_template = "t.jinja"\nreasoning_format = "think"\nttl = 30\n'
                 f'grammar_cache_mb = 8\n\n'
                 f'[models.l]\npath = "{dirs["llama"]}"\npinned = true\ndraft = "self"\n')
    cat = build([f"phi={dirs['phi']}", "default"], [str(f)], None, BASE)
    assert [m.name for m in cat.models] == ["phi", "SmolLM2-135M-Instruct", "q", "l"]
    assert cat.default == "q" and cat.named("default").name == "q"
    q, lm = cat.models[2], cat.models[3]
    assert q.aliases == ("fast",) and q.ttl_s == 30.0 and not q.pinned
    assert q.config.defaults.chat_template == "{{ messages[0]['content'] }}"
    assert q.config.defaults.reasoning_format == "think" and q.config.draft == "none"
    assert lm.pinned and lm.config.draft == "self"
    assert q.config.grammar_cache_mb == 8 and lm.config.grammar_cache_mb == 256
    assert build([], [], None, BASE).models[0].path == "default"  # no flags: embedded
    js = tmp_path / "m.json"
    js.write_text('{"models": {"q": {"path": "%s", "aliases": ["a"]}}}' % dirs["qwen"])
    assert build([], [str(js)], None, BASE).named("a").name == "q"


@pytest.mark.parametrize("text,where", [
    ('[models.q]\npath = "QWEN"\nttl = "soon"\n', ":3: models.q.ttl: must be a number"),
    ('[models.q]\npath = "QWEN"\nbogus = 1\n', ":3: models.q.bogus: unknown field"),
    ('[models.q]\naliases = ["x"]\n', ":1: models.q.path: required"),
    ('[models.q]\npath = "/nowhere/at/all"\n', ":2: models.q.path: '/nowhere/at/all' is "),
    ('[models.q]\npath = "QWEN"\nreasoning_format = "nope"\n',
     ":3: models.q.reasoning_format:"),
    ('[models.q]\npath = "QWEN"\npinned = true\nttl = 5\n', ":4: models.q.ttl: a pinned"),
    ('[models.q]\npath = "QWEN"\ngrammar_cache_mb = -1\n', ":3: models.q.grammar_cache_mb:"),
    ('[models.q\npath = "QWEN"\n', ": not valid TOML: "),
    ('default = "zz"\n[models.q]\npath = "QWEN"\n', "default model 'zz' is none of"),
])
def test_a_malformed_models_file_names_file_line_and_field(tmp_path, dirs, text, where):
    f = tmp_path / "models.toml"
    f.write_text(text.replace("QWEN", dirs["qwen"]))
    with pytest.raises(ModelConfigError) as e:
        build([], [str(f)], None, BASE)
    assert where in str(e.value) and (str(f) in str(e.value) or "default model" in where)


def test_a_models_folder_serves_each_model_directory_in_it(tmp_path, dirs):
    import shutil

    for name in ("qwen", "llama"):
        shutil.copytree(dirs[name], tmp_path / "models" / name)
    (tmp_path / "models" / "notes").mkdir()  # no config.json: not a model
    cat = build([], [], "llama", BASE, [str(tmp_path / "models")])
    assert [m.name for m in cat.models] == ["llama", "qwen"] and cat.default == "llama"
    with pytest.raises(ModelConfigError, match="no model directories"):
        build([], [], None, BASE, [str(tmp_path / "models" / "notes")])


def test_duplicate_names_and_foreign_drafts_are_refused_at_start(tmp_path, dirs):
    with pytest.raises(ModelConfigError, match="'x' names two models"):
        build([f"x={dirs['qwen']}", f"x={dirs['llama']}"], [], None, BASE)
    f = tmp_path / "m.toml"
    f.write_text(f'[models.q]\npath = "{dirs["qwen"]}"\naliases = ["a"]\n'
                 f'[models.l]\npath = "{dirs["llama"]}"\naliases = ["a"]\n')
    with pytest.raises(ModelConfigError, match="'a' names two models"):
        build([], [str(f)], None, BASE)
    f.write_text(f'[models.q]\npath = "{dirs["qwen"]}"\ndraft = "{dirs["llama"]}"\n')
    with pytest.raises(ModelConfigError, match="model 'q': draft .* different tokenizer"):
        build([], [str(f)], None, BASE)
    with pytest.raises(ModelConfigError, match="'default' is reserved"):
        build([f"default={dirs['qwen']}"], [], None, BASE)


def test_the_server_does_not_start_on_a_bad_models_file(tmp_path, dirs):
    f = tmp_path / "models.toml"
    f.write_text(f'[models.q]\npath = "{dirs["qwen"]}"\nttl = -1\n')
    run = subprocess.run([sys.executable, "-m", "specdec", "serve", "--port", "0",
                          "--models-file", str(f)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2, run.stderr
    assert f"{f}:3: models.q.ttl: must be a number of seconds > 0" in run.stderr
    assert "Uvicorn running" not in run.stderr


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return kb / 1024


@pytest.mark.model
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_memory_comes_back_after_an_unload(serve, embedded, tmp_path):
    # A real server, one process: the embedded model (float32 weights, ~540 MB) under two
    # names, one resident at a time, one of them unloaded when idle for a second.
    f = tmp_path / "models.toml"
    f.write_text('[models.a]\npath = "default"\nttl = 1\n[models.b]\npath = "default"\n')
    srv = serve("--models-file", str(f), "--draft-model", "none", "--max-loaded", "1")
    pid = srv.proc.pid

    def use(model: str) -> float:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=300, json={
            "model": model, "messages": ASK, "max_tokens": 4})
        assert r.status_code == 200, r.text
        return _rss_mb(pid)

    def resident() -> set[str]:
        return {m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]
                if m["loaded"]}

    before = _rss_mb(pid)
    loaded = use("a")
    size = loaded - before  # what one resident model costs the process
    assert size > 300, (before, loaded)
    deadline = time.monotonic() + 20
    while resident() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert resident() == set()
    after_ttl = _rss_mb(pid)
    cycled = [use(m) for m in "babab"]  # each load unloads the other
    print(f"RSS MB: before {before:.0f}, loaded {loaded:.0f}, after the TTL unload "
          f"{after_ttl:.0f}, loads of b/a/b/a/b {[round(x) for x in cycled]}")
    assert after_ttl - before < 0.35 * size  # the unloaded model's memory came back
    # No second model's worth resident, and little left behind per load (measured: ~5 MB)
    assert max(cycled) - loaded < 0.15 * size


def test_each_models_kv_budget_and_prompt_store_count_in_the_memory_budget(tmp_path,
                                                                           embedded):
    """Two models whose weights fit the budget together but whose KV budgets do not: one
    loaded at a time; with KV budgets that fit, both. An "auto" KV budget under a memory
    budget is a quarter of it, the prompt store at most a sixteenth."""
    path = str(make_family("qwen2.5", tmp_path / "q"))
    small = replace(SIZED, grammar_cache_mb=0)
    bare = Fleet(Catalog((ModelSpec("a", path, replace(small, max_kv_tokens=None,
                                                        prompt_store_mb=0)),), "a"),
                 Loader(embedded)).seats[0].bytes  # weights alone
    per = kv_estimate(json.loads((Path(path) / "config.json").read_text()), 1)
    big = replace(small, max_kv_tokens=((max(bare, 16 << 20) // per) // 256 + 1) * 256)
    budget = 2 * bare + 3 * (big.max_kv_tokens * per) // 2 + (4 << 20)
    for config, both in ((big, False), (small, True)):
        specs = [ModelSpec(n, path, config) for n in ("a", "b")]
        fleet = Fleet(Catalog(tuple(specs), "a"), Loader(embedded), memory_budget=budget)
        srv = InProcess(create_app(fleet, ServeConfig()), fleet)
        try:
            for name in ("a", "b"):
                assert ask(srv, "chat", name).status_code == 200
            assert loaded(srv) == ({"a", "b"} if both else {"b"}), config.max_kv_tokens
            seat = fleet.seat("b")
            assert seat.engine.kv_bytes == config.max_kv_tokens * per
        finally:
            srv.stop()
    fleet = Fleet(Catalog((ModelSpec("a", path, BASE),), "a"), Loader(embedded),
                  memory_budget=1 << 30)
    assert fleet.seats[0].spec.config.kv_memory_mb == 256
    assert fleet.seats[0].spec.config.prompt_store_mb == 64


def test_the_memory_budget_flag():
    from specdec.cli import memory_budget

    assert memory_budget("100") == 100 << 20 and memory_budget("none") is None
    assert memory_budget("auto") > 0
    for bad in ("0", "-5", "8G", ""):
        with pytest.raises(ModelConfigError, match="--memory-budget"):
            memory_budget(bad)


def test_the_grammar_cache_flag():
    from specdec.cli import build_parser, engine_config

    def config(*flags: str) -> EngineConfig:
        return engine_config(build_parser().parse_args(["serve", *flags]))

    assert config().grammar_cache_mb == EngineConfig().grammar_cache_mb == 256
    assert config("--grammar-cache-mb", "0").grammar_cache_mb == 0
    with pytest.raises(SystemExit, match="--grammar-cache-mb -1"):
        config("--grammar-cache-mb", "-1")
