"""FastAPI app: OpenAI-compatible endpoints adapting HTTP to `specdec`."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.chat import ChatTemplateError
from specdec.decode import GrammarStateError
from specdec.engine import DEFAULT_MAX_TOKENS, Engine, RequestError

from .errors import APIError, bad_request
from .protocol import ChatRequest, parse_chat
from .worker import EngineWorker, Job

log = logging.getLogger("specdec.server")
MAX_BODY_BYTES = 8 * 1024 * 1024


def create_app(engine: Engine, *, api_key: str | None = None,
               chat_template: str | None = None) -> FastAPI:
    app = FastAPI(title="specdec")
    worker = EngineWorker(engine)
    model_name = engine.target.name
    app.state.worker = worker

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        return bad_request(f"invalid request: {e.errors()}").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return APIError(e.status_code, str(e.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("internal error")
        return APIError(500, f"internal error: {e}", type="server_error").response()

    @app.middleware("http")
    async def _guard(request: Request, call_next: Any) -> Any:
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return APIError(401, "missing or invalid API key",
                                type="authentication_error", code="invalid_api_key").response()
        size = request.headers.get("content-length")
        if size and size.isdigit() and int(size) > MAX_BODY_BYTES:
            return APIError(413, f"request body over {MAX_BODY_BYTES} bytes").response()
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name, "queue_depth": worker.queue_depth}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "specdec"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"request body is not valid JSON: {e}") from e
        req = parse_chat(body)
        if req.model not in (None, model_name, "default"):
            raise APIError(404, f"model {req.model!r} does not exist; this server serves "
                                f"{model_name!r}", type="not_found_error",
                           code="model_not_found", param="model")
        job = Job(_prepare(engine, req, chat_template), loop=_loop())
        worker.submit(job)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return StreamingResponse(_sse(job, req, rid, model_name, request),
                                     media_type="text/event-stream")
        return await _complete(job, rid, model_name, request)

    return app


def _loop() -> Any:
    import asyncio

    return asyncio.get_running_loop()


def _prepare(engine: Engine, req: ChatRequest, chat_template: str | None) -> Any:
    from specdec.grammar import GrammarError

    try:
        ids = engine.chat_prompt(req.messages, constrained=req.constraint is not None,
                                 template=chat_template, template_kwargs=req.template_kwargs)
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, min(DEFAULT_MAX_TOKENS, engine.context_length - len(ids)))
        return engine.prepare(ids, constraint=req.constraint, sampling=req.sampling,
                              max_tokens=max_tokens, stop=req.stop)
    except GrammarError as e:
        raise bad_request(str(e), "response_format", "invalid_grammar") from e
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from e
    except RequestError as e:
        raise bad_request(str(e), "max_tokens" if "max_tokens" in str(e) else "messages") from e


def _usage(job: Job, completion_tokens: int, timings: Any, seconds: float) -> dict[str, Any]:
    p = len(job.request.prompt_ids)
    return {"prompt_tokens": p, "completion_tokens": completion_tokens,
            "total_tokens": p + completion_tokens}


def _error_of(e: Exception) -> APIError:
    if isinstance(e, GrammarStateError):
        return APIError(500, str(e), type="server_error", code="grammar_state")
    return APIError(500, f"generation failed: {e}", type="server_error")


async def _complete(job: Job, rid: str, model: str, http: Request) -> JSONResponse:
    n = 0
    while True:
        kind, *payload = await job.events.get()
        if kind == "token":
            n += 1
        elif kind == "error":
            raise _error_of(payload[0])
        else:
            finish, text, timings, seconds = payload
            break
    usage = _usage(job, n, timings, seconds)
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "finish_reason": finish, "logprobs": None,
                     "message": {"role": "assistant", "content": text}}],
        "usage": usage,
        "specdec": {"seed": job.request.sampling.seed, "steps": timings.steps,
                    "k": job.request.spec.k if job.request.spec else 0,
                    "rounds": timings.rounds, "proposed": timings.proposed,
                    "accepted": timings.accepted, "forced": timings.forced,
                    "grammar_cuts": timings.grammar_cuts, "mask_s": timings.mask_s,
                    "prefill_s": timings.prefill_s, "seconds": seconds},
    })


async def _sse(job: Job, req: ChatRequest, rid: str, model: str, http: Request
               ) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None) -> str:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [{"index": 0, "delta": delta,
                                             "finish_reason": finish, "logprobs": None}]}
        return f"data: {json.dumps(body)}\n\n"

    n, sent = 0, ""
    try:
        yield chunk({"role": "assistant", "content": ""}, None)
        while True:
            kind, *payload = await job.events.get()
            if kind == "token":
                n += 1
                if payload[1]:
                    sent += payload[1]
                    yield chunk({"content": payload[1]}, None)
            elif kind == "error":
                yield f"data: {json.dumps(_error_of(payload[0]).body())}\n\n"
                break
            else:
                finish, text, timings, seconds = payload
                if len(text) > len(sent):  # tail held back for stop strings / partial UTF-8
                    yield chunk({"content": text[len(sent):]}, None)
                yield chunk({}, finish)
                if req.include_usage:
                    body = {"id": rid, "object": "chat.completion.chunk", "created": created,
                            "model": model, "choices": [],
                            "usage": _usage(job, n, timings, seconds)}
                    yield f"data: {json.dumps(body)}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, chat_template: str | None = None) -> None:
    """Serve an engine until interrupted."""
    import uvicorn

    from specdec import blas

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    app = create_app(engine, api_key=api_key, chat_template=chat_template)
    draft = "none" if engine.draft is None else (
        "self" if engine.draft is engine.target else engine.draft.name)
    log.info("serving %s at http://%s:%d/v1 (draft: %s, k=%d, BLAS: %s)", engine.target.name,
             host, port, draft, engine.default_spec.k, blas.active())
    uvicorn.run(app, host=host, port=port, log_level="info")
