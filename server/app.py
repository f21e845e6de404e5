"""FastAPI app: OpenAI-compatible endpoints adapting HTTP to `specdec`.

Handlers parse and validate (400s in OpenAI's error shape), render and compile off the
event loop with a time limit, then hand the request to the one engine thread and relay its
events as a JSON body or an SSE stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.chat import ChatTemplateError, ReasoningConflictError, ThinkingUnsupportedError
from specdec.decode import GrammarStateError
from specdec.engine import (DEFAULT_MAX_TOKENS, CompileTimeout, Engine,
                            Request as EngineRequest, RequestError)
from specdec.grammar import GrammarError
from specdec.reasoning import ReasoningDeltas, Thinking, split_reasoning
from specdec.speculative import DraftConfigError

from .errors import APIError, bad_request
from .metrics import Metrics
from .openapi import (CHAT_RESPONSES, COMPLETION_RESPONSES, Health, ModelList,
                      error_responses, openapi)
from .protocol import Common, parse_chat, parse_completion
from .worker import EngineWorker, Job
from specdec.scheduler import DeadlineExceeded, QueueFull, SchedulerStopped

log = logging.getLogger("specdec.server")
MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_JSON_DEPTH = 128  # nesting levels of a request body
COMPILE_TIMEOUT_S = 10.0
MAX_BATCH = 8    # requests decoded together: a forward over 8 rows costs ~1.3x one row here
MAX_QUEUE = 64   # requests waiting for a slot before new ones get 503 + Retry-After
# A thinking request's budget when it gives none: half its max_tokens (room for the answer),
# at most this.
MAX_THINKING_TOKENS = 1024
RETRY_AFTER_S = 1
REQUEST_TIMEOUT_S = 600.0  # a request's time limit from arrival, waiting included


def create_app(engine: Engine, *, api_key: str | None = None,
               chat_template: str | None = None,
               compile_timeout_s: float = COMPILE_TIMEOUT_S,
               max_batch: int = MAX_BATCH, max_queue: int = MAX_QUEUE,
               request_timeout_s: float | None = REQUEST_TIMEOUT_S,
               max_thinking_tokens: int = MAX_THINKING_TOKENS, channel: Any = None
               ) -> FastAPI:
    """The ASGI app serving `engine`: one scheduler thread decoding up to `max_batch`
    requests together, `max_queue` more waiting (then 503); compiles in a small pool."""
    app = FastAPI(title="specdec")
    app.openapi = lambda: openapi(app, engine.target.vocab_size)  # type: ignore[method-assign]

    def lost(e: Exception) -> None:
        """A sharded target lost a rank: the requests have failed; exit non-zero once their
        error responses are out (a follower exits too; the launcher reports it)."""
        import os

        from specdec.distributed import EXIT_LOST_RANK

        log.error("the sharded target lost a rank (%s): exiting", e)
        threading.Timer(2.0, os._exit, (EXIT_LOST_RANK,)).start()

    worker = EngineWorker(engine, max_batch=max_batch, max_queue=max_queue,
                          request_timeout_s=request_timeout_s, channel=channel,
                          on_fatal=lost)
    metrics = Metrics()
    compile_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="specdec-compile")
    model_name = engine.target.name
    app.state.worker, app.state.metrics = worker, metrics

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        metrics.add(request_errors_total=1)
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        metrics.add(request_errors_total=1)
        return bad_request(f"invalid request: {e.errors()}").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return APIError(e.status_code, str(e.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("internal error")
        metrics.add(request_errors_total=1)
        return APIError(500, f"internal error: {e}", type="server_error").response()

    app.add_middleware(Guard, api_key=api_key)

    async def read_body(request: Request) -> Any:
        # Read with a running limit: a chunked body (no Content-Length) is cut off at the
        # limit, not read whole first.
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise APIError(413, f"request body over {MAX_BODY_BYTES} bytes",
                               code="request_too_large")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except RecursionError as e:
            raise bad_request("request body is nested too deeply") from e
        except ValueError as e:  # invalid JSON, bad UTF-8, integers over Python's digit limit
            raise bad_request(f"request body is not valid JSON: {e}") from e
        if _depth(body) > MAX_JSON_DEPTH:
            raise bad_request(f"request body is nested more than {MAX_JSON_DEPTH} levels deep")
        return body

    def check_model(common: Common) -> None:
        if common.model not in (None, model_name, "default"):
            raise APIError(404, f"model {common.model!r} does not exist; this server serves "
                                f"{model_name!r}", type="not_found_error",
                           code="model_not_found", param="model")

    async def prepare(common: Common, to_ids: Any) -> tuple[EngineRequest, tuple[str, ...]]:
        """Tokenize, validate and compile through the engine (its compile time limit), off
        the event loop: a slow schema is a 400 while other requests keep decoding (its
        compile finishes in the background and is cached)."""
        def validate() -> EngineRequest:
            got = to_ids()
            ids, thinking = got if isinstance(got, tuple) else (got, None)
            max_tokens = common.max_tokens
            if max_tokens is None:
                max_tokens = max(1, min(DEFAULT_MAX_TOKENS, engine.context_length - len(ids)))
            if thinking is not None and thinking.budget is None:
                thinking = dataclasses.replace(
                    thinking, budget=min(max_thinking_tokens, max_tokens // 2))
            spec = common.spec
            if isinstance(spec, dict):
                spec = dataclasses.replace(engine.default_spec, **spec)
            return engine.prepare(ids, constraint=common.constraint, sampling=common.sampling,
                                  max_tokens=max_tokens, stop=common.stop,
                                  spec=spec,  # type: ignore[arg-type]
                                  compile_timeout_s=compile_timeout_s,
                                  logprobs=common.logprobs, thinking=thinking)

        loop = asyncio.get_running_loop()
        try:
            req = await loop.run_in_executor(compile_pool, validate)
            return req, req.grammar.warnings if req.grammar else ()
        except CompileTimeout as e:
            raise bad_request(str(e), "response_format", "compile_timeout") from e
        except GrammarError as e:
            raise bad_request(str(e), "response_format", "invalid_grammar") from e
        except ReasoningConflictError as e:
            raise bad_request(str(e), "messages", "reasoning_conflict") from e
        except ThinkingUnsupportedError as e:
            raise bad_request(str(e), "reasoning_effort", "thinking_unsupported") from e
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from e
        except DraftConfigError as e:
            raise bad_request(str(e), "num_draft_tokens") from e
        except RequestError as e:
            param = next((p for p in ("max_tokens", "logit_bias") if p in str(e)), "messages")
            raise bad_request(str(e), param,
                              "context_length_exceeded" if "context" in str(e) else None) from e

    async def run(request: Request, common: Common, to_ids: Any, kind: str) -> Any:
        req, warnings = await prepare(common, to_ids)
        metrics.add(requests_total=1, requests_constrained_total=int(req.constraint is not None))
        job = Job(req, loop=asyncio.get_running_loop())
        try:
            worker.submit(job)
        except SchedulerStopped as e:
            raise APIError(503, str(e), type="server_error", code="unavailable") from e
        except QueueFull as e:
            metrics.add(requests_rejected_total=1)
            raise APIError(503, f"the server is at capacity: {e}; retry after "
                                f"{RETRY_AFTER_S}s", type="server_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        headers = {"Warning": _warning_header(warnings)} if warnings else {}
        if common.stream:
            return StreamingResponse(_sse(job, common, rid, model_name, kind, metrics, warnings,
                                          engine.target.tokenizer, engine),
                                     media_type="text/event-stream", headers=headers)
        return await _complete(job, rid, model_name, kind, request, metrics, warnings, headers,
                               tools=bool(common.tools), tokenizer=engine.target.tokenizer,
                               engine=engine)

    @app.get("/health", response_model=Health)
    async def health() -> Any:
        if worker.scheduler.fatal is not None:  # not ready: a balancer sends no more here
            return JSONResponse({"status": "stopping", "model": model_name,
                                 "queue_depth": worker.queue_depth}, status_code=503)
        return {"status": "ok", "model": model_name, "queue_depth": worker.queue_depth}

    @app.get("/metrics", response_class=PlainTextResponse, responses=error_responses(401))
    async def prom() -> PlainTextResponse:
        ch = worker.channel
        return PlainTextResponse(metrics.render(worker.queue_depth, worker.scheduler.stats,
                                                worker.scheduler.active,
                                                ch.collective_s if ch is not None else None),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", response_model=ModelList, responses=error_responses(401))
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "specdec"}]}

    @app.post("/v1/chat/completions", response_model=None, responses=CHAT_RESPONSES)
    async def chat(request: Request) -> Any:
        body = parse_chat(await read_body(request))
        check_model(body.common)
        kwargs = body.template_kwargs
        if body.common.tools:  # the template shows the model its tools, where it can
            kwargs = {**kwargs, "tools": list(body.common.tools)}
        if body.thinking:
            return await run(request, body.common, lambda: engine.chat_prompt_thinking(
                body.messages, template=chat_template, template_kwargs=kwargs,
                budget=body.max_thinking_tokens), "chat")
        return await run(request, body.common, lambda: engine.chat_prompt(
            body.messages, constrained=body.common.constraint is not None,
            template=chat_template, template_kwargs=kwargs), "chat")

    @app.post("/v1/completions", response_model=None, responses=COMPLETION_RESPONSES)
    async def completions(request: Request) -> Any:
        body = parse_completion(await read_body(request))
        check_model(body.common)
        prompt = body.prompt
        return await run(request, body.common, lambda: (
            engine.encode(prompt, raw=True) if isinstance(prompt, str) else list(prompt)), "text")

    @app.on_event("shutdown")
    def _stop() -> None:
        worker.stop()
        compile_pool.shutdown(wait=False, cancel_futures=True)

    return app


def _warning_header(warnings: tuple[str, ...], limit: int = 2000) -> str:
    """An RFC 9111 Warning value from warning texts that may hold user text (a schema's
    format name): JSON string escapes keep it printable ASCII (no newline, no non-Latin-1
    character, quotes escaped), bounded in length; the full texts are in the body."""
    text = json.dumps("; ".join(warnings))[1:-1]
    if len(text) > limit:
        text = text[:limit].rstrip("\\") + "..."
    return f'199 specdec "{text}"'


def _depth(x: Any) -> int:
    """Nesting depth of a parsed JSON value (iterative: no recursion limit to hit)."""
    deepest, stack = 0, [(x, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _protected(path: str) -> bool:
    """Paths behind the API key: the API, metrics and the API's documentation (`/health`
    stays open for load balancers)."""
    return path.startswith(("/v1/", "/docs", "/redoc")) or path in ("/metrics",
                                                                    "/openapi.json")


class Guard:
    """API key and body-size checks, as plain ASGI middleware: unlike an `@app.middleware`
    function (BaseHTTPMiddleware) it leaves the receive channel alone, so handlers see a
    client's disconnect (`Request.is_disconnected`) while tokens are still flowing."""

    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                       for k, v in scope.get("headers", [])}
            error = None
            given = headers.get("authorization", "").encode("latin-1")
            if self.api_key and _protected(scope["path"]) and not hmac.compare_digest(
                    given, f"Bearer {self.api_key}".encode()):
                error = APIError(401, "missing or invalid API key",
                                 type="authentication_error", code="invalid_api_key")
            size = headers.get("content-length", "")
            if error is None and size.isdigit() and int(size) > MAX_BODY_BYTES:
                error = APIError(413, f"request body over {MAX_BODY_BYTES} bytes",
                                 code="request_too_large")
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _usage(job: Job, completion_tokens: int, reasoning_tokens: int | None = None
           ) -> dict[str, Any]:
    p = len(job.request.prompt_ids)
    usage: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": completion_tokens,
                             "total_tokens": p + completion_tokens}
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def _extension(job: Job, stats: Any, seconds: float, warnings: tuple[str, ...]
               ) -> dict[str, Any]:
    """The `specdec` object of a response: seed, speculative stats, what was not enforced."""
    return {"seed": job.request.sampling.seed, "k": job.request.spec.k if job.request.spec else 0,
            "steps": stats.steps, "rounds": stats.rounds, "proposed": stats.proposed,
            "accepted": stats.accepted, "acceptance_rate": round(stats.acceptance_rate, 4),
            "forced": stats.forced, "looked_up": stats.looked_up, "drafted": stats.drafted,
            "drafted_accepted": stats.drafted_accepted, "grammar_cuts": stats.grammar_cuts,
            "mask_s": round(stats.mask_s, 6), "prefill_s": round(stats.prefill_s, 6),
            "seconds": round(seconds, 6), "warnings": list(warnings),
            **({"spec_off": stats.spec_off} if getattr(stats, "spec_off", "") else {})}


