"""What every API module shares: the server's settings, reading and parsing a body (and the
wire's number types, our extension fields, the sampling and tool builders), and one route
that runs a `specdec.request.GenerateRequest` through the engine and answers it.

An API module (`chat`, `responses`, `messages`) gives `Door.serve` its body's pydantic model,
its conversion to the neutral request and its `Fold`: one pass over a run's events that makes
both its stream and its whole answer. `serve` parses (`Door.parse`), routes (a model this
server does not serve is a 404 before the body is read further), converts, opens the run
(`Door.open`) and answers; a client gone before a whole answer gets a 499. Errors are
`SpecdecError`s, answered in the shape of the API whose path they hit: by the API's `error`
in its body's own field names, or by the app's handler before there is a body.

Admission comes before work: a full server answers 503 before a body is parsed and before a
request is rendered; a prompt that cannot fit the context even at a lower bound on its tokens
(`specdec.prompt_bound`, no tokenizer) is a 400 at once; rendering, tokenizing and compiling
run in a bounded pool (`Bounded`: past its bound, 503), and a large body is parsed and
validated on a thread of its own, so one client's body never stalls the event loop's other
streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import re
import reprlib
import socket
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Protocol, TypeVar

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import (AllowInfNan, BaseModel, BeforeValidator, Field, Strict, ValidationError,
                      ValidationInfo)
from pydantic_core import PydanticCustomError

from specdec.config import LIMITS, MAX_TREE_NODES
from specdec.engine import Engine
from specdec.errors import (GrammarRefused, GrammarStateError, QueueFull, SamplingError,
                            SpecdecError)
from specdec.events import (Event, Failed, Finished, GenerationStats, RequestStream,
                            TokenLogprob, TokenSource)
from specdec.prepare import Request
from specdec.types import TokenId
from specdec.prompt_bound import PromptBound
from specdec.request import (SEED_LIMIT, UNGUARANTEED, GenerateRequest, Message,
                             SamplingParams, SpecOverrides, Tool)

from .errors import (StoreError, StoreUnavailable, WireError, bad_request, ref_of,
                     wire_param)
from .fleet import Fleet, Seat
from .metrics import Metrics
from .store import Bounds, Store, open_store

M = TypeVar("M", bound=BaseModel)
B = TypeVar("B", bound=BaseModel)  # an API's body: it names `model` and `stream`
R = TypeVar("R")
log = logging.getLogger("specdec.server")
INLINE_BODY_BYTES = 256 * 1024  # a larger body is parsed off the event loop
PREPARE_WORKERS = PARSE_WORKERS = 2


# -- the wire's numbers (every API's models use these) -----------------------------------------
def integral(v: Any) -> Any:
    """JSON Schema's integer includes 3.0 (generators and some clients write it so)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


# No "1" for 1, no true for 1, no NaN or infinity (1e400 parses as inf), 3.0 for 3.
Int = Annotated[int, BeforeValidator(integral), Strict()]
Float = Annotated[float, Strict(), AllowInfNan(False)]


def within_context(what: str, count: Callable[[list[Any]], int] = len) -> BeforeValidator:
    """A list field's check before its items are read: `count(items)` (a lower bound on
    the prompt's tokens: token ids, turns) against the validation context's
    `context_length` (`Door.validate`); at or over it, `context_length_exceeded`. Last in
    the field's annotations, so that it runs first."""
    def check(v: Any, info: ValidationInfo) -> Any:
        limit = (info.context or {}).get("context_length")
        if isinstance(v, list) and isinstance(limit, int) and (n := count(v)) >= limit:
            raise PydanticCustomError("context_length_exceeded", "{n} {what}, a token each "
                                      "at least; the context length is {limit}",
                                      {"n": n, "what": what, "limit": limit})
        return v
    return BeforeValidator(check)


Seed = Annotated[Int | None, Field(ge=0, le=SEED_LIMIT)]


