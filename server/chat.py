"""OpenAI Chat Completions (`POST /v1/chat/completions`) and Completions
(`POST /v1/completions`): bodies parsed by `chat_wire`'s models (the only parser) -> the
neutral `GenerateRequest` (`to_request`) -> the engine's events -> OpenAI's
`chat.completion` / `text_completion` objects or their SSE chunks.

The request: what one field's type cannot say is checked here: fields the models do not
name (`chat_wire.CHAT_UNMODELED`, every API's policy), one constraint at most (response_format,
vLLM's `structured_outputs` or its older `guided_*` fields), thinking asked for and turned off
at once.

One fold (`Chunks`) makes both the stream and the whole answer. Streaming: a first chunk
with the role, then one chunk per event (`reasoning_content`, `content` or `tool_calls`
deltas, each with the logprobs of the tokens behind it), a chunk with the finish reason, a
usage chunk when `stream_options.include_usage`, then `[DONE]`. A failure mid-stream is an
`{"error": ...}` chunk before `[DONE]`, naming the field as the body does (as a failure of a
whole answer does).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from specdec.errors import SpecdecError
from specdec.events import (Event, Failed, Finished, ReasoningDelta, TextDelta, TokenLogprob,
                            ToolCallDelta)
from specdec.request import (Constraint, GenerateRequest, Message, NamedTool, SamplingParams,
                             Tool, ToolCall, ToolChoice)

from .chat_wire import (CHAT_RESPONSES, CHAT_UNMODELED, COMPLETION_RESPONSES,
                        COMPLETION_UNMODELED, AssistantTurn, ChatCompletionRequest,
                        CompletionRequest, TextPart, ToolResult, SamplingFields)
from .door import (Door, Fold, Run, SSEEvent, extension, rest_sources, sampling, token_sources,
                   tool)
from .errors import bad_request, openai_body, openai_response

PREFIX = "/v1/"  # OpenAI's error shape is every other path's too
REQUEST_BODIES = {"/v1/chat/completions": ChatCompletionRequest,
                  "/v1/completions": CompletionRequest}
# The engine's field names -> this API's.
PARAMS = {"messages": "messages[]", "constraint": "response_format",
          "thinking": "reasoning_effort",
          "logprobs": "top_logprobs", "spec": "num_draft_tokens"}
COMPLETION_PARAMS = {**PARAMS, "messages": "prompt", "constraint": "structured_outputs",
                     "logprobs": "logprobs"}
Body = ChatCompletionRequest | CompletionRequest


# -- wire body -> the neutral request ---------------------------------------------------------
# vLLM's older structured-output fields, mapped onto `structured_outputs`' kinds.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "grammar": "grammar",
                    "choice": "choice", "json_object": "json_object"}
SWITCHES = ("enable_thinking", "thinking", "reasoning")  # chat_template_kwargs that think


def constraint_of(body: SamplingFields) -> Constraint | None:
    """`response_format` (chat), vLLM's `structured_outputs` or its older `guided_*` fields
    → the constraint (at most one). `json_schema.strict: true` compiles strictly
    (unsupported keywords are a 400); otherwise leniently, with warnings."""
    found: list[Constraint] = []
    rf = getattr(body, "response_format", None)
    if rf is not None:
        if rf.type != "json_schema" and rf.json_schema is not None:
            raise bad_request(f"response_format.json_schema is for type 'json_schema', not "
                              f"{rf.type!r}: drop it or set the type",
                              "response_format.json_schema")
        if rf.type == "json_object":
            found.append(Constraint.json_object())
        elif rf.type == "json_schema":
            if rf.json_schema is None:
                raise bad_request("response_format.json_schema must be an object with a "
                                  "'schema'", "response_format.json_schema")
            found.append(Constraint.json_schema(rf.json_schema.schema_,
                                                lenient=not rf.json_schema.strict))
    guided = [k for k in GUIDED if getattr(body, k) is not None]
    so = body.structured_outputs
    kinds = {k: v for k, v in (so.model_dump(by_alias=True) if so else {}).items()
             if v not in (None, False)}
    given = len(kinds) + len(guided)
    kinds.update({GUIDED[k]: getattr(body, k) for k in guided})
    if given > 1:
        raise bad_request(f"structured_outputs has {sorted(kinds)}: give exactly one kind",
                          guided[0] if guided else "structured_outputs")
    for k, v in kinds.items():
        found.append(Constraint.json_schema(v, lenient=True) if k == "json" else
                     Constraint(STRUCTURED_KINDS[k],  # type: ignore[arg-type]
                                None if k == "json_object" else v))
    if len(found) > 1:
        raise bad_request("give either response_format or structured_outputs, not both",
                          "structured_outputs")
    return found[0] if found else None


def sampling_of(body: SamplingFields) -> SamplingParams:
    """The sampling fields with `logit_bias` (its keys token ids, each once)."""
    bias = tuple(sorted((int(k), float(v)) for k, v in (body.logit_bias or {}).items()))
    twice = next((t for (t, _), (u, _) in zip(bias, bias[1:]) if t == u), None)
    if twice is not None:
        raise bad_request(f"logit_bias names token {twice} twice (its keys are token ids)",
                          "logit_bias")
    return sampling(body.temperature, body.top_p, body.top_k, body.seed, bias)


def tools_of(body: ChatCompletionRequest) -> tuple[tuple[Tool, ...], ToolChoice]:
    """`tools` + `tool_choice` → (the tools, the neutral choice: "auto" when tools are given
    without one). The engine decides what each choice means (`Engine.prepare`)."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs a non-empty 'tools' list", "tools")
        return (), "none"
    tools = tuple(tool(t.function.name, t.function.description, t.function.parameters,
                       t.function.strict) for t in body.tools)
    if choice is None:
        return tools, "auto"
    return tools, choice if isinstance(choice, str) else NamedTool(choice.function.name)


