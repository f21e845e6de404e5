"""What every API module shares: the server's settings, reading and parsing a body (and the
wire's number types), and running a `specdec.request.GenerateRequest` through the engine as
an event stream.

An API module (`chat`, `responses`, `messages`) parses its wire body with its pydantic models
(`Door.parse`), builds the neutral request, calls `Door.open` and turns the events of the
returned `Run` into its wire response. Errors are `SpecdecError`s; the app answers each in
the shape of the API whose path it hit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from pydantic import AllowInfNan, BaseModel, BeforeValidator, Strict, ValidationError

from specdec.decode import GrammarStateError
from specdec.engine import Engine, Request
from specdec.errors import SpecdecError
from specdec.events import Event, Failed, Finished, GenerationStats, RequestStream
from specdec.request import GenerateRequest, SpecOverrides

from .errors import WireError, bad_request, ref_of
from .metrics import Metrics

M = TypeVar("M", bound=BaseModel)
log = logging.getLogger("specdec.server")


# -- the wire's numbers (every API's models use these) -----------------------------------------
def integral(v: Any) -> Any:
    """JSON Schema's integer includes 3.0 (generators and some clients write it so)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


# No "1" for 1, no true for 1, no NaN or infinity (1e400 parses as inf), 3.0 for 3.
Int = Annotated[int, BeforeValidator(integral), Strict()]
Float = Annotated[float, Strict(), AllowInfNan(False)]


@dataclass(frozen=True)
class ServeConfig:
    """The server's settings (`specdec serve` flags).

    Attributes:
        host, port: where to listen. api_key: required of clients when set (Bearer or
            `x-api-key`). max_batch, max_queue, request_timeout_s: the scheduler's
            (`Engine.start`). max_body_bytes, max_json_depth: a body's limits.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_batch: int = 8
    max_queue: int = 64
    request_timeout_s: float | None = 600.0
    max_body_bytes: int = 8 * 1024 * 1024
    max_json_depth: int = 128
    channel: Any = field(default=None, compare=False)  # a sharded target's broadcast


class Door:
    """The engine as the API modules see it."""

    def __init__(self, engine: Engine, config: ServeConfig, metrics: Metrics) -> None:
        self.engine, self.config, self.metrics = engine, config, metrics
        self.model_name = engine.target.name
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="specdec-prepare")

    def check_model(self, model: str | None, param: str = "model") -> None:
        if model not in (None, self.model_name, "default"):
            raise WireError(404, f"model {model!r} does not exist; this server serves "
                                 f"{self.model_name!r}", param=param, code="model_not_found")

    async def read_json(self, request: HTTPRequest) -> Any:
        """The body as JSON, read with a running size limit (a chunked body is cut off at
        the limit, not read whole first) and a nesting limit."""
        limit, chunks, size = self.config.max_body_bytes, [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise WireError(413, f"request body over {limit} bytes",
                                code="request_too_large")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except RecursionError as e:
            raise bad_request("request body is nested too deeply") from e
        except ValueError as e:  # invalid JSON, bad UTF-8, integers over Python's digit limit
            raise bad_request(f"request body is not valid JSON: {e}") from e
        if _depth(body) > self.config.max_json_depth:
            raise bad_request(f"request body is nested more than "
                              f"{self.config.max_json_depth} levels deep")
        return body

    async def parse(self, request: HTTPRequest, model: type[M]) -> M:
        """Read and validate a body with the API's pydantic model (the only parser).

        Raises:
            WireError: 400 naming the first offending field (`a.b[0].c`).
        """
        body = await self.read_json(request)
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        try:
            return model.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            path = field_path(body, err["loc"])
            if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
                path += "." + str((err.get("ctx") or {}).get("discriminator", "")).strip("'")
            raise bad_request(f"{path}: {err['msg']}" if path else err["msg"],
                              path or None) from None

    async def open(self, greq: GenerateRequest, http: HTTPRequest) -> "Run":
        """Prepare (render, validate, compile: off the event loop, within the compile time
        limit) and submit a request.

        Raises:
            SpecdecError: the request is invalid (400s), or the server is full (503).
        """
        loop = asyncio.get_running_loop()
        req = await loop.run_in_executor(self.pool, self.engine.prepare, greq)
        self.metrics.add(requests_total=1,
                         requests_constrained_total=int(req.constraint is not None))
        try:
            stream = self.engine.submit(req, RequestStream().bind(loop))
        except SpecdecError as e:
            if e.code == "queue_full":
                self.metrics.add(requests_rejected_total=1)
            raise
        return Run(self, req, stream, http)

    def close(self) -> None:
        self.engine.close()
        self.pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class Run:
    """A submitted request: its prepared form and its events."""

    door: Door
    request: Request
    stream: RequestStream
    http: HTTPRequest
    created: int = field(default_factory=lambda: int(time.time()))
    left: bool = False  # the client went away before the end

    async def events(self) -> AsyncIterator[Event]:
        """The request's events. A client that goes away is noticed within ~0.5 s, while
        tokens still flow; the request is then stopped within a round and `left` set."""
        checked = time.monotonic()
        try:
            while True:
                ev = await self.stream.next(timeout=0.5)
                if time.monotonic() - checked >= 0.5:
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
                                              ev.stats.seconds)
                yield ev
                if isinstance(ev, (Finished, Failed)):
                    return
        finally:
            self.stream.cancel()  # a no-op when done; stops the engine when the client left


LOG_LIMIT = 4096  # characters of a request's constraint and grammar in a failure's log line


def log_failure(req: Request, e: SpecdecError) -> None:
    """The server log's account of a failed request: an internal fault with what locates
    it (position, constraint, grammar; bounded) and the reference its client was given, a
    stopped request as a warning."""
    if isinstance(e, GrammarStateError):
        g = req.grammar
        log.error("grammar state error at output token %s (ref %s): %s\nconstraint: %.*s\n"
                  "grammar: %.*s", e.position, ref_of(e), e.detail or e, LOG_LIMIT,
                  req.constraint, LOG_LIMIT, g.text if g else None)
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
            self.run.stream.cancel()


def _depth(x: Any) -> int:
    """Nesting depth of a parsed JSON value (iterative: no recursion limit to hit)."""
    deepest, stack = 0, [(x, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def sse(event: str | None, data: Any) -> str:
    """One server-sent event (`event:` line when named)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n"