class Extensions(BaseModel):
    """Our fields that every API's body takes, last among its fields (a body's model derives
    from this class before its fields' base, so they stay last in its document): the
    speculation's knobs and what a constrained answer does at its token budget."""

    num_draft_tokens: Int | None = Field(None, ge=0, le=16, description="0: plain decoding")
    draft_masking: bool | None = None
    prompt_lookup: bool | None = None
    tree_tokens: Int | None = Field(None, ge=0, le=MAX_TREE_NODES,
                                    description="most token-tree branch tokens a round adds "
                                                "to its chain (0: chains only; default: the "
                                                "server's --tree)")
    close_at_budget: bool | None = Field(
        None, description="true (the default): a constrained answer closes its document in "
                          "time for the token budget; false: it is cut where the budget ends")
    token_sources: bool | Annotated[Int, Field(ge=0, le=20)] | None = Field(
        None, description="each output token's source (forced, looked_up, suffixed, drafted, "
                          "branch, target, budget), how many tokens its grammar allowed, its "
                          "logprob and this many top alternatives (true: none; 0..20), "
                          "in `token_sources` beside the tokens' text (off by default)")

    def engine_fields(self) -> dict[str, Any]:
        """These fields as the request's: `spec` ("default" where none is given, None for
        plain decoding (k = 0), else the overrides given), `close_at_budget` and
        `token_sources` (true: 0 alternatives; false: off)."""
        k = self.num_draft_tokens
        given = {name: v for name, v in (("k", k), ("draft_masking", self.draft_masking),
                                          ("lookup", self.prompt_lookup),
                                          ("tree", self.tree_tokens)) if v is not None}
        spec: SpecOverrides = None if k == 0 else given or "default"
        ts = self.token_sources
        return {"spec": spec, "close_at_budget": self.close_at_budget is not False,
                "token_sources": None if ts is None or ts is False else
                0 if ts is True else ts}


def sampling(temperature: float | None, top_p: float | None, top_k: int | None,
             seed: int | None, logit_bias: tuple[tuple[int, float], ...] = ()
             ) -> SamplingParams:
    """A body's sampling fields as the request's (every API's defaults: temperature and
    top_p 1, as OpenAI's and Anthropic's are; top_k off).

    Raises:
        WireError: 400 naming the field out of range.
    """
    try:
        return SamplingParams(1.0 if temperature is None else temperature,
                              1.0 if top_p is None else top_p, top_k or 0, seed, logit_bias)
    except SamplingError as e:
        raise bad_request(str(e), wire_param(e, {})) from e


def tool(name: str, description: str | None, parameters: Mapping[str, Any] | None,
         strict: bool | None) -> Tool:
    """A function tool as the request's (no parameters: it takes none)."""
    return Tool(name, description, strict=strict is True,
                **({"parameters": parameters} if parameters is not None else {}))


# -- the fields a body's model does not name (every API's one policy) ---------------------------
@dataclass(frozen=True)
class Unmodeled:
    """What an API does with a body field its pydantic model does not name (its model takes
    them as extras): a field client libraries send by default and that cannot change the
    answer is accepted and ignored; a field that would change it is a 400 naming it, unless
    given its no-op value (a 400 code `unsupported_parameter`: never silently ignored).

    Attributes:
        ignored: accepted and ignored.
        noop: refused unless given one of its no-op values: name -> (values, why others
            are refused).
    """

    ignored: frozenset[str]
    noop: Mapping[str, tuple[tuple[Any, ...], str]]

    def refuse(self, body: BaseModel) -> None:
        """Raises:
            WireError: 400 naming the first field of the body this server does not take."""
        for name, v in (body.model_extra or {}).items():
            if name in self.ignored:
                continue
            if name not in self.noop:
                raise bad_request(f"unknown parameter {name!r}: this server does not "
                                  "implement it", name, "unsupported_parameter")
            values, why = self.noop[name]
            if not any(v is n or (type(v) is type(n) and v == n) for n in values):
                raise bad_request(f"{name}={reprlib.repr(v)} is not supported: {why}", name,
                                  "unsupported_parameter")

    def document(self, schema: dict[str, Any]) -> None:
        """A model's `json_schema_extra`: the document names these fields too, and no
        others."""
        props = schema.setdefault("properties", {})
        props.update({k: {"description": "accepted and ignored"} for k in sorted(self.ignored)})
        props.update({k: {"description": f"refused unless one of {list(noop)}: {why}"}
                      for k, (noop, why) in self.noop.items()})
        schema["additionalProperties"] = False


