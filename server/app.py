"""The FastAPI app: three APIs over one door to the served models.

OpenAI Chat Completions and Completions (`chat`), OpenAI Responses (`responses`) and
Anthropic Messages (`messages`) are thin modules over `door.Door`; this module adds what is
not an API's: the API key and body-size guard, `/health`, `/metrics`, `/v1/models`, and the
one exception handler that answers every error in the shape of the API whose path it hit.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import threading
import time
from pathlib import Path
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.engine import Engine
from specdec.errors import InternalError, SpecdecError

from . import chat, conversations, messages, responses
from .door import Door, ServeConfig
from .errors import WireError, bad_request, ref_of
from .fleet import Fleet, Seat
from .metrics import Metrics
from .openapi import Health, ModelCard, ModelList, error_responses, openapi

log = logging.getLogger("specdec.server")
# each: PREFIX, REQUEST_BODIES, router(door), error(e)
APIS = (messages, responses, conversations, chat)


def api_of(path: str) -> Any:
    """The API module whose error shape a path answers in (OpenAI's by default)."""
    return next((m for m in APIS if path.startswith(m.PREFIX)), chat)


def create_app(served: Engine | Fleet, config: ServeConfig = ServeConfig()) -> FastAPI:
    """The ASGI app serving an engine, or several models by name (`fleet.Fleet`): each
    engine's scheduler started with `config`'s batch, queue and time limits."""
    def lost(e: Exception) -> None:
        """A sharded target lost a rank: the requests have failed; exit non-zero once their
        error responses are out (a follower exits too; the launcher reports it)."""
        from specdec.distributed import EXIT_LOST_RANK

        log.error("the sharded target lost a rank (%s): exiting", e)
        threading.Timer(2.0, os._exit, (EXIT_LOST_RANK,)).start()

    ch = config.channel
    fleet = served if isinstance(served, Fleet) else Fleet.single(served)
    fleet.start(lambda engine: engine.start(
        max_batch=config.max_batch, max_queue=config.max_queue,
        request_timeout_s=config.request_timeout_s,
        publish=ch.publish if ch is not None else None, on_fatal=lost))
    metrics = Metrics()
    door = Door(fleet, config, metrics)

    def statuses() -> list[Any]:
        return [s.engine.status() for s in fleet.seats if s.engine is not None]

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        door.close()

    app = FastAPI(title="specdec", lifespan=lifespan)
    bodies = {p: m for api in APIS for p, m in api.REQUEST_BODIES.items()}
    app.openapi = lambda: openapi(  # type: ignore
        app, bodies, door.engine.target.vocab_size if len(fleet.seats) == 1 else None)
    app.state.door, app.state.metrics = door, metrics

    @app.exception_handler(SpecdecError)
    async def _error(request: Request, e: SpecdecError) -> JSONResponse:
        metrics.add(request_errors_total=1)  # a failed run was logged by `Run.events`
        return api_of(request.url.path).error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        metrics.add(request_errors_total=1)
        return api_of(request.url.path).error(bad_request(f"invalid request: {e.errors()}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return api_of(request.url.path).error(WireError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        # The exception's text stays in the log; the client gets the log line's reference.
        err = InternalError("an unexpected exception")
        log.exception("internal error (ref %s) on %s %s", ref_of(err), request.method,
                      request.url.path)
        metrics.add(request_errors_total=1)
        return api_of(request.url.path).error(err)

    app.add_middleware(Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       api_keys=config.api_keys)

    @app.get("/health", response_model=Health)
    async def health() -> Any:
        each = {s.name: model_health(s) for s in fleet.seats}
        depth = sum(h["queue_depth"] for h in each.values())
        if any(h["status"] == "stopping" for h in each.values()):  # a balancer sends no more
            return JSONResponse({"status": "stopping", "model": door.model_name,
                                 "queue_depth": depth, "models": each}, status_code=503)
        return {"status": "ok", "model": door.model_name, "queue_depth": depth,
                "models": each}

    @app.get("/metrics", response_class=PlainTextResponse, responses=error_responses(401))
    async def prom() -> PlainTextResponse:
        sts = statuses()
        text = metrics.render(sum(st.queue_depth for st in sts),
                              sts[0].stats if len(fleet.seats) == 1 else None,
                              sum(st.active for st in sts),
                              ch.collective_s if ch is not None else None)
        if len(fleet.seats) > 1:
            text += model_metrics(fleet)
            text += "\n".join([  # requests waiting for room for their model
                "# TYPE specdec_model_waiting gauge", f"specdec_model_waiting {fleet.waiting}",
                "# TYPE specdec_model_waits_total counter",
                f"specdec_model_waits_total {fleet.waits}",
                "# TYPE specdec_model_wait_seconds_total counter",
                f"specdec_model_wait_seconds_total {fleet.wait_s:g}",
                "# TYPE specdec_model_wait_timeouts_total counter",
                f"specdec_model_wait_timeouts_total {fleet.wait_timeouts}"]) + "\n"
        text += grammar_metrics(fleet)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", response_model=ModelList, responses=error_responses(401))
    async def models(request: Request) -> Any:
        if "anthropic-version" in request.headers:  # Anthropic's client: its list's shape
            cards = [{"type": "model", "id": s.name, "display_name": s.name,
                      "created_at": "1970-01-01T00:00:00Z"} for s in fleet.seats]
            return JSONResponse({"data": cards, "has_more": False,
                                 "first_id": cards[0]["id"], "last_id": cards[-1]["id"]})
        return {"object": "list", "data": [card(s) for s in fleet.seats]}

    @app.get("/v1/models/{name}", response_model=ModelCard, responses=error_responses(401, 404))
    async def model(name: str) -> dict[str, Any]:
        return card(fleet.route(name))

    def admin(name: str) -> Seat:
        """The model an administrator's request names; refused on a server that listens
        beyond loopback with no API key (anyone could unload its models)."""
        if config.api_key is None and not config.api_keys and config.host not in LOOPBACK:
            raise WireError(401, f"model administration needs --api-key on a server "
                                 f"listening on {config.host}", code="invalid_api_key")
        return fleet.route(name)

    @app.post("/v1/models/{name}/load", response_model=ModelCard,
              responses=error_responses(401, 404, 503, 504))
    async def load(name: str) -> dict[str, Any]:
        seat = admin(name)
        await fleet.load(seat, config.request_timeout_s)
        return card(seat)

    @app.post("/v1/models/{name}/unload", response_model=ModelCard,
              responses=error_responses(401, 404, 503))
    async def unload(name: str) -> dict[str, Any]:
        seat = admin(name)
        fleet.unload(seat)
        return card(seat)

    @app.post("/v1/models/{name}/pin", response_model=ModelCard,
              responses=error_responses(401, 404))
    async def pin(name: str) -> dict[str, Any]:
        seat = admin(name)
        fleet.pin(seat, True)
        return card(seat)

    @app.post("/v1/models/{name}/unpin", response_model=ModelCard,
              responses=error_responses(401, 404))
    async def unpin(name: str) -> dict[str, Any]:
        seat = admin(name)
        fleet.pin(seat, False)
        return card(seat)

    for api in APIS:
        app.include_router(api.router(door))
    if config.ui:
        add_playground(app)
    return app


STATIC = Path(__file__).parent / "static"


def add_playground(app: FastAPI) -> None:
    """The playground page: `GET /` and its files under `/ui/`, static and the same for
    everyone (no data of the server's: the page reads everything through the APIs, with the
    API key the user gives it, so it shows no more than they do)."""
    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html",
                            headers={"Cache-Control": "no-cache"})

    app.mount("/ui", StaticFiles(directory=STATIC), name="ui")


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def card(s: Seat) -> dict[str, Any]:
    """A served model as `/v1/models` lists it (`openapi.ModelCard`)."""
    return {"id": s.name, "object": "model", "created": 0, "owned_by": "specdec",
            "aliases": list(s.spec.aliases), **s.card, "loaded": s.engine is not None,
            "pinned": s.pinned}


def model_health(s: Seat) -> dict[str, Any]:
    """A served model's part of `/health` (`openapi.ModelHealth`)."""
    if s.engine is None:
        return {"status": "unloaded", "queue_depth": 0, "active": 0, "pinned": s.pinned}
    st = s.engine.status()
    return {"status": "ok" if st.alive else "stopping", "queue_depth": st.queue_depth,
            "active": st.active, "pinned": s.pinned}


def model_metrics(fleet: Fleet) -> str:
    """Prometheus lines per served model: loaded or not, loads, unloads, load seconds,
    requests and output tokens."""
    return _per_model([(s.name, s) for s in fleet.seats], (
        ("model_loaded", "gauge", lambda s: int(s.engine is not None)),
        ("model_loads_total", "counter", lambda s: s.loads),
        ("model_evictions_total", "counter", lambda s: s.evictions),
        ("model_load_seconds_total", "counter", lambda s: s.load_s),
        ("model_requests_total", "counter", lambda s: s.requests),
        ("model_completion_tokens_total", "counter", lambda s: s.tokens)))


def grammar_metrics(fleet: Fleet) -> str:
    """Prometheus lines per loaded model's compiled-grammar cache: its bytes (as measured
    when each grammar compiled), its size limit, the grammars it holds, and the compiles,
    reuses and evictions so far."""
    return _per_model([(s.name, c) for s in fleet.seats
                       if (c := getattr(s.engine, "compiler", None)) is not None], (
        ("grammar_cache_bytes", "gauge", lambda c: c.cached_bytes),
        ("grammar_cache_limit_bytes", "gauge", lambda c: c.cache_bytes),
        ("grammar_cache_grammars", "gauge", lambda c: c.cached),
        ("grammar_compiles_total", "counter", lambda c: c.misses),
        ("grammar_cache_hits_total", "counter", lambda c: c.hits),
        ("grammar_cache_evictions_total", "counter", lambda c: c.evictions)))


def _per_model(items: list[tuple[str, Any]],
               families: tuple[tuple[str, str, Callable[[Any], float]], ...]) -> str:
    """Prometheus text of metric `families` (name, type, value of an item) for each
    (model name, item); integers exactly, other numbers as %g."""
    lines = []
    for name, kind, value in families:
        lines.append(f"# TYPE specdec_{name} {kind}")
        lines += [f'specdec_{name}{{model="{n}"}} '
                  f'{v if isinstance(v := value(x), int) else format(v, "g")}'
                  for n, x in items]
    return "\n".join(lines) + "\n"


def _protected(path: str) -> bool:
    """Paths behind the API key: the API, metrics and the API's documentation (`/health`
    stays open for load balancers)."""
    return path.startswith(("/v1/", "/docs", "/redoc")) or path in ("/metrics",
                                                                    "/openapi.json")


class Guard:
    """API key and body-size checks, as plain ASGI middleware: unlike an `@app.middleware`
    function (BaseHTTPMiddleware) it leaves the receive channel alone, so handlers see a
    client's disconnect (`Request.is_disconnected`) while tokens are still flowing. The key
    may come as `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY`
    (Anthropic's). With several keys (`api_keys`: (owner, key) pairs), the key a request
    gave names its owner (`request.state.owner`): whose stored objects it sees."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int,
                 api_keys: tuple[tuple[str, str], ...] = ()) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes
        self.keys = [(owner, key.encode()) for owner, key in api_keys] + (
            [("", api_key.encode())] if api_key else [])
        self.api_key = bool(self.keys)

    def _owner(self, headers: dict[str, str]) -> str | None:
        """The owner of the key the request gave (None: no key of ours). Every key is
        compared, in constant time each."""
        bearer = headers.get("authorization", "").encode("latin-1")
        given = headers.get("x-api-key", "").encode("latin-1")
        found = None
        for owner, want in self.keys:
            if hmac.compare_digest(bearer, b"Bearer " + want) or (
                    bool(given) and hmac.compare_digest(given, want)):
                found = owner if found is None else found
        return found

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                       for k, v in scope.get("headers", [])}
            error = None
            if self.api_key:
                owner = self._owner(headers)
                if owner is not None:
                    scope.setdefault("state", {})["owner"] = owner
                elif _protected(scope["path"]):
                    error = WireError(401, "missing or invalid API key",
                                      code="invalid_api_key")
            size = headers.get("content-length", "")
            if error is None and size.isdigit() and int(size) > self.max_body_bytes:
                error = WireError(413, f"request body over {self.max_body_bytes} bytes",
                                  code="request_too_large")
            if error is not None:
                await api_of(scope["path"]).error(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


ROUND_LIMIT_S = 300.0  # a sharded target's round that runs longer has lost a rank
STOPPING_ROUND_LIMIT_S = 5.0  # ... once asked to stop (mlx.launch stops the others so)


def _watchdog(server: Any, engine: Engine) -> None:
    """A sharded target: a collective whose peer died may never return. A round that runs
    past the limit (much shorter once the server was asked to stop: mlx.launch stops the
    other ranks when one fails) fails every request with a 503, and the server exits."""
    from specdec.errors import SchedulerStopped

    while True:
        time.sleep(0.5)
        st = engine.status()
        if st.failed:
            return
        limit = STOPPING_ROUND_LIMIT_S if server.should_exit else ROUND_LIMIT_S
        if st.round_s is not None and st.round_s > limit:
            log.error("a round has run for over %.0fs: a rank is lost", limit)
            engine.abort(SchedulerStopped("the sharded target failed (a rank stopped "
                                          "responding); this server is stopping"))
            return


def serve(served: Engine | Fleet, config: ServeConfig = ServeConfig()) -> None:
    """Serve an engine, or several models by name, until interrupted."""
    import gc
    import signal

    import uvicorn

    from specdec import blas

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    app = create_app(served, config)
    engine = app.state.door.engine
    if isinstance(served, Fleet):
        log.info("serving %s at http://%s:%d/v1 (default %r; at most %s loaded; max batch %d "
                 "each, BLAS: %s)", ", ".join(repr(s.name) for s in served.seats),
                 config.host, config.port, served.default.name,
                 served.max_loaded or "all", config.max_batch, blas.active())
    else:
        draft = ("none" + (" (jump-forward on constrained requests)" if engine.jump_forward
                           else "")
                 if engine.draft is None else
                 "self" if engine.draft is engine.target else engine.draft.name)
        log.info("serving %s at http://%s:%d/v1 (draft: %s, k=%d, max batch %d, BLAS: %s)",
                 engine.target.name, config.host, config.port, draft, engine.default_spec.k,
                 config.max_batch, blas.active())
    if config.channel is not None:
        log.info("target sharded over %d ranks (mlx.launch); this is rank 0 (pid %d)",
                 config.channel.group.size(), os.getpid())
    # SIGTERM/SIGINT: stop accepting, let in-flight requests finish (at most 30 s), then stop
    # the scheduler (a sharded target's other ranks stop with it) and exit 0. (uvicorn
    # re-raises the signal after its shutdown, to the handler it found: this one.)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                           log_level="info", timeout_graceful_shutdown=30))
    if config.channel is not None:
        threading.Thread(target=_watchdog, args=(server, engine),
                         name="specdec-watchdog", daemon=True).start()
    # What is alive now (the loaded models, tokenizers, templates, grammars: ~120k objects)
    # lives as long as the server: out of the collector's way. A full collection otherwise
    # scans all of it, ~90 ms with every thread (every stream) stopped.
    gc.collect()
    gc.freeze()
    try:
        server.run()
    finally:
        app.state.door.fleet.close()