def _error_of(e: Exception) -> APIError:
    if isinstance(e, DeadlineExceeded):
        return APIError(504, f"{e}; it was stopped", type="server_error", code="timeout")
    if isinstance(e, SchedulerStopped):
        return APIError(503, str(e), type="server_error", code="unavailable")
    if isinstance(e, GrammarStateError):
        return APIError(500, f"internal error: {e}; no output past that point was emitted",
                        type="server_error", code="grammar_state")
    return APIError(500, f"generation failed: {e}", type="server_error")


def _logprobs_of(kind: str, lps: list[Any], tokenizer: Any) -> dict[str, Any]:
    """OpenAI's `logprobs` object for tokens' `core.TokenLogprob`s: chat's `content` list
    (token text, logprob, UTF-8 bytes, top_logprobs), or completions' parallel lists."""
    def text(t: int) -> str:
        return str(tokenizer.decode([t], skip_special_tokens=False))

    if kind == "chat":
        return {"content": [
            {"token": text(e.token), "logprob": e.logprob,
             "bytes": list(text(e.token).encode()),
             "top_logprobs": [{"token": text(a), "logprob": b, "bytes": list(text(a).encode())}
                              for a, b in e.top]} for e in lps]}
    tokens = [text(e.token) for e in lps]
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in lps],
            "top_logprobs": [{text(a): b for a, b in e.top} for e in lps],
            "text_offset": offsets}