@dataclass(frozen=True)
class ServeConfig:
    """The server's settings (`specdec serve` flags).

    Attributes:
        host, port: where to listen. api_key: required of clients when set (Bearer or
            `x-api-key`); api_keys: several, each with its owner's name (a request sees the
            stored objects of its key's owner only). ui: the playground page at `/`
            (`server/static`). max_batch, max_queue, request_timeout_s: the scheduler's
            (`Engine.start`). max_body_bytes, max_json_depth: a body's limits.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    api_keys: tuple[tuple[str, str], ...] = ()  # (owner, key): each key's objects its own
    ui: bool = True
    max_batch: int = LIMITS.max_batch
    max_queue: int = LIMITS.max_queue
    request_timeout_s: float | None = LIMITS.request_timeout_s
    max_body_bytes: int = 8 * 1024 * 1024
    max_json_depth: int = 128
    channel: Any = field(default=None, compare=False)  # a sharded target's broadcast
    # where stored responses and conversations go: an SQLite file, "memory" or "none"
    store: str = "memory"
    store_bounds: Bounds = Bounds()


class Bounded:
    """A thread pool that refuses work it cannot start soon: past `workers` running and
    `waiting` queued jobs, `run` raises `QueueFull` (a 503) instead of queueing more."""

    def __init__(self, workers: int, waiting: int, name: str, what: str) -> None:
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self.workers, self.limit, self.what = workers, workers + waiting, what
        self.pending = 0  # submitted and not done (a cancelled wait does not end the job)
        self._lock = threading.Lock()

    async def run(self, fn: Callable[..., R], *args: Any) -> R:
        with self._lock:
            if self.pending >= self.limit:
                raise QueueFull(f"{self.pending} requests are being {self.what} (at most "
                                f"{self.limit})")
            self.pending += 1
        try:
            job = self.pool.submit(fn, *args)
        except BaseException:  # shut down
            self._done(None)
            raise
        job.add_done_callback(self._done)
        return await asyncio.wrap_future(job)

    def spare(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run `fn` in the background where a worker is idle now, for work that may be
        skipped (nothing waits on it; its failure is logged); returns whether it runs."""
        with self._lock:
            if self.pending >= self.workers:
                return False
            self.pending += 1
        try:
            job = self.pool.submit(fn, *args)
        except RuntimeError:  # shut down
            self._done(None)
            return False
        job.add_done_callback(self._background_done)
        return True

    def _background_done(self, job: Any) -> None:
        self._done(job)
        if not job.cancelled() and job.exception() is not None:
            log.error("background %s job failed", self.what, exc_info=job.exception())

    def _done(self, _: Any) -> None:
        with self._lock:
            self.pending -= 1

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


SSEEvent = tuple[str | None, Any]  # one server-sent event: its name (None: unnamed), its data


class Fold(Protocol):
    """One API's answer to a run: `feed` turns each of its events into the stream's events
    and keeps what the whole answer needs, so a streamed and a whole answer come from one
    pass and cannot differ."""

    def headers(self) -> dict[str, str]:
        """The API's own response headers (`request_headers` are every API's)."""
        return {}

    def opening(self) -> list[SSEEvent]:
        """The stream's events before the run's first."""
        return []

    def feed(self, ev: Event) -> list[SSEEvent]:
        """The stream's events for one of the run's events (`Finished`, `Failed` too)."""
        ...

    def answer(self) -> dict[str, Any]:
        """The whole answer, once `Finished` was fed."""
        ...


def cache_scope(owner: str, body: BaseModel) -> str:
    """The prompt store's partition a request reads and adds to
    (`GenerateRequest.cache_scope`): its API key's owner, and within it the body's
    `prompt_cache_key` where given (OpenAI's finer partition of the prompt cache). So a
    caller's `cached_tokens` and timing never reveal another caller's prompts.

    Raises:
        WireError: a `prompt_cache_key` that is not a string (400 naming it).
    """
    key = (getattr(body, "model_extra", None) or {}).get("prompt_cache_key")
    if key is None:
        return owner
    if not isinstance(key, str):
        raise bad_request("prompt_cache_key must be a string", "prompt_cache_key")
    return f"{owner}\x1f{key}"