def _text(content: str | list[TextPart] | None) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content or ())


def messages_of(body: ChatCompletionRequest) -> tuple[Message, ...]:
    """The conversation: content as text (parts joined; an assistant's null is ""),
    developer as system, an assistant's `tool_calls` and `tool` results as the turns' calls
    and results (the engine decides whether it can render them)."""
    out = []
    for m in body.messages:
        role = "system" if m.role == "developer" else m.role
        calls: tuple[ToolCall, ...] = ()
        reasoning = call_id = None
        if isinstance(m, AssistantTurn):
            calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments)
                          for c in m.tool_calls or ())
            extra = m.model_extra or {}  # vLLM's name, then the newer one
            r = extra.get("reasoning_content", extra.get("reasoning"))
            reasoning = r if isinstance(r, str) else None
        if isinstance(m, ToolResult):
            call_id = m.tool_call_id
        out.append(Message(role, _text(m.content), reasoning, calls, call_id,  # type: ignore
                           m.name if not isinstance(m, ToolResult) else None))
    return tuple(out)


def _common(body: SamplingFields, max_tokens: int | None) -> dict[str, Any]:
    """The request fields chat and completions share."""
    return {"constraint": constraint_of(body), "sampling": sampling_of(body),
            "max_tokens": max_tokens, "stop": (body.stop,) if isinstance(body.stop, str)
            else tuple(body.stop or ()), **body.engine_fields()}