def _tool_call(text: str, finish: str | None) -> dict[str, Any] | None:
    """The OpenAI tool call in a tool-mode output (the grammar's {"name", "arguments"}), or
    None when generation stopped before the call was complete."""
    if finish != "stop":
        return None
    try:
        call = json.loads(text)
        name, args = call["name"], call["arguments"]
    except (ValueError, KeyError, TypeError):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _choice(kind: str, text: str, finish: str | None, tools: bool = False,
            thinking: Thinking | None = None) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if thinking is not None:  # the think block apart; None: the answer never began
        reasoning, answer = split_reasoning(text, thinking)
        extra, text = {"reasoning_content": reasoning}, answer  # type: ignore[assignment]
    call = _tool_call(text, finish) if tools and text is not None else None
    if call is not None:
        return {"index": 0, "finish_reason": "tool_calls", "logprobs": None,
                "message": {"role": "assistant", "content": None, "tool_calls": [call],
                            **extra}}
    if kind == "chat":
        return {"index": 0, "finish_reason": finish, "logprobs": None,
                "message": {"role": "assistant", "content": text, **extra}}
    return {"index": 0, "finish_reason": finish, "logprobs": None, "text": text}


async def _complete(job: Job, rid: str, model: str, kind: str, http: Request,
                    metrics: Metrics, warnings: tuple[str, ...], headers: dict[str, str],
                    tools: bool = False, tokenizer: Any = None, engine: Any = None
                    ) -> JSONResponse:
    n = 0
    ids: list[int] = []
    lps: list[Any] = []
    checked = time.monotonic()
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                event = None
            # Noticed while tokens are still flowing, not only when they stop.
            if time.monotonic() - checked >= 0.5:
                checked = time.monotonic()
                if await http.is_disconnected():
                    # Nobody to answer: the finally below stops the request; 499 (client
                    # closed the request) goes nowhere, and no error is logged for it.
                    return JSONResponse({"error": None}, status_code=499)
            if event is None:
                continue
            if event[0] == "token":
                n += 1
                ids.append(event[1])
                lps.extend(event[3])
            elif event[0] == "error":
                raise _error_of(event[1])
            else:
                _, finish, text, stats, seconds = event
                break
    finally:
        job.cancelled.set()  # a no-op when done; stops the engine when the client left
    metrics.observe(len(job.request.prompt_ids), n, stats, seconds)
    thinking = job.request.thinking
    choice = _choice(kind, text, finish, tools, thinking)
    reasoning = engine.reasoning_tokens(ids, thinking) if thinking is not None else None
    if job.request.logprobs is not None:
        choice["logprobs"] = _logprobs_of(kind, lps, tokenizer)
    return JSONResponse({
        "id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(time.time()), "model": model,
        "choices": [choice], "usage": _usage(job, n, reasoning),
        "specdec": _extension(job, stats, seconds, warnings)}, headers=headers)