class Door:
    """The served models as the API modules see them: a request names its model
    (`route`), which `open` leases (loading it on first use) for the request's life."""

    def __init__(self, fleet: Fleet, config: ServeConfig, metrics: Metrics) -> None:
        self.fleet, self.config, self.metrics = fleet, config, metrics
        self.store: Store | None = open_store(config.store, config.store_bounds)
        # Which server this is, for the background responses it runs: replicas sharing one
        # database each mark only their own as interrupted when they start again.
        self.runner = f"{socket.gethostname()}:{config.port}"
        if self.store is not None:  # background responses a stopped server left running
            n = self.store.interrupted("the server stopped while this response was in progress",
                                       self.runner if self.store.shared else None)
            if n:
                log.warning("%d background response(s) left in progress by a stopped server "
                            "marked failed", n)
        # Store work runs here, one call at a time in arrival order, never on the event loop
        # (a write that evicts, a locked file, a slow disk stall no stream).
        self.store_thread = ThreadPoolExecutor(1, thread_name_prefix="specdec-store")
        self.turns: dict[str, asyncio.Lock] = {}  # conversation id -> its turn in flight
        waiting = max(config.max_queue, 1)
        self.prepares = Bounded(PREPARE_WORKERS, waiting, "specdec-prepare", "prepared")
        self.parses = Bounded(PARSE_WORKERS, waiting, "specdec-parse", "read")

    @property
    def engine(self) -> Engine | None:
        """The default model's engine (None while it is not loaded)."""
        return self.fleet.default.engine

    @property
    def model_name(self) -> str:
        return self.fleet.default.name

    @property
    def bound(self) -> PromptBound | None:
        """The default model's prompt bound (None while it is not loaded)."""
        return self.fleet.default.bound

    def route(self, model: str | None, param: str = "model") -> Seat:
        """The model a request names (a name or an alias; None or "default": the default).

        Raises:
            WireError: 404 naming the models this server serves.
        """
        return self.fleet.route(model, param)

    def admit(self, seat: Seat | None = None) -> None:
        """Raise what submitting to `seat`'s engine would raise now for want of room (a 503:
        the queue is full, or the engine stopped), before any work on the request. Before
        the body names a model (`seat` None), a server of one model checks that one; a server
        of several checks once the model is known."""
        if seat is None and len(self.fleet.seats) == 1:
            seat = self.fleet.seats[0]
        if seat is None or seat.engine is None:
            return
        try:
            seat.engine.check_room()
        except SpecdecError as e:
            if e.code == "queue_full":
                self.metrics.add(requests_rejected_total=1)
            raise

    async def read_body(self, request: HTTPRequest) -> bytes:
        """The body, read with a running size limit (a chunked body is cut off at the limit,
        not read whole first)."""
        limit, chunks, size = self.config.max_body_bytes, [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise WireError(413, f"request body over {limit} bytes",
                                code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    async def parse(self, request: HTTPRequest, model: type[M], *, admit: bool = True) -> M:
        """Read and validate a body with the API's pydantic model (the only parser): after
        the admission check when `admit` (a full server parses nothing), and off the event
        loop when the body is large.

        Raises:
            WireError: 400 naming the first offending field (`a.b[0].c`); 413.
            SpecdecError: 503 (`admit`).
        """
        raw = await self.read_body(request)
        if admit:
            self.admit()
        if len(raw) <= INLINE_BODY_BYTES:
            return self.validate(raw, model)
        return await self._run(self.parses, self.validate, raw, model)

    def validate(self, raw: bytes, model: type[M]) -> M:
        """A body's bytes as the API's model: JSON, nesting limit, pydantic.

        Raises:
            WireError: 400 naming the first offending field (`a.b[0].c`).
        """
        try:
            body = json.loads(raw)
        except RecursionError as e:
            raise bad_request("request body is nested too deeply") from e
        except UnicodeDecodeError as e:
            raise bad_request("request body is not valid JSON: it is not UTF-8 text") from e
        except json.JSONDecodeError as e:
            raise bad_request(f"request body is not valid JSON: {e}") from e
        except ValueError as e:  # an integer over Python's digit limit
            raise bad_request("request body is not valid JSON for this server: a number "
                              "has too many digits") from e
        if _depth(body) > self.config.max_json_depth:
            raise bad_request(f"request body is nested more than "
                              f"{self.config.max_json_depth} levels deep")
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        if _ESCAPED_SURROGATE.search(raw) and (at := _lone_surrogate(body)) is not None:
            raise bad_request(f"{at or 'request body'}: a string holds an unpaired UTF-16 "
                              "surrogate escape (\\ud800-\\udfff): it is not Unicode text",
                              at or None)
        # What a model may check before reading a long list's items (token ids' count): the
        # named model's context, when it is loaded.
        seat = self.fleet.loaded(body.get("model"))
        bound = seat.bound if seat is not None else None
        limits = {"context_length": bound.context} if bound is not None else {}
        try:
            return model.model_validate(body, context=limits)
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            path = field_path(body, err["loc"])
            if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
                path += "." + str((err.get("ctx") or {}).get("discriminator", "")).strip("'")
            code = "context_length_exceeded" if err["type"] == "context_length_exceeded" \
                else None
            raise bad_request(f"{path}: {err['msg']}" if path else err["msg"],
                              path or None, code) from None

    async def prepare(self, greq: GenerateRequest, seat: Seat) -> Request:
        """Check the cheap limits, then render, validate and compile the request for
        `seat`'s model (loaded, leased) in the bounded pool (within the compile time limit).

        Raises:
            SpecdecError: the request is invalid (400s); the pool is full (503).
        """
        if seat.bound is not None:
            seat.bound.check(greq)
        return await self._run(self.prepares, seat.engine.prepare, greq)

    @contextlib.asynccontextmanager
    async def lease(self, seat: Seat) -> AsyncIterator[Engine]:
        """`seat`'s engine, loaded and leased for the block (no work is queued on it)."""
        engine = await self.fleet.acquire(seat, self.config.request_timeout_s)
        try:
            yield engine
        finally:
            self.fleet.release(seat)

    async def _run(self, pool: Bounded, fn: Callable[..., R], *args: Any) -> R:
        try:
            return await pool.run(fn, *args)
        except QueueFull:
            self.metrics.add(requests_rejected_total=1)
            raise

    async def open(self, greq: GenerateRequest, http: HTTPRequest, seat: Seat) -> "Run":
        """Lease `seat`'s model (loading it first if need be), admit, prepare and submit a
        request; the lease ends with the run (`Run.close`).

        Raises:
            SpecdecError: the request is invalid (400s), the server is full or the model
                cannot load (503).
        """
        engine = await self.fleet.acquire(seat, self.config.request_timeout_s)
        try:
            self.admit(seat)
            t0 = time.perf_counter()
            req = await self.prepare(greq, seat)
            prepare_s = time.perf_counter() - t0
            self.metrics.add(requests_total=1,
                             requests_constrained_total=int(req.constraint is not None))
            try:
                stream = engine.submit(req, RequestStream().bind(asyncio.get_running_loop()))
            except SpecdecError as e:
                if e.code == "queue_full":
                    self.metrics.add(requests_rejected_total=1)
                raise
            seat.requests += 1
        except BaseException:
            self.fleet.release(seat)
            raise
        return Run(self, req, stream, http, seat, engine, greq, prepare_s=prepare_s)

    async def serve(self, http: HTTPRequest, body_type: type[B],
                    request: Callable[[B], GenerateRequest | Awaitable[GenerateRequest]],
                    fold: Callable[[B, Run], Fold],
                    error: Callable[[SpecdecError, B], Response],
                    detach: Callable[[B, Run, Fold], Awaitable[Response | None]] | None = None
                    ) -> Response:
        """Every API's route: parse the body, route it (a model this server does not serve
        is a 404 before the rest of the body is read), make the neutral request, open the
        run and answer through the API's fold: its stream, or its whole answer once the run
        finished. A client gone before the whole answer gets a 499 and no body (nobody is
        there to read one, in any API's shape).

        Args:
            body_type: the API's body model. request: the neutral request a body means.
            fold: the API's answer to a run. error: an error in the API's shape, in the
                body's field names. detach: where the API takes the run over (a background
                response), its answer now; None: answered here as usual.
        """
        body = await self.parse(http, body_type)
        try:
            seat = self.route(body.model)  # type: ignore[attr-defined]
            made = request(body)
            greq = await made if inspect.isawaitable(made) else made
            greq = replace(greq, cache_scope=cache_scope(getattr(http.state, "owner", ""), body))
            run = await self.open(greq, http, seat)
            out = fold(body, run)
            taken = await detach(body, run, out) if detach is not None else None
            if taken is not None:
                return taken
            headers = {**out.headers(), **request_headers(run.request)}
            if body.stream:  # type: ignore[attr-defined]
                return RunResponse(run, _stream(run, out), headers)
            async with contextlib.aclosing(run.events()) as events:
                async for ev in events:
                    if isinstance(ev, Failed):
                        raise ev.error
                    out.feed(ev)
        except SpecdecError as e:
            self.metrics.add(request_errors_total=1)
            return error(e, body)
        if run.left:  # the client went away (499: client closed the request)
            return Response(status_code=499)
        return JSONResponse(out.answer(), headers=headers)

    def store_submit(self, fn: Callable[..., R], *args: Any, **kw: Any) -> Future[R]:
        """Run store work on the store's thread (in order); its future."""
        return self.store_thread.submit(fn, *args, **kw)

    async def stored(self, fn: Callable[..., R], *args: Any, **kw: Any) -> R:
        """Store work off the event loop, its failures in the API's terms: the store failing
        is a 503 (never a 500: not the request's fault, nothing lost), a bound a 400 naming
        it, an item id twice in one context OpenAI's 400.

        Raises:
            WireError: as above.
        """
        try:
            return await asyncio.wrap_future(self.store_submit(fn, *args, **kw))
        except StoreError:
            raise  # (a 400 naming the bound, or OpenAI's duplicate-id 400)
        except (sqlite3.Error, StoreUnavailable, OSError) as e:
            log.error("the response store failed: %s", e)
            self.metrics.add(store_errors_total=1)
            raise WireError(503, f"the response store is unavailable: {e}",
                            code="store_unavailable", headers={"Retry-After": "1"}) from None

    @contextlib.asynccontextmanager
    async def conversation_turn(self, cid: str, timeout_s: float | None
                                ) -> AsyncIterator[None]:
        """One turn at a time on conversation `cid`: a second waits for the first (at most
        `timeout_s`: then a 409 naming it)."""
        lock = self.turns.setdefault(cid, asyncio.Lock())
        try:
            await asyncio.wait_for(lock.acquire(), timeout_s)
        except asyncio.TimeoutError:
            raise WireError(409, f"another turn on conversation {cid!r} is in progress and "
                            f"did not end within this request's time limit ({timeout_s:g}s); "
                            "send this turn again once it has", param="conversation",
                            code="conversation_locked") from None
        try:
            yield
        finally:
            lock.release()
            if not lock.locked() and not getattr(lock, "_waiters", None):
                self.turns.pop(cid, None)

    def close(self) -> None:
        self.fleet.close()
        self.prepares.close()
        self.store_thread.shutdown(wait=True)
        self.parses.close()
        if self.store is not None:
            self.store.close()


async def _stream(run: Run, fold: Fold) -> AsyncIterator[str]:
    """A run's answer as server-sent events."""
    for name, data in fold.opening():
        yield sse(name, data)
    async for ev in run.events():
        for name, data in fold.feed(ev):
            yield sse(name, data)


@dataclass
class Run:
    """A submitted request: its prepared form and its events."""

    door: Door
    request: Request
    stream: RequestStream
    http: HTTPRequest
    seat: Seat
    engine: Engine
    greq: GenerateRequest | None = None  # the neutral request (its history's next prefix)
    created: int = field(default_factory=lambda: int(time.time()))
    left: bool = False  # the client went away before the end
    closed: bool = False
    prepare_s: float = 0.0  # rendering its prompt and compiling (or finding) its grammar
    on_close: list[Callable[[], None]] = field(default_factory=list)  # called at its end
    detached: bool = False  # runs whether or not its client stays (a background response)

    @property
    def model(self) -> str:
        """The name of the model that serves it (what responses report)."""
        return self.seat.name

    def close(self) -> None:
        """Stop the request if it still runs and end its lease on the model (once)."""
        self.stream.cancel()
        if not self.closed:
            self.closed = True
            self.door.fleet.release(self.seat)
            for f in self.on_close:
                f()

    def keep_history(self, ev: Finished) -> None:
        """Queue the prefill of the history this conversation's next request starts with
        (`Engine.keep_history`), in the background where a preparing worker is idle: the
        answer as every API gives it back (its text, reasoning and calls)."""
        keep = getattr(self.engine, "keep_history", None)  # (a stand-in engine: none)
        if keep is None or self.greq is None or not self.greq.messages or \
                not getattr(self.request, "keep", True):  # no next turn likely
            return
        answer = Message("assistant", ev.text, ev.reasoning, ev.tool_calls)
        self.door.prepares.spare(keep, self.greq, answer, self.request)

    async def events(self) -> AsyncIterator[Event]:
        """The request's events. A client that goes away is noticed within ~0.5 s, while
        tokens still flow; the request is then stopped within a round and `left` set."""
        checked = time.monotonic()
        try:
            while True:
                ev = await self.stream.next(timeout=0.5)
                if not self.detached and time.monotonic() - checked >= 0.5:
                    checked = time.monotonic()
                    if await self.http.is_disconnected():
                        self.left = True
                        return
                if ev is None:
                    continue
                if isinstance(ev, Failed):
                    log_failure(self.request, ev.error)
                if isinstance(ev, Finished):
                    self.door.metrics.observe(len(self.request.prompt_ids),
                                              ev.usage.completion_tokens, ev.stats.counters,
                                              ev.stats.seconds,
                                              unguaranteed=bool(self.request.unguaranteed))
                    self.seat.tokens += ev.usage.completion_tokens
                    self.keep_history(ev)
                yield ev
                if isinstance(ev, (Finished, Failed)):
                    return
        finally:
            self.close()  # stops the engine when the client left


LOG_LIMIT = 300  # characters of a request's constraint, grammar or parser state in a log line


def log_failure(req: Request, e: SpecdecError) -> None:
    """The server log's account of a failed request: an internal fault with what locates
    it (position, constraint, grammar; bounded) and the reference its client was given, a
    stopped request as a warning."""
    if isinstance(e, GrammarStateError):
        g = req.grammar
        log.error("grammar state error at output token %s (ref %s): %.*s\nconstraint: %.*s\n"
                  "grammar: %.*s", e.position, ref_of(e), LOG_LIMIT, e.detail or e, LOG_LIMIT,
                  req.constraint, LOG_LIMIT, g.text if g else None)
    elif isinstance(e, GrammarRefused):  # the client's grammar: one short line
        log.warning("request stopped: %s; constraint: %.*s", e, LOG_LIMIT,
                    str(req.constraint).replace("\n", " "))
    elif e.kind == "timeout":
        log.warning("request stopped: %s", e)
    elif e.kind == "internal":
        log.error("generation failed (ref %s): %s", ref_of(e), e)


def field_path(body: Any, loc: tuple[Any, ...]) -> str:
    """A pydantic error location as the field path in the body (`input[0].content[1]`):
    the parts pydantic adds that are not in the body (a union member's name, a tagged
    union's tag value, a validator's name) are left out, by walking the body itself; a
    mapping's keys (not field names) and a list's scalar items end the path at the mapping
    or the list."""
    out, at = "", body
    for n, p in enumerate(loc):
        if isinstance(p, int) and isinstance(at, list) and 0 <= p < len(at):
            if not isinstance(at[p], (dict, list)):
                break  # an item of a list of values (a token id): the list is at fault
            out, at = out + f"[{p}]", at[p]
        elif isinstance(p, str) and isinstance(at, dict) and p in at:
            if not p.isidentifier() or loc[n + 1:n + 2] == ("[key]",):
                break  # a key of a mapping field (a logit_bias token id): the field is at fault
            out, at = out + f".{p}", at[p]
        elif isinstance(p, str) and isinstance(at, dict) and p in (at.get("type"),
                                                                  at.get("role")):
            continue  # a tagged union's tag: the item's own type
        elif isinstance(p, str) and "[" not in p and isinstance(at, dict) and not any(
                isinstance(q, str) and q in at for q in loc[loc.index(p):]):
            out += f".{p}"  # a missing field: the walk ends here
            break
    return out.lstrip(".")


class RunResponse(StreamingResponse):
    """A run's SSE response: however it ends (the client gone before the first event, a
    send that fails), the request is stopped with it."""

    def __init__(self, run: Run, body: AsyncIterator[str], headers: dict[str, str]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self.run = run

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()


_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # in pairs, one character


def _lone_surrogate(body: Any) -> str | None:
    """The field path of the first string (or key) holding an unpaired surrogate (which no
    tokenizer or grammar takes), or None."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return at.lstrip(".")
        elif isinstance(v, dict):
            stack.extend((x, f"{at}.{k}") for k, x in v.items())
            stack.extend((k, at) for k in v)
        elif isinstance(v, list):
            stack.extend((x, f"{at}[{i}]") for i, x in enumerate(v))
    return None


def _depth(x: Any) -> int:
    """Nesting depth of a parsed JSON value (level by level: no recursion limit to hit; a
    long list of scalars costs one pass in C)."""
    depth, level = 0, [x] if type(x) in (dict, list) else []
    while level:
        depth += 1
        below: list[Any] = []
        for v in level:
            items = v.values() if type(v) is dict else v
            kinds = set(map(type, items))
            if dict in kinds or list in kinds:
                below.extend(c for c in items if type(c) in (dict, list))
        level = below
    return depth


def sse(event: str | None, data: Any) -> str:
    """One server-sent event (`event:` line when named): its data as JSON, or a text as it
    is (`[DONE]`)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def extension(run: Run, stats: GenerationStats, warnings: tuple[str, ...]) -> dict[str, Any]:
    """The `specdec` object of a response (every API): seed, speculative stats, the token
    budget's minimum (a constrained answer's, where the budget rule is on), what the
    constraint did not enforce."""
    c = stats.counters
    closing = getattr(run.request, "closing", None)
    return {"seed": run.request.sampling.seed, "k": stats.k, "steps": c.steps,
            "rounds": c.rounds, "proposed": c.proposed, "accepted": c.accepted,
            "acceptance_rate": round(c.acceptance_rate, 4),
            **c.source_counts(),  # by source and on branches: `forced`, `forced_accepted`, ...
            "grammar_cuts": c.grammar_cuts, "budget_steered": c.budget_steered,
            "mask_s": round(c.mask_s, 6), "prefill_s": round(c.prefill_s, 6),
            "first_round_s": round(c.first_round_s, 6),
            "prepare_s": round(getattr(run, "prepare_s", 0.0), 6),
            "compile_s": round(getattr(run.request, "compile_s", 0.0), 6),
            "decode_s": round(stats.decode_s, 6), "tokens_per_s": round(stats.tokens_per_s, 3),
            "seconds": round(stats.seconds, 6), "warnings": list(warnings),
            **({"budget_minimum": closing.minimum} if closing is not None else {}),
            **({UNGUARANTEED: run.request.unguaranteed} if run.request.unguaranteed else {}),
            **({"spec_off": c.spec_off} if getattr(c, "spec_off", "") else {})}


def request_headers(request: Request) -> dict[str, str]:
    """The response headers every API adds for a request: `Warning` (what the constraint
    does not enforce) and, where the budget rule is off, `specdec-budget-unguaranteed`
    naming why."""
    out = warning_header(request.warnings)
    if request.unguaranteed:
        out["specdec-budget-unguaranteed"] = header_text(request.unguaranteed, 500)
    return out


def header_text(text: str, limit: int) -> str:
    """`text` for a header value: JSON string escapes keep it printable ASCII (no newline,
    no non-Latin-1 character, quotes escaped), at most `limit` characters and an ellipsis
    (never half an escape)."""
    out = json.dumps(text)[1:-1]
    return out if len(out) <= limit else out[:limit].rstrip("\\") + "..."


def warning_header(warnings: tuple[str, ...], limit: int = 2000) -> dict[str, str]:
    """An RFC 9111 `Warning` header from warning texts that may hold user text (a schema's
    format name), bounded in length (`header_text`); the full texts are in the body."""
    if not warnings:
        return {}
    return {"Warning": f'199 specdec "{header_text("; ".join(warnings), limit)}"'}


def rest_sources(run: Run, ev: Finished, carried: int) -> dict[str, Any]:
    """The closing event's `token_sources`: those of the output tokens no delta carried
    (`carried` did: markup closing a think block or a call at the very end has no text of
    its own), where asked for and any are left; else nothing."""
    srcs = token_sources(run, ev.tokens[carried:], ev.sources[carried:], ev.logprobs[carried:])
    return {"token_sources": srcs} if srcs else {}


def token_sources(run: Run, tokens: Sequence[TokenId], sources: Sequence[TokenSource],
                  logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]] | None:
    """The `token_sources` extension (every API) of some output tokens, where the request
    asked for it (else None): each token's id, text, source, allowed-set size, logprob and
    top alternatives (`events.TokenSource`, `events.TokenLogprob`)."""
    n = getattr(run.request, "token_sources", None)
    if n is None:
        return None
    tokenizer = run.engine.target.tokenizer
    compiler = getattr(run.engine, "compiler", None)  # (a stand-in engine has none)
    raw = compiler.tokenizer.decode_bytes if compiler is not None else None

    def token(t: int) -> dict[str, Any]:
        """A token's id, text and bytes (a byte-fallback token's text is U+FFFD, its
        bytes are the byte it stands for)."""
        text = str(tokenizer.decode([t], skip_special_tokens=False))
        return {"id": t, "text": text,
                "bytes": list(raw([t]) if raw is not None else text.encode())}

    out = []
    for i, t in enumerate(tokens):
        src = sources[i] if i < len(sources) else None
        lp = logprobs[i] if i < len(logprobs) else None
        out.append({**token(t), "source": src.source if src else None,
                    "allowed": src.allowed if src else None,
                    "logprob": lp.logprob if lp else None,
                    "top": [{**token(a), "logprob": b} for a, b in lp.top[:n]] if lp else []})
    return out