def to_request(body: ChatCompletionRequest | CompletionRequest) -> GenerateRequest:
    """A parsed /v1/chat/completions or /v1/completions body as the neutral request.

    Raises:
        WireError: 400 naming the offending field (an unmodeled one: `CHAT_UNMODELED`,
            `COMPLETION_UNMODELED`).
    """
    if isinstance(body, CompletionRequest):
        return _completion_request(body)
    CHAT_UNMODELED.refuse(body)
    fields = _common(body, body.max_completion_tokens or body.max_tokens)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    kwargs = dict(body.chat_template_kwargs or {})
    effort, budget = body.reasoning_effort, body.max_thinking_tokens
    asked = [k for k in SWITCHES if kwargs.get(k)]
    off = effort == "none" or any(kwargs.get(k) is False for k in SWITCHES)
    thinking = bool(asked) or effort not in (None, "none") or budget is not None
    if thinking and off:
        raise bad_request("the request both asks for thinking and turns it off "
                          "(reasoning_effort 'none' or a false chat_template_kwargs switch)",
                          "reasoning_effort" if effort is not None else "chat_template_kwargs")
    if thinking:
        kwargs = {k: v for k, v in kwargs.items() if k not in asked}
    tools, choice = tools_of(body)
    return GenerateRequest(
        messages=messages_of(body), tools=tools, tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        template_kwargs=kwargs, thinking=thinking, thinking_budget=budget,
        reasoning_effort=effort if effort not in (None, "none") else None, **fields)


def _completion_request(body: CompletionRequest) -> GenerateRequest:
    """One prompt (text or token ids) as the neutral request."""
    COMPLETION_UNMODELED.refuse(body)
    fields = _common(body, body.max_tokens)
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    return GenerateRequest(prompt=prompt if isinstance(prompt, str) else tuple(prompt),
                           logprobs=body.logprobs, **fields)


def params_of(body: ChatCompletionRequest | CompletionRequest) -> dict[str, str]:
    """The engine's field names -> this body's (chat's `max_completion_tokens`, when given,
    for max_tokens)."""
    if isinstance(body, CompletionRequest):
        return COMPLETION_PARAMS
    return {**PARAMS, **({"max_tokens": "max_completion_tokens"}
                         if body.max_completion_tokens else {})}


# -- events -> the wire -----------------------------------------------------------------------
DONE: SSEEvent = (None, "[DONE]")


def error(e: SpecdecError, body: Body | None = None) -> JSONResponse:
    """An error in OpenAI's shape, in the body's own field names (chat's by default)."""
    return openai_response(e, PARAMS if body is None else params_of(body))


def router(door: Door) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/chat/completions", response_model=None, responses=CHAT_RESPONSES)
    async def chat(http: Request) -> Response:
        return await door.serve(http, ChatCompletionRequest, to_request, Chunks.of, error)

    @r.post("/v1/completions", response_model=None, responses=COMPLETION_RESPONSES)
    async def completions(http: Request) -> Response:
        return await door.serve(http, CompletionRequest, to_request, Chunks.of, error)

    return r


