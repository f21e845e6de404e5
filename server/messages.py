"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the
engine door: wire body (`messages_wire`, the only parser) -> `GenerateRequest`, and events ->
a Message or its SSE events. Anthropic's field names live in these two modules only.

The wire follows the `anthropic` SDK (2.15): structured output is `output_config.format`
(`{"type": "json_schema", "schema"}`, what `messages.parse(output_format=Model)` sends),
compiled strictly; the older beta's top-level `output_format` is taken too. Sampling fields
(`temperature` (default 1.0, as Anthropic's), `top_p`, `top_k`) and our extensions (`seed`,
`num_draft_tokens`, `draft_masking`, `prompt_lookup`) go in the body (`extra_body`).
`thinking: {"type": "adaptive"}` thinks with the engine's default budget.

Accepted and ignored (they do not change the output here): `metadata`, `service_tier`,
`speed`, `inference_geo`, `cache_control` (top level, blocks, tools), `container`,
`diagnostics`, `user_profile_id`, `workspace_id` (`messages_wire.IGNORED`), a tool's
`eager_input_streaming`, text blocks' `citations`, `tool_result.is_error`, thinking blocks'
`signature`, `display: "summarized"`; the `anthropic-version` / `anthropic-beta` headers.
`context_management` and `mcp_servers` are refused unless given their no-op value; any
other field is a 400 naming it (`door.Unmodeled`, every API's policy). Refused with a 400:
blocks other than text / tool_use / tool_result / thinking (`redacted_thinking`, images,
documents, server-tool blocks), server tools, a trailing assistant turn (prefill),
`thinking: {"type": "between_tools"}`.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import uuid
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from specdec.errors import SpecdecError
from specdec.events import Event, Failed, Finished, ReasoningDelta, TextDelta, ToolCallDelta
from specdec.request import Constraint, GenerateRequest, Message, NamedTool, ToolCall, ToolChoice

from .door import (Door, Fold, Run, SSEEvent, extension, rest_sources, sampling, token_sources,
                   tool)
from .errors import anthropic_body, anthropic_response, bad_request
from .messages_wire import (UNMODELED, CountTokensBody, MessagesBody, OutputConfig,
                            TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock)
from .openapi import sse as sse_body

PREFIX = "/v1/messages"
# The engine's neutral parameter names -> this API's.
PARAMS = {"messages": "messages", "constraint": "output_config.format",
          "max_tokens": "max_tokens", "thinking": "thinking", "tools": "tools",
          "tool_choice": "tool_choice", "stop": "stop_sequences",
          "sampling.temperature": "temperature", "sampling.top_p": "top_p",
          "sampling.top_k": "top_k", "sampling.seed": "seed", "spec": "num_draft_tokens"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
CHOICES: dict[str, ToolChoice] = {"auto": "auto", "any": "required", "none": "none"}
REQUEST_BODIES: dict[str, type[BaseModel]] = {PREFIX: MessagesBody,
                                              PREFIX + "/count_tokens": CountTokensBody}


# -- wire body -> the neutral request ---------------------------------------------------------
def _text(blocks: list[TextBlock]) -> str:
    return "".join(b.text for b in blocks)


def conversation(body: CountTokensBody) -> tuple[Message, ...]:
    """The turns: a user turn's `tool_result`s become tool turns (in their place among its
    text), an assistant turn's `thinking` its reasoning and its `tool_use`s its calls."""
    out = [Message("system", _text(body.system))] if body.system else []
    names: dict[str, str] = {}  # tool_use id -> name, for the tool turns answering it
    for turn in body.messages:
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        for b in turn.content:
            if isinstance(b, ToolResultBlock):
                if texts:
                    out.append(Message("user", "".join(texts)))
                    texts = []
                out.append(Message("tool", _text(b.content), tool_call_id=call_id(
                    b.tool_use_id), name=names.get(b.tool_use_id)))
            elif isinstance(b, ToolUseBlock):
                names[b.id] = b.name
                calls.append(ToolCall(call_id(b.id), b.name,
                                      json.dumps(b.input, ensure_ascii=False)))
            elif isinstance(b, ThinkingBlock):
                reasoning.append(b.thinking)
            else:
                texts.append(b.text)
        if texts or calls or reasoning or not turn.content:
            out.append(Message(turn.role, "".join(texts),
                               reasoning="".join(reasoning) if reasoning else None,
                               tool_calls=tuple(calls)))
    return tuple(out)


def _tool_choice(body: CountTokensBody) -> tuple[ToolChoice, bool]:
    """Anthropic's choice as (choice, parallel calls allowed); no choice means auto."""
    c = body.tool_choice
    if c is None:
        return "auto", True
    choice = CHOICES[c.type] if c.name is None else NamedTool(c.name)
    return choice, not c.disable_parallel_tool_use


# Keywords the anthropic SDK's `transform_schema` (`messages.parse`, `output_format=Model`)
# moves out of a schema into its description as `{key: value, ...}` (Python's str of each
# value), and that this server enforces: they are put back (`restore_moved`).
# Those whose values are subschemas (the rewritten keywords, specdec/schema_rewrite.py) come
# as Python's repr of a dict, list or bool, read back as literals only (`ast.literal_eval`).
SCHEMA_MOVED = frozenset({"if", "then", "else", "not", "dependentRequired",
                          "dependentSchemas", "propertyNames", "unevaluatedProperties",
                          "unevaluatedItems"})
MOVED_KEYWORDS = frozenset({
    "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "minItems", "maxItems", "uniqueItems",
    "minProperties", "maxProperties"}) | SCHEMA_MOVED
_UNREAD = object()
_MOVED = re.compile(r"(?:\A|\n\n)\{((?:[A-Za-z]+): .*)\}\Z", re.S)
_MOVED_KEY = re.compile(r"(?:\A|, )([A-Za-z]+): ")


def _moved_value(text: str, name: str = "") -> Any:
    if name in SCHEMA_MOVED:
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, RecursionError, MemoryError):
            return _UNREAD
        return value if isinstance(value, (dict, list, bool)) else _UNREAD
    if text in ("True", "False"):
        return text == "True"
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, (int, float)) else text


def restore_moved(schema: Any) -> Any:
    """A schema with the keywords the anthropic SDK moved into descriptions put back where
    every key of the moved block is one this server enforces (`MOVED_KEYWORDS`); the
    description is what it was before. Anything else is left as sent."""
    if isinstance(schema, list):
        return [restore_moved(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (restore_moved(v) if k not in ("enum", "const", "default", "examples") else v)
           for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {k: restore_moved(v) for k, v in schema[key].items()}
    desc = out.get("description")
    m = _MOVED.search(desc) if isinstance(desc, str) else None
    if m is None:
        return out
    keys = list(_MOVED_KEY.finditer(m.group(1)))
    if not keys or keys[0].start() != 0 or any(k.group(1) not in MOVED_KEYWORDS for k in keys):
        return out
    body = m.group(1)
    for k, nxt in zip(keys, keys[1:] + [None]):
        name = k.group(1)
        if name in out:  # not moved, then: leave it all as sent
            return {**out, "description": desc}
        value = _moved_value(body[k.end():nxt.start() if nxt is not None else len(body)], name)
        if value is _UNREAD:  # not a literal: leave it all as sent
            return {**out, "description": desc}
        out[name] = value
    before = desc[:m.start()]
    if before:
        out["description"] = before
    else:
        del out["description"]
    return out


def prompt_request(body: CountTokensBody) -> GenerateRequest:
    """What makes the prompt and constrains the output (all count_tokens takes).

    Raises:
        WireError: 400 for what this server does not do (a field it does not take, prefill,
            both output formats).
    """
    UNMODELED.refuse(body)
    if body.messages[-1].role == "assistant":
        raise bad_request("messages: the last turn is the assistant's (prefill), which this "
                          "server does not continue; end with a user turn", "messages",
                          "unsupported_parameter")
    config = body.output_config or OutputConfig()
    if body.output_format is not None and config.format is not None:
        raise bad_request("give output_config.format or output_format, not both",
                          "output_format")
    fmt = body.output_format or config.format
    choice, parallel = _tool_choice(body)
    think = body.thinking
    return GenerateRequest(
        messages=conversation(body),
        constraint=Constraint.json_schema(restore_moved(fmt.schema_), lenient=False)
        if fmt else None,
        tools=tuple(tool(t.name, t.description, t.input_schema, t.strict)
                    for t in body.tools),
        tool_choice=choice, parallel_tool_calls=parallel,
        thinking=think is not None and think.type != "disabled",
        thinking_budget=think.budget_tokens if think is not None else None,
        reasoning_effort=config.effort)


def to_request(body: MessagesBody) -> GenerateRequest:
    """The neutral request a Messages body means (Anthropic's temperature default: 1.0).

    Raises:
        WireError: 400 for token sources asked beside omitted thinking (its tokens' text
            would show the thinking the request hides).
    """
    if body.token_sources not in (None, False) and body.thinking is not None and \
            body.thinking.display == "omitted":
        raise bad_request("token_sources would show the thinking that display 'omitted' "
                          "hides: ask for one or the other", "token_sources")
    return dataclasses.replace(
        prompt_request(body),
        sampling=sampling(body.temperature, body.top_p, body.top_k, body.seed),
        max_tokens=body.max_tokens, stop=tuple(body.stop_sequences), **body.engine_fields())


# -- events -> the wire -----------------------------------------------------------------------
BlockKey = str | tuple[str, int]  # "thinking", "text" or ("tool_use", call index)


@dataclasses.dataclass
class Blocks(Fold):
    """Folds a request's events into the Message's content blocks and the SSE events that
    build them: the one code path behind both the streamed and the whole response, so the
    two can never disagree."""

    run: Run
    omit_thinking: bool = False  # `display: "omitted"`: the block is sent, its text not
    carried: int = 0  # output tokens the content_block_delta events carried
    id: str = dataclasses.field(default_factory=lambda: "msg_" + uuid.uuid4().hex[:24])
    content: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    key: BlockKey | None = None  # the open block
    args: list[str] = dataclasses.field(default_factory=list)  # the open tool_use's input JSON
    done: Finished | None = None

    @classmethod
    def of(cls, body: MessagesBody, run: Run) -> Blocks:
        return cls(run, body.thinking is not None and body.thinking.display == "omitted")

    def headers(self) -> dict[str, str]:
        return {"request-id": self.id}

    def opening(self) -> list[SSEEvent]:
        return [("message_start", {"type": "message_start",
                                   "message": message(self.id, self.run, [], None)}),
                ("ping", {"type": "ping"})]

    def answer(self) -> dict[str, Any]:
        return message(self.id, self.run, self.content, self.done)

    def _open(self, key: BlockKey, block: dict[str, Any]) -> list[SSEEvent]:
        if key == self.key:
            return []
        out = self.close()
        self.key, self.args = key, []
        self.content.append(block)
        return out + [("content_block_start", {"type": "content_block_start",
                                               "index": len(self.content) - 1,
                                               "content_block": dict(block)})]

    def _delta(self, delta: dict[str, Any], ev: Event | None = None) -> SSEEvent:
        """A content_block_delta event, with the `token_sources` of the tokens behind it
        (`ev`'s) where asked for."""
        srcs = (token_sources(self.run, ev.tokens, ev.sources, ev.logprobs)  # type: ignore
                if ev is not None else None)
        self.carried += len(ev.tokens) if ev is not None else 0  # type: ignore[union-attr]
        return ("content_block_delta", {"type": "content_block_delta",
                                        "index": len(self.content) - 1, "delta": delta,
                                        **({"token_sources": srcs} if srcs is not None
                                           else {})})

    def feed(self, ev: Event) -> list[SSEEvent]:
        """The SSE events one engine event makes (`Finished` closes the open block, then
        the message; `Failed` is Anthropic's error event, the stream's last)."""
        if isinstance(ev, ReasoningDelta):
            out = self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            if ev.text and not self.omit_thinking:
                self.content[-1]["thinking"] += ev.text
                out.append(self._delta({"type": "thinking_delta", "thinking": ev.text}, ev))
            return out
        if isinstance(ev, TextDelta):
            out = self._open("text", {"type": "text", "text": ""})
            self.content[-1]["text"] += ev.text
            return out + [self._delta({"type": "text_delta", "text": ev.text}, ev)]
        if isinstance(ev, ToolCallDelta):
            out = self._open(("tool_use", ev.index), {"type": "tool_use", "id": tool_id(ev.id),
                                                      "name": ev.name, "input": {}})
            self.args.append(ev.arguments)
            return out + [self._delta({"type": "input_json_delta",
                                       "partial_json": ev.arguments}, ev)]
        if isinstance(ev, Failed):
            return [("error", anthropic_body(ev.error, PARAMS))]
        self.done = ev
        reason, seq = stop_of(ev)
        return self.close() + [
            ("message_delta", {"type": "message_delta",
                               "delta": {"stop_reason": reason, "stop_sequence": seq},
                               "usage": usage(ev),
                               "specdec": extension(self.run, ev.stats, ev.warnings),
                               **rest_sources(self.run, ev, self.carried)}),
            ("message_stop", {"type": "message_stop"})]

    def close(self) -> list[SSEEvent]:
        if self.key is None:
            return []
        out: list[SSEEvent] = []
        block = self.content[-1]
        if block["type"] == "thinking":  # the SDK sets the block's signature from this
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        at = len(self.content) - 1
        if block["type"] == "tool_use":
            try:
                block["input"] = json.loads("".join(self.args) or "{}")
            except ValueError:  # cut by max_tokens: streamed as it came, never reported
                self.content.pop()
        self.key = None
        return out + [("content_block_stop", {"type": "content_block_stop", "index": at})]


def tool_id(call: str) -> str:
    """Anthropic's spelling of a call id (`toolu_...`)."""
    return "toolu_" + call.removeprefix("call_").removeprefix("toolu_")


def call_id(tool_use_id: str) -> str:
    """A `tool_use` id as the engine wrote it (a template that renders ids, Mistral's, gets
    back the id its model wrote)."""
    return tool_use_id.removeprefix("toolu_")


def stop_of(ev: Finished) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a stop string's end is told by `Finished.stop_sequence`
    where the engine reports it."""
    seq = ev.stop_sequence
    return ("stop_sequence", seq) if seq else (STOP_REASONS[ev.finish_reason], None)


def usage(ev: Finished) -> dict[str, Any]:
    """Anthropic's usage: the prompt's tokens read from the prompt store are
    `cache_read_input_tokens`, the others `input_tokens` (their sum is the prompt, as
    Anthropic counts a cached prompt); nothing is written on request
    (`cache_creation_input_tokens` 0: every prompt is kept, no `cache_control` asked)."""
    cached = ev.usage.cached_tokens
    u: dict[str, Any] = {"input_tokens": ev.usage.prompt_tokens - cached,
                         "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
                         "output_tokens": ev.usage.completion_tokens}
    if ev.usage.reasoning_tokens is not None:
        u["output_tokens_details"] = {"thinking_tokens": ev.usage.reasoning_tokens}
    return u


def message(msg_id: str, run: Run, content: list[dict[str, Any]],
            done: Finished | None) -> dict[str, Any]:
    """The Message object (`done` None: the stream's opening one, empty and unfinished)."""
    reason, seq = stop_of(done) if done else (None, None)
    body: dict[str, Any] = {
        "id": msg_id, "type": "message", "role": "assistant", "model": run.model,
        "content": content, "stop_reason": reason, "stop_sequence": seq,
        # (the stream's opening usage: the prompt's tokens before its prefill; the end's
        # message_delta says how many were read from the prompt store)
        "usage": usage(done) if done else {"input_tokens": len(run.request.prompt_ids),
                                           "cache_creation_input_tokens": 0,
                                           "cache_read_input_tokens": 0, "output_tokens": 0}}
    if done is not None:
        body["specdec"] = extension(run, done.stats, done.warnings)
        srcs = token_sources(run, done.tokens, done.sources, done.logprobs)
        if srcs is not None:
            body["specdec"]["token_sources"] = srcs
    return body


# -- the routes -------------------------------------------------------------------------------
_ERROR = {"description": "Anthropic's error shape", "content": {"application/json": {"schema": {
    "type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                              "properties": {"type": {"type": "string"},
                                                             "message": {"type": "string"}}}}}}}}
RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "a Message; with stream: true, its server-sent events",
          "content": sse_body("each event named by its type (message_start ... message_stop), "
                              "its `data` the event's JSON")},
    **{c: _ERROR for c in (400, 401, 404, 413, 503, 504)}}


def error(e: SpecdecError, body: MessagesBody | None = None) -> JSONResponse:
    """Any error under `PREFIX`, in Anthropic's shape."""
    return anthropic_response(e, PARAMS)


def router(door: Door) -> APIRouter:
    r = APIRouter()

    @r.post(PREFIX, response_model=None, responses=RESPONSES)
    async def create(http: HTTPRequest) -> Response:
        return await door.serve(http, MessagesBody, to_request, Blocks.of, error)

    @r.post(PREFIX + "/count_tokens", responses={c: _ERROR for c in (400, 401, 404, 413)})
    async def count_tokens(http: HTTPRequest) -> dict[str, int]:
        body = await door.parse(http, CountTokensBody, admit=False)  # nothing is queued
        seat = door.route(body.model)
        greq = prompt_request(body)
        async with door.lease(seat):
            req = await door.prepare(greq, seat)
        return {"input_tokens": len(req.prompt_ids)}

    return r