async def _sse(job: Job, common: Common, rid: str, model: str, kind: str, metrics: Metrics,
               warnings: tuple[str, ...], tokenizer: Any = None, engine: Any = None
               ) -> AsyncIterator[str]:
    created = int(time.time())
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    pending: list[Any] = []  # logprobs of tokens not yet sent with a chunk

    thinking = job.request.thinking
    split = ReasoningDeltas(thinking) if thinking is not None else None

    def chunk(content: str | None, finish: str | None, first: bool = False,
              reasoning: str | None = None) -> str:
        lp = None
        if common.logprobs is not None and (pending or content or reasoning):
            lp = _logprobs_of(kind, pending, tokenizer)
            pending.clear()
        if kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else (
                {} if content is None else {"content": content})
            if reasoning:
                delta["reasoning_content"] = reasoning
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish,
                                      "logprobs": lp}
        else:
            choice = {"index": 0, "text": content or "", "finish_reason": finish,
                      "logprobs": lp}
        body = {"id": rid, "object": obj, "created": created, "model": model,
                "choices": [choice]}
        return f"data: {json.dumps(body)}\n\n"

    n, sent = 0, ""
    ids: list[int] = []

    def deltas(text: str, final: bool = False) -> list[str]:
        """The chunks for a text delta: split into reasoning and answer when thinking."""
        if split is None:
            return [chunk(text, None)] if text else []
        r, a = split.feed(text, final)
        return [chunk(a or None, None, reasoning=r)] if r or a else []

    try:

        if kind == "chat":
            yield chunk(None, None, first=True)
        while True:
            event = await job.events.get()
            if event[0] == "token":
                n += 1
                ids.append(event[1])
                pending.extend(event[3])
                if event[2] and not common.tools:  # a tool call is sent whole, at the end
                    sent += event[2]
                    for c in deltas(event[2]):
                        yield c
            elif event[0] == "error":
                yield f"data: {json.dumps(_error_of(event[1]).body())}\n\n"
                break
            else:
                _, finish, text, stats, seconds = event
                answer = text if thinking is None else split_reasoning(text, thinking)[1]
                call = (_tool_call(answer, finish) if common.tools and answer is not None
                        else None)
                if call is not None:
                    if split is not None:  # the thinking before the call (held back)
                        for c in deltas(text[:len(text) - len(answer or "")], final=True):
                            yield c
                    body = {"id": rid, "object": obj, "created": created, "model": model,
                            "choices": [{"index": 0, "finish_reason": None, "logprobs": None,
                                         "delta": {"tool_calls": [{"index": 0, **call}]}}]}
                    yield f"data: {json.dumps(body)}\n\n"
                    finish = "tool_calls"
                elif len(text) > len(sent) or split is not None:  # tail held back (stop
                    for c in deltas(text[len(sent):], final=True):  # strings, partial UTF-8,
                        yield c  # a possible marker)
                yield chunk(None, finish)
                metrics.observe(len(job.request.prompt_ids), n, stats, seconds)
                if common.include_usage:
                    body = {"id": rid, "object": obj, "created": created, "model": model,
                            "choices": [], "usage": _usage(
                                job, n, engine.reasoning_tokens(ids, thinking)
                                if thinking is not None else None),
                            "specdec": _extension(job, stats, seconds, warnings)}
                    yield f"data: {json.dumps(body)}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()  # client gone mid-stream: the engine stops within one round