@dataclass
class Chunks(Fold):
    """One run's events -> the stream's chunks (`chat.completion.chunk`, `text_completion`)
    and the whole answer (`chat.completion`, `text_completion`)."""

    run: Run
    chat: bool
    params: dict[str, str]  # the engine's field names -> the body's
    usage: bool  # a usage chunk after the last (`stream_options.include_usage`)
    id: str
    started: set[int] = field(default_factory=set)  # tool calls whose first delta was sent
    done: Finished | None = None
    carried: int = 0  # output tokens the chunks carried

    @classmethod
    def of(cls, body: Body, run: Run) -> Chunks:
        chat, so = isinstance(body, ChatCompletionRequest), body.stream_options
        return cls(run, chat, params_of(body), bool(so and so.include_usage),
                   f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}")

    def opening(self) -> list[SSEEvent]:
        return [self._chunk({"role": "assistant", "content": ""})] if self.chat else []

    def feed(self, ev: Event) -> list[SSEEvent]:
        if isinstance(ev, ReasoningDelta):
            return [self._chunk({"reasoning_content": ev.text}, ev=ev)]
        if isinstance(ev, TextDelta):
            return [self._chunk({"content": ev.text}, ev=ev)]
        if isinstance(ev, ToolCallDelta):  # id, type and name with a call's first delta
            call: dict[str, Any] = {"index": ev.index, "function": {"arguments": ev.arguments}}
            if ev.index not in self.started:
                self.started.add(ev.index)
                call.update(id=ev.id, type="function")
                call["function"] = {"name": ev.name, "arguments": ev.arguments}
            return [self._chunk({"content": None, "tool_calls": [call]}, ev=ev)]
        if isinstance(ev, Failed):
            return [(None, openai_body(ev.error, self.params)), DONE]
        self.done = ev
        out = [self._chunk(None, ev.finish_reason)]
        out[0][1]["choices"][0].update(rest_sources(self.run, ev, self.carried))
        if self.usage:
            out.append((None, {**self._head(), "choices": [], "usage": usage_of(ev),
                               "specdec": extension(self.run, ev.stats, ev.warnings)}))
        return out + [DONE]

    def answer(self) -> dict[str, Any]:
        ev = self.done
        assert ev is not None, "answered before the run finished"
        choice: dict[str, Any] = {"index": 0, "finish_reason": ev.finish_reason,
                                  "logprobs": None}
        if self.run.request.logprobs is not None:
            choice["logprobs"] = logprobs_of(self.run, ev.logprobs, self.chat)
        srcs = token_sources(self.run, ev.tokens, ev.sources, ev.logprobs)
        if srcs is not None:
            choice["token_sources"] = srcs
        if self.chat:
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
        return {**self._head("chat.completion" if self.chat else "text_completion"),
                "choices": [choice], "usage": usage_of(ev),
                "specdec": extension(self.run, ev.stats, ev.warnings)}

    def _head(self, obj: str | None = None) -> dict[str, Any]:
        """An object's first fields: a chunk's, or the whole answer's `obj`."""
        obj = obj or ("chat.completion.chunk" if self.chat else "text_completion")
        return {"id": self.id, "object": obj, "created": self.run.created,
                "model": self.run.model}

    def _chunk(self, delta: dict[str, Any] | None, finish: str | None = None,
               ev: TextDelta | ReasoningDelta | ToolCallDelta | None = None) -> SSEEvent:
        """A chunk of the stream: a delta, with the logprobs and the token sources of the
        tokens behind it (`ev`'s) where asked for; or the finish reason."""
        lps = ev.logprobs if ev is not None else ()
        self.carried += len(ev.tokens) if ev is not None else 0
        want = self.run.request.logprobs is not None and lps
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish,
                                  "logprobs": logprobs_of(self.run, lps, self.chat) if want
                                  else None}
        srcs = token_sources(self.run, ev.tokens, ev.sources, lps) if ev is not None else None
        if srcs is not None:
            choice["token_sources"] = srcs
        if self.chat:
            choice["delta"] = delta or {}
        else:
            choice["text"] = (delta or {}).get("content", "")
        return None, {**self._head(), "choices": [choice]}


def usage_of(ev: Finished) -> dict[str, Any]:
    u = ev.usage
    out: dict[str, Any] = {"prompt_tokens": u.prompt_tokens,
                           "completion_tokens": u.completion_tokens,
                           "total_tokens": u.total_tokens,
                           "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}
    if u.reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": u.reasoning_tokens}
    return out


def logprobs_of(run: Run, lps: Sequence[TokenLogprob], chat: bool) -> dict[str, Any]:
    """OpenAI's `logprobs` object: chat's `content` list (token text, logprob, UTF-8 bytes,
    top_logprobs), or completions' parallel lists."""
    tokenizer = run.engine.target.tokenizer
    n = run.request.logprobs or 0  # (token sources may have asked for more alternatives)

    def text(t: int) -> str:
        return str(tokenizer.decode([t], skip_special_tokens=False))

    if chat:
        return {"content": [
            {"token": text(e.token), "logprob": e.logprob, "bytes": list(text(e.token).encode()),
             "top_logprobs": [{"token": text(a), "logprob": b, "bytes": list(text(a).encode())}
                              for a, b in e.top[:n]]} for e in lps]}
    tokens = [text(e.token) for e in lps]
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in lps],
            "top_logprobs": [{text(a): b for a, b in e.top[:n]} for e in lps],
            "text_offset": offsets}