def spec_overrides(k: int | None, masking: bool | None, lookup: bool | None
                   ) -> SpecOverrides:
    """Our speculative extensions (`num_draft_tokens`, `draft_masking`, `prompt_lookup`) as
    the request's overrides: "default" (none given), None (plain: k = 0) or fields."""
    if k is None and masking is None and lookup is None:
        return "default"
    if k == 0:
        return None
    fields = {"k": k, "draft_masking": masking, "lookup": lookup}
    return {name: v for name, v in fields.items() if v is not None}


def extension(run: Run, stats: GenerationStats, warnings: tuple[str, ...]) -> dict[str, Any]:
    """The `specdec` object of a response (every API): seed, speculative stats, what the
    constraint did not enforce."""
    c = stats.counters
    return {"seed": run.request.sampling.seed, "k": stats.k, "steps": c.steps,
            "rounds": c.rounds, "proposed": c.proposed, "accepted": c.accepted,
            "acceptance_rate": round(c.acceptance_rate, 4), "forced": c.forced,
            "looked_up": c.looked_up, "drafted": c.drafted,
            "drafted_accepted": c.drafted_accepted, "grammar_cuts": c.grammar_cuts,
            "mask_s": round(c.mask_s, 6), "prefill_s": round(c.prefill_s, 6),
            "seconds": round(stats.seconds, 6), "warnings": list(warnings),
            **({"spec_off": c.spec_off} if getattr(c, "spec_off", "") else {})}


def warning_header(warnings: tuple[str, ...], limit: int = 2000) -> dict[str, str]:
    """An RFC 9111 `Warning` header from warning texts that may hold user text (a schema's
    format name): JSON string escapes keep it printable ASCII (no newline, no non-Latin-1
    character, quotes escaped), bounded in length; the full texts are in the body."""
    if not warnings:
        return {}
    text = json.dumps("; ".join(warnings))[1:-1]
    if len(text) > limit:
        text = text[:limit].rstrip("\\") + "..."
    return {"Warning": f'199 specdec "{text}"'}