ROUND_LIMIT_S = 300.0  # a sharded target's round that runs longer has lost a rank
STOPPING_ROUND_LIMIT_S = 5.0  # ... once asked to stop (mlx.launch stops the others so)


def _watchdog(server: Any, sched: Any) -> None:
    """A sharded target: a collective whose peer died may never return. A round that runs
    past the limit (much shorter once the server was asked to stop: mlx.launch stops the
    other ranks when one fails) fails every request with a 503, and the server exits."""
    from specdec.scheduler import SchedulerStopped

    while sched.fatal is None:
        time.sleep(0.5)
        started = sched.round_started
        limit = STOPPING_ROUND_LIMIT_S if server.should_exit else ROUND_LIMIT_S
        if started is not None and time.perf_counter() - started > limit:
            log.error("a round has run for over %.0fs: a rank is lost", limit)
            sched.abort(SchedulerStopped("the sharded target failed (a rank stopped "
                                         "responding); this server is stopping"))
            return


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, chat_template: str | None = None,
          compile_timeout_s: float = COMPILE_TIMEOUT_S, max_batch: int = MAX_BATCH,
          max_queue: int = MAX_QUEUE, request_timeout_s: float | None = REQUEST_TIMEOUT_S,
          max_thinking_tokens: int = MAX_THINKING_TOKENS, channel: Any = None) -> None:
    """Serve an engine until interrupted."""
    import uvicorn

    from specdec import blas

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    app = create_app(engine, api_key=api_key, chat_template=chat_template,
                     compile_timeout_s=compile_timeout_s, max_batch=max_batch,
                     max_queue=max_queue, request_timeout_s=request_timeout_s,
                     max_thinking_tokens=max_thinking_tokens, channel=channel)
    draft = ("none" + (" (jump-forward on constrained requests)" if engine.jump_forward else "")
             if engine.draft is None else
             "self" if engine.draft is engine.target else engine.draft.name)
    log.info("serving %s at http://%s:%d/v1 (draft: %s, k=%d, max batch %d, BLAS: %s)",
             engine.target.name, host, port, draft, engine.default_spec.k, max_batch,
             blas.active())
    import os

    if channel is not None:
        log.info("target sharded over %d ranks (mlx.launch); this is rank 0 (pid %d)",
                 channel.group.size(), os.getpid())
    # SIGTERM/SIGINT: stop accepting, let in-flight requests finish (at most 30 s), then stop
    # the scheduler (a sharded target's other ranks stop with it) and exit 0. (uvicorn
    # re-raises the signal after its shutdown, to the handler it found: this one.)
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                           timeout_graceful_shutdown=30))
    if channel is not None:
        threading.Thread(target=_watchdog, args=(server, app.state.worker.scheduler),
                         name="specdec-watchdog", daemon=True).start()
    try:
        server.run()
    finally:
        app.state.worker.scheduler.stop(wait_s=10)
