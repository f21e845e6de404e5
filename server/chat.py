"""OpenAI Chat Completions (`POST /v1/chat/completions`) and Completions
(`POST /v1/completions`): bodies parsed by `chat_wire`'s models and turned into the neutral
request by `protocol`, events turned into OpenAI's
`chat.completion` / `text_completion` objects or their SSE chunks.

Streaming: a first chunk with the role, then one chunk per event (`reasoning_content`,
`content` or `tool_calls` deltas, each with the logprobs of the tokens behind it), a chunk
with the finish reason, a usage chunk when `stream_options.include_usage`, then `[DONE]`. A
failure mid-stream is an `{"error": ...}` chunk before `[DONE]`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from specdec.errors import SpecdecError
from specdec.events import (Failed, Finished, ReasoningDelta, TextDelta, TokenLogprob,
                            ToolCallDelta)

from .door import Door, Run, RunResponse, extension, sse, warning_header
from .errors import openai_body, openai_response
from .chat_wire import (CHAT_RESPONSES, COMPLETION_RESPONSES, ChatCompletionRequest,
                        CompletionRequest)
from .protocol import Body, to_chat, to_completion

PREFIX = "/v1/"  # OpenAI's error shape is every other path's too
REQUEST_BODIES = {"/v1/chat/completions": ChatCompletionRequest,
                  "/v1/completions": CompletionRequest}
# The engine's field names -> this API's.
PARAMS = {"messages": "messages[]", "constraint": "response_format",
          "thinking": "reasoning_effort",
          "logprobs": "top_logprobs", "spec": "num_draft_tokens"}
COMPLETION_PARAMS = {**PARAMS, "messages": "prompt", "constraint": "structured_outputs",
                     "logprobs": "logprobs"}


def error(e: SpecdecError) -> JSONResponse:
    return openai_response(e, PARAMS)


def router(door: Door) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/chat/completions", response_model=None, responses=CHAT_RESPONSES)
    async def chat(request: Request) -> Any:
        body = to_chat(await door.parse(request, ChatCompletionRequest))
        try:
            return await _serve(door, request, body, True)
        except SpecdecError as e:  # in the body's own field names
            door.metrics.add(request_errors_total=1)
            return openai_response(e, {**PARAMS, **body.params})

    @r.post("/v1/completions", response_model=None, responses=COMPLETION_RESPONSES)
    async def completions(request: Request) -> Any:
        body = to_completion(await door.parse(request, CompletionRequest))
        try:
            return await _serve(door, request, body, False)
        except SpecdecError as e:  # in this API's own field names
            door.metrics.add(request_errors_total=1)
            return openai_response(e, COMPLETION_PARAMS)

    return r


async def _serve(door: Door, http: Request, body: Body, chat: bool) -> Any:
    door.check_model(body.model)
    run = await door.open(body.request, http)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    headers = warning_header(run.request.warnings)
    if body.stream:
        return RunResponse(run, _chunks(door, run, body, rid, chat), headers)
    async for ev in run.events():
        if isinstance(ev, Failed):
            raise ev.error
        if isinstance(ev, Finished):
            break
    else:  # the client went away: nobody to answer (499: client closed the request)
        return JSONResponse({"error": None}, status_code=499)
    choice: dict[str, Any] = {"index": 0, "finish_reason": ev.finish_reason, "logprobs": None}
    if run.request.logprobs is not None:
        choice["logprobs"] = logprobs_of(door, ev.logprobs, chat)
    if chat:
        msg: dict[str, Any] = {"role": "assistant",
                               "content": (ev.text or None) if ev.tool_calls else ev.text}
        if ev.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in ev.tool_calls]
        if ev.reasoning is not None:
            msg["reasoning_content"] = ev.reasoning
        choice["message"] = msg
    else:
        choice["text"] = ev.text
    return JSONResponse({
        "id": rid, "object": "chat.completion" if chat else "text_completion",
        "created": run.created, "model": door.model_name, "choices": [choice],
        "usage": usage_of(ev), "specdec": extension(run, ev.stats, ev.warnings)},
        headers=headers)


def usage_of(ev: Finished) -> dict[str, Any]:
    u = ev.usage
    out: dict[str, Any] = {"prompt_tokens": u.prompt_tokens,
                           "completion_tokens": u.completion_tokens,
                           "total_tokens": u.total_tokens}
    if u.reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": u.reasoning_tokens}
    return out


def logprobs_of(door: Door, lps: Sequence[TokenLogprob], chat: bool) -> dict[str, Any]:
    """OpenAI's `logprobs` object: chat's `content` list (token text, logprob, UTF-8 bytes,
    top_logprobs), or completions' parallel lists."""
    tokenizer = door.engine.target.tokenizer

    def text(t: int) -> str:
        return str(tokenizer.decode([t], skip_special_tokens=False))

    if chat:
        return {"content": [
            {"token": text(e.token), "logprob": e.logprob, "bytes": list(text(e.token).encode()),
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


async def _chunks(door: Door, run: Run, body: Body, rid: str, chat: bool
                  ) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    want_lp = run.request.logprobs is not None

    def chunk(delta: dict[str, Any] | None, finish: str | None = None,
              lps: Sequence[TokenLogprob] = ()) -> str:
        lp = logprobs_of(door, lps, chat) if want_lp and lps else None
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": lp}
        if chat:
            choice["delta"] = delta or {}
        else:
            choice["text"] = (delta or {}).get("content", "")
        return sse(None, {"id": rid, "object": obj, "created": run.created,
                          "model": door.model_name, "choices": [choice]})

    if chat:
        yield chunk({"role": "assistant", "content": ""})
    started: set[int] = set()
    async for ev in run.events():
        if isinstance(ev, ReasoningDelta):
            yield chunk({"reasoning_content": ev.text}, lps=ev.logprobs)
        elif isinstance(ev, TextDelta):
            yield chunk({"content": ev.text}, lps=ev.logprobs)
        elif isinstance(ev, ToolCallDelta):  # id, type and name with a call's first delta
            call: dict[str, Any] = {"index": ev.index, "function": {"arguments": ev.arguments}}
            if ev.index not in started:
                started.add(ev.index)
                call.update(id=ev.id, type="function")
                call["function"] = {"name": ev.name, "arguments": ev.arguments}
            yield chunk({"content": None, "tool_calls": [call]}, lps=ev.logprobs)
        elif isinstance(ev, Failed):
            yield sse(None, openai_body(ev.error, PARAMS if chat else COMPLETION_PARAMS))
        else:
            yield chunk(None, ev.finish_reason)
            if body.include_usage:
                yield sse(None, {"id": rid, "object": obj, "created": run.created,
                                 "model": door.model_name, "choices": [],
                                 "usage": usage_of(ev),
                                 "specdec": extension(run, ev.stats, ev.warnings)})
    if not run.left:
        yield "data: [DONE]\n\n"
