"""OpenAI's Responses API, `POST /v1/responses`: the body (`responses_wire`, pydantic, the
only parser) -> a `GenerateRequest` -> the engine's events -> a Response object, or its
event stream.

One `Writer` turns the events into both the stream's events and the response's `output`
items, so a streamed and a plain response cannot differ: a `reasoning` item
(`reasoning_text` content: the think block never leaks into the answer), a `message`
(`output_text`), or `function_call` items. Finish "length" is status "incomplete" (reason
max_output_tokens); a failure mid-stream is `response.failed` (before it: an error status).

Stored, as OpenAI's: a response is kept (`store` absent or true; `false`: not) with the
context it answered (`server.store`), once it has finished (completed or incomplete; a
failed or abandoned one is not kept, nor is anything of it added to its conversation).
`previous_response_id` continues a stored response: its input and output items come first
(not its `instructions`); `conversation` continues a conversation (its items come first,
and the request's input and output items are added to it); an `item_reference` input item
is the stored item of that id. `GET`/`DELETE /v1/responses/{id}` and `GET
/v1/responses/{id}/input_items` read and delete them. An id not stored is a 404 in
OpenAI's shape; with `specdec serve --store none` nothing is kept and asking for it is a
400. `background: true` answers at once and runs on without its client (`server.background`:
polled, cancelled by `POST /v1/responses/{id}/cancel`, its stream resumed by `GET
/v1/responses/{id}?stream=true&starting_after=N`).

Accepted and ignored (they do not change the output): metadata (echoed), user,
service_tier, safety_identifier, prompt_cache_key (it partitions the prompt store within
the API key's: `door.cache_scope`), prompt_cache_retention,
prompt_cache_options, stream_options, background_options, max_tool_calls (built-in tools
only), image, access_programs, reasoning.summary and generate_summary (the reasoning comes
whole, as `reasoning_text`), and input items' ids, statuses and annotations.
`responses_wire.NOOP` lists the fields refused unless given their no-op value; any other
unknown field is a 400 naming it (`door.Unmodeled`, every API's policy). Our extensions:
seed, top_k, num_draft_tokens, draft_masking, prompt_lookup, max_thinking_tokens,
chat_template_kwargs.
"""

from __future__ import annotations

import asyncio
import copy
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import logging
from concurrent.futures import Future

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from specdec.config import DEFAULT_MAX_TOKENS
from specdec.errors import SpecdecError
from specdec.events import Event, Failed, Finished, ReasoningDelta, TextDelta, ToolCallDelta
from specdec.request import (Constraint, GenerateRequest, Message, NamedTool, ToolCall,
                             ToolChoice)

from .background import Backgrounds, elsewhere
from .door import (Door, Fold, Run, SSEEvent, extension, rest_sources, sampling, token_sources,
                   tool)
from .errors import WireError, bad_request, message_of, openai_body, openai_response
from .openapi import GENERATE_RESPONSES, error_responses, sse as sse_body
from .responses_wire import (ConversationRef, FunctionChoice, InputItem, NEEDS, UNMODELED,
                             ResponsesRequest)
from .store import Item, Store, first_duplicate, page, size_of

log = logging.getLogger("specdec.server")

PREFIX = "/v1/responses"
RESPONSE_ID_HEADER = "x-specdec-response-id"
PARAMS = {"messages": "input", "constraint": "text.format", "max_tokens": "max_output_tokens",
          "thinking": "reasoning", "tools": "tools", "tool_choice": "tool_choice",
          "logprobs": "top_logprobs", "spec": "num_draft_tokens"}
# A text item's kind -> its id prefix, empty item, empty content part, and delta event stem.
KINDS: dict[str, tuple[str, dict[str, Any], dict[str, Any], str]] = {
    "reasoning": ("rs", {"type": "reasoning", "summary": [], "content": []},
                  {"type": "reasoning_text", "text": ""}, "response.reasoning_text"),
    "message": ("msg", {"type": "message", "role": "assistant", "content": []},
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                "response.output_text")}


def _lp(kind: str) -> dict[str, Any]:
    """output_text events carry logprobs (none: not implemented here); reasoning's do not."""
    return {"logprobs": []} if kind == "message" else {}


REQUEST_BODIES = {PREFIX: ResponsesRequest}
ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
             "reasoning": "rs"}


def wire_item(item: InputItem) -> Item:
    """An input item in its stored (and listed) form, with an id (its own, else a new one)."""
    iid = item.id or f"{ID_PREFIX[item.type]}_{uuid.uuid4().hex}"
    if item.type == "message":
        return {"type": "message", "id": iid, "role": item.role, "status": "completed",
                "content": [p.model_dump() for p in item.content]}
    if item.type == "function_call":
        return {"type": "function_call", "id": iid, "call_id": item.call_id, "name": item.name,
                "arguments": item.arguments, "status": "completed"}
    if item.type == "function_call_output":
        return {"type": "function_call_output", "id": iid, "call_id": item.call_id,
                "output": "".join(p.text for p in item.output), "status": "completed"}
    return {"type": "reasoning", "id": iid, "summary": [p.model_dump() for p in item.summary],
            "content": [p.model_dump() for p in item.content]}


def not_found(what: str, oid: str, param: str | None, code: str) -> WireError:
    return WireError(404, f"no {what} with id {oid!r} is stored here", param=param, code=code)


TOKEN_BYTES = 64  # the most bytes one output token takes stored (JSON-escaped), for bounds
MAX_CONTEXT = 1 << 17  # output tokens a bound counts at most where the model's context is unknown


@dataclass
class Turn:
    """What a request continues and keeps: the items before its own input (a previous
    response's input and output, or a conversation's), its own input items (references
    resolved, with ids), whether its response is stored, its conversation (and how many of
    its items it saw), and the previous response it continues. A turn on a conversation
    holds the conversation (`Door.conversation_turn`) until it is kept or ends (`ended`)."""

    prior: list[Item] = field(default_factory=list)
    own: list[Item] = field(default_factory=list)
    stored: bool = False
    conversation: str | None = None
    upto: int | None = None
    parent: str | None = None
    hold: Any = None  # the conversation's turn, held (an async context manager), or None
    kept: Future[None] | None = None  # the store's write of this turn
    attached: bool = False  # a run carries it (its end releases the hold)
    loop: Any = None  # the event loop the hold was taken on
    owner: str = ""  # the API key's owner name ("": one key or none)

    @property
    def context(self) -> list[Item]:
        return self.prior + self.own

    @staticmethod
    async def of(body: ResponsesRequest, door: Door, owner: str = "") -> Turn:
        """The request's turn, read from the store (off the event loop); a turn on a
        conversation first waits for the one in flight there, if any.

        Raises:
            WireError: 404 for an id the store does not hold; 400 where the server stores
                nothing and the request asks for stored state, both `previous_response_id`
                and `conversation` are given, an item id comes twice in the context, or
                the turn would take its conversation or chain past the store's bound; 409
                where the conversation's turn in flight outlasts this request's time limit;
                503 where the store fails.
        """
        store = door.store
        conv = body.conversation.id if isinstance(body.conversation, ConversationRef) \
            else body.conversation
        refs = [i for i, it in enumerate(body.input) if it.type == "item_reference"]
        if body.background and body.store is False:
            raise bad_request("background: true needs store: true (a background response is "
                              "polled, streamed and cancelled by its id)", "background")
        if store is None:
            for given, name in ((body.store, "store"), (body.background, "background"),
                                (body.previous_response_id, "previous_response_id"),
                                (conv, "conversation"), (refs, f"input[{refs[0] if refs else 0}]")):
                if given:
                    raise bad_request("this server keeps no responses (specdec serve --store "
                                      "none): send the whole conversation as input", name)
            return Turn(own=[wire_item(it) for it in body.input])
        if body.previous_response_id and conv:
            raise bad_request("previous_response_id and conversation cannot both be given",
                              "previous_response_id")
        turn = Turn(stored=body.store is not False, conversation=conv,
                    parent=body.previous_response_id or None, owner=owner)
        if conv:
            hold = door.conversation_turn(conv, door.config.request_timeout_s)
            await hold.__aenter__()
            turn.hold, turn.loop = hold, asyncio.get_running_loop()
        try:
            await turn.read(body, door, store)
        except BaseException:
            turn.ended()
            raise
        return turn

    async def read(self, body: ResponsesRequest, door: Door, store: Store) -> None:
        """What the turn continues, its own items (references resolved), checked."""
        if self.parent:
            prior = await door.stored(store.context, self.parent, self.owner)
            if prior is None:
                raise not_found("response", self.parent, "previous_response_id",
                                "previous_response_not_found")
            self.prior = prior
        elif self.conversation:
            seen = await door.stored(store.conversation_seen, self.conversation, self.owner)
            if seen is None:
                raise not_found("conversation", self.conversation, "conversation",
                                "conversation_not_found")
            self.prior, self.upto = seen
        for i, it in enumerate(body.input):
            if it.type != "item_reference":
                self.own.append(wire_item(it))
                continue
            if not it.id:
                raise bad_request("an item_reference item needs id", f"input[{i}].id")
            found = await door.stored(store.item, it.id, self.owner)
            if found is None:
                raise not_found("item", it.id, f"input[{i}].id", "item_not_found")
            self.own.append(found)
        dup = first_duplicate(self.context)
        if dup is not None:
            raise bad_request(f"Duplicate item found with id {dup}.", "input")
        if self.stored or self.conversation:
            # The most this turn can add to its unit: its own items and its output (twice
            # in a conversation: the response's and the conversation's), the response.
            # (at most the model's context: a larger max_output_tokens is the model's 400)
            seat = door.fleet.loaded(body.model)
            context = seat.bound.context if seat is not None and seat.bound is not None \
                else MAX_CONTEXT
            out = min(body.max_output_tokens or DEFAULT_MAX_TOKENS, context) * TOKEN_BYTES \
                + 4096
            own = size_of(self.own)
            adding = (own + out) * (1 + bool(self.conversation) * self.stored) + len(
                body.model_dump_json(exclude={"input"}, exclude_none=True))
            await door.stored(store.check_room, self.parent or self.conversation, adding)

    def body(self, body: ResponsesRequest) -> ResponsesRequest:
        """The request with its whole context as its input."""
        return body.model_copy(update={"input": [InputItem.model_validate(it)
                                                 for it in self.context]})

    def keep(self, door: Door, response: dict[str, Any]) -> None:
        """Keep a finished turn in one store transaction (`Store.put_turn`), on the store's
        thread, in order: a read after the answer sees it. A store that fails is logged
        (and counted): the answer is still given."""
        store = door.store
        if store is None or (not self.stored and self.conversation is None):
            self.ended()
            return
        self.kept = door.store_submit(store.put_turn, response, self.own, stored=self.stored,
                                      parent=self.parent, conversation=self.conversation,
                                      upto=self.upto, owner=self.owner)

        def done(f: Future[None]) -> None:
            if f.exception() is not None:
                log.error("response %s was not stored: %s", response.get("id"), f.exception())
                door.metrics.add(store_errors_total=1)

        self.kept.add_done_callback(done)
        self.ended()

    def ended(self) -> None:
        """The turn is over: release its conversation once its write (if any) is done
        (from any thread)."""
        hold, self.hold = self.hold, None
        if hold is None:
            return
        loop = self.loop

        def release(_: Any = None) -> None:
            loop.call_soon_threadsafe(lambda: loop.create_task(hold.__aexit__(None, None, None)))

        if self.kept is None:
            release()
        else:
            self.kept.add_done_callback(release)


def messages(body: ResponsesRequest) -> tuple[Message, ...]:
    """`instructions` and `input` as the conversation: developer is system, a reasoning item
    is the next assistant turn's reasoning, calls join the assistant turn they follow."""
    out = [Message("system", body.instructions)] if body.instructions else []
    reasoning: str | None = None
    names: dict[str, str] = {}  # call id -> tool name, for the results
    for i, item in enumerate(body.input):
        missing = [f for f in NEEDS.get(item.type, ()) if not getattr(item, f)]
        if missing:
            raise bad_request(f"a {item.type} item needs {' and '.join(missing)}",
                              f"input[{i}].{missing[0]}")
        if item.type == "reasoning":
            reasoning = "".join(p.text for p in item.content or item.summary)
        elif item.type == "function_call":
            call, names[item.call_id] = ToolCall(item.call_id, item.name, item.arguments), item.name
            if out and out[-1].role == "assistant" and reasoning is None:
                out[-1] = replace(out[-1], tool_calls=out[-1].tool_calls + (call,))
            else:
                out.append(Message("assistant", reasoning=reasoning, tool_calls=(call,)))
                reasoning = None
        elif item.type == "function_call_output":
            out.append(Message("tool", "".join(p.text for p in item.output),
                               tool_call_id=item.call_id, name=names.get(item.call_id)))
        else:
            role = "system" if item.role == "developer" else item.role
            mine = reasoning if role == "assistant" else None
            out.append(Message(role, "".join(p.text for p in item.content), mine))
            reasoning = None if role == "assistant" else reasoning
    return tuple(out)


def to_request(body: ResponsesRequest) -> GenerateRequest:
    """A parsed /v1/responses body (its stored context resolved: `Turn.body`) as the neutral
    request (temperature defaults to 1, as OpenAI's does).

    Raises:
        WireError: 400 naming the offending field (an unmodeled one: `UNMODELED`).
    """
    UNMODELED.refuse(body)
    fmt, constraint = body.text.format if body.text else None, None
    if fmt is not None and fmt.type == "json_object":
        constraint = Constraint.json_object()
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise bad_request("json_schema needs a schema", "text.format.schema")
        constraint = Constraint.json_schema(fmt.schema_, lenient=not fmt.strict)
    choice: ToolChoice = (NamedTool(body.tool_choice.name)
                          if isinstance(body.tool_choice, FunctionChoice) else body.tool_choice)
    tools = tuple(tool(t.name, t.description, t.parameters, t.strict) for t in body.tools)
    effort = body.reasoning.effort if body.reasoning else None
    budget = body.max_thinking_tokens
    if effort == "none" and budget is not None:
        raise bad_request("max_thinking_tokens asks for thinking and reasoning.effort 'none' "
                          "turns it off", "reasoning.effort")
    return GenerateRequest(
        messages=messages(body), constraint=constraint, tools=tools, tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        sampling=sampling(body.temperature, body.top_p, body.top_k, body.seed),
        max_tokens=body.max_output_tokens, thinking=effort not in (None, "none") or
        budget is not None, thinking_budget=budget,
        reasoning_effort=effort if effort not in (None, "none") else None,
        template_kwargs=body.chat_template_kwargs or {}, **body.engine_fields())


def head(body: ResponsesRequest, run: Run, turn: Turn) -> dict[str, Any]:
    """The response object's fields that the output does not change (the request echoed)."""
    fmt = body.text.format if body.text and body.text.format else None
    choice = body.tool_choice
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": run.created,
            "model": run.model, "instructions": body.instructions, "error": None,
            "incomplete_details": None, "max_output_tokens": body.max_output_tokens,
            "metadata": (body.model_extra or {}).get("metadata") or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "store": turn.stored,
            "conversation": {"id": turn.conversation} if turn.conversation else None,
            "background": bool(body.background),
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                          "summary": None},
            "temperature": run.request.sampling.temperature, "top_p": run.request.sampling.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                     else {"type": "text"}},
            "tool_choice": choice.model_dump() if isinstance(choice, BaseModel) else choice,
            "tools": [t.model_dump() for t in body.tools], "truncation": "disabled",
            "output": [], "usage": None}


@dataclass
class Writer(Fold):
    """One run's engine events -> the Responses stream's events, numbered; `items` is the
    response's `output` so far (the item being written, `open`, is the last), `final` the
    whole response once it finished."""

    head: dict[str, Any]
    run: Run
    turn: Turn = field(default_factory=Turn)
    door: Door | None = None  # where the finished turn is kept
    items: list[dict[str, Any]] = field(default_factory=list)
    seq: int = 0
    open: dict[str, Any] | None = None
    call: int | None = None  # the open function_call item's ToolCallDelta index
    final: dict[str, Any] | None = None
    carried: int = 0  # output tokens the delta events carried

    @classmethod
    def of(cls, body: ResponsesRequest, run: Run, turn: Turn | None = None,
           door: Door | None = None) -> Writer:
        turn = turn or Turn()
        return cls(head(body, run, turn), run, turn, door)

    def headers(self) -> dict[str, str]:
        # The response's id before its body: a balancer keeps a chain's next turn on the
        # replica that holds its KV state (`previous_response_id`, README "More than one
        # machine").
        return {RESPONSE_ID_HEADER: self.head["id"]}

    def opening(self) -> list[SSEEvent]:
        if self.head["background"]:  # (answered queued; it runs as soon as it is admitted)
            return [self.response("response.created", "queued"),
                    self.response("response.queued", "queued"),
                    self.response("response.in_progress")]
        return [self.response("response.created"), self.response("response.in_progress")]

    def answer(self) -> dict[str, Any]:
        assert self.final is not None, "answered before the run finished"
        return self.final

    def event(self, kind: str, **data: Any) -> SSEEvent:
        self.seq += 1  # data is copied: the items change as text arrives
        return kind, {"type": kind, "sequence_number": self.seq - 1, **copy.deepcopy(data)}

    def response(self, kind: str, status: str = "in_progress", **data: Any) -> SSEEvent:
        return self.event(kind, response={**self.head, "status": status, **data})

    def feed(self, ev: Event) -> list[SSEEvent]:
        if isinstance(ev, ReasoningDelta):
            return self._text("reasoning", ev.text, self._sources(ev))
        if isinstance(ev, TextDelta):
            return self._text("message", ev.text, self._sources(ev))
        if isinstance(ev, ToolCallDelta):
            return self._call(ev)
        return self._finish(ev) if isinstance(ev, Finished) else self._fail(ev)

    def _sources(self, ev: Event) -> dict[str, Any]:
        """A delta event's `token_sources` (the tokens behind it), where asked for."""
        self.carried += len(ev.tokens)  # type: ignore[union-attr]
        srcs = token_sources(self.run, ev.tokens, ev.sources, ev.logprobs)  # type: ignore
        return {} if srcs is None else {"token_sources": srcs}

    def _add(self, item: dict[str, Any]) -> list[SSEEvent]:
        self.items.append(item)
        self.open = item
        return [self.event("response.output_item.added", output_index=len(self.items) - 1,
                           item=item)]

    def _text(self, kind: str, text: str, extra: dict[str, Any] | None = None
              ) -> list[SSEEvent]:
        prefix, item, part, name = KINDS[kind]
        out, at = [], len(self.items) - 1
        if self.open is None or self.open["type"] != kind:
            out, at = self._close("completed"), len(self.items)
            rid = f"{prefix}_{uuid.uuid4().hex}"
            out += self._add({"id": rid, **copy.deepcopy(item), "status": "in_progress"})
            out.append(self.event("response.content_part.added", item_id=rid,
                                  output_index=at, content_index=0, part=part))
            self.items[at]["content"].append(copy.deepcopy(part))
        self.items[at]["content"][0]["text"] += text
        return out + [self.event(f"{name}.delta", item_id=self.items[at]["id"], output_index=at,
                                 content_index=0, delta=text, **_lp(kind), **(extra or {}))
                     ] if text else out

    def _call(self, ev: ToolCallDelta) -> list[SSEEvent]:
        out = []
        if self.call != ev.index:
            out = self._close("completed") + self._add({
                "id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": ev.id,
                "name": ev.name, "arguments": "", "status": "in_progress"})
            self.call = ev.index
        self.items[-1]["arguments"] += ev.arguments
        return out + [self.event("response.function_call_arguments.delta", delta=ev.arguments,
                                 item_id=self.items[-1]["id"], output_index=len(self.items) - 1,
                                 **self._sources(ev))]

    def _close(self, status: str) -> list[SSEEvent]:
        item, at = self.open, len(self.items) - 1
        if item is None:
            return []
        self.open, self.call, item["status"] = None, None, status
        if item["type"] == "function_call":
            out = [self.event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=at, name=item["name"], arguments=item["arguments"])]
        else:
            part = item["content"][0]
            out = [self.event(f"{KINDS[item['type']][3]}.done", item_id=item["id"],
                              output_index=at, content_index=0, text=part["text"],
                              **_lp(item["type"])),
                   self.event("response.content_part.done", item_id=item["id"],
                              output_index=at, content_index=0, part=part)]
        return out + [self.event("response.output_item.done", output_index=at, item=item)]

    def _finish(self, ev: Finished) -> list[SSEEvent]:
        out = self._close("incomplete" if ev.finish_reason == "length" else "completed")
        if ev.finish_reason == "stop" and not any(i["type"] == "message" for i in self.items):
            out += self._text("message", "") + self._close("completed")  # an empty answer
        u = ev.usage
        made = {c.id for c in ev.tool_calls}  # a call cut by max_tokens is not reported
        self.items[:] = [i for i in self.items
                         if i["type"] != "function_call" or i["call_id"] in made]
        ext = extension(self.run, ev.stats, ev.warnings)
        srcs = token_sources(self.run, ev.tokens, ev.sources, ev.logprobs)
        if srcs is not None:
            ext["token_sources"] = srcs
        done = {"output": self.items, "specdec": ext,
                "usage": {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
                          "total_tokens": u.total_tokens,
                          "input_tokens_details": {"cached_tokens": u.cached_tokens,
                                                   "cache_write_tokens": 0},
                          "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens or 0}}}
        if ev.finish_reason == "length":
            last = self.response("response.incomplete", "incomplete", **done,
                                 incomplete_details={"reason": "max_output_tokens"})
        else:
            last = self.response("response.completed", "completed", **done,
                                 completed_at=int(time.time()))
        last[1].update(rest_sources(self.run, ev, self.carried))
        self.final = last[1]["response"]
        if self.door is not None:
            self.turn.keep(self.door, self.final)
        return out + [last]

    def _fail(self, ev: Failed) -> list[SSEEvent]:
        # ResponseError.code is an enum of OpenAI's own codes: ours goes in `specdec`.
        error = {**openai_body(ev.error, PARAMS)["error"], "code": "server_error",
                 "message": message_of(ev.error)}
        out = self._close("incomplete") + [self.response(
            "response.failed", "failed", output=self.items, error=error,
            specdec={"code": ev.error.code})]
        self.final = out[-1][1]["response"]
        return out

    def fail_all(self, message: str) -> list[SSEEvent]:
        """The response failed outside the run (a background response the server
        stopped): its open item closed, `response.failed`."""
        out = self._close("incomplete") + [self.response(
            "response.failed", "failed", output=self.items,
            error={"code": "server_error", "message": message})]
        self.final = out[-1][1]["response"]
        return out

    def cancel(self) -> list[SSEEvent]:
        """A background response cancelled: its open item closed (incomplete), the
        response `cancelled` with what it wrote, and the stream's end as an `error` event
        (code `response_cancelled`: the Responses stream has no cancelled event)."""
        out = self._close("incomplete")
        self.final = {**self.head, "status": "cancelled", "output": self.items}
        return out + [self.event("error", code="response_cancelled", param=None,
                                 message=f"response {self.head['id']} was cancelled")]


RESPONSES: dict[int | str, dict[str, Any]] = {200: {
    "description": "a Response object; with stream: true, its server-sent events "
                   "(response.created ... response.completed / incomplete / failed)",
    "content": {"application/json": {"schema": {"type": "object"}},
                **sse_body("with stream: true: each event named by its type, its `data` the "
                      "event's JSON")}}, **GENERATE_RESPONSES}


def owner_of(http: Request) -> str:
    """Whose stored objects a request sees: its API key's owner (`server.app.Guard`)."""
    return getattr(http.state, "owner", "")


def error(e: SpecdecError, body: ResponsesRequest | None = None) -> JSONResponse:
    return openai_response(e, PARAMS)


def listing(items: list[Item] | None, after: str | None, limit: int, order: str,
            what: str, oid: str, code: str) -> dict[str, Any]:
    """A page of stored items as OpenAI's list object.

    Raises:
        WireError: 404 where the owner is not stored; 400 for an `after` not in the list.
    """
    if items is None:
        raise not_found(what, oid, None, code)
    got = page(items, after, limit, order)
    if got is None:
        raise bad_request(f"after: no item {after!r} in this list", "after")
    return got.wire()


def router(door: Door) -> APIRouter:
    api = APIRouter()
    backgrounds = Backgrounds(door)

    @api.post(PREFIX, response_model=None, responses=RESPONSES)
    async def create(http: Request) -> Response:
        turns: list[Turn] = []

        async def request(body: ResponsesRequest) -> GenerateRequest:
            body.turn = await Turn.of(body, door, owner_of(http))
            turns.append(body.turn)
            resolved = body.turn.prior or any(it.type == "item_reference"
                                              for it in body.input)
            greq = to_request(body.turn.body(body) if resolved else body)
            # A stored turn is one a next turn continues by id: its answer is kept for it.
            return replace(greq, continues=True) if body.turn.stored else greq

        def fold(body: ResponsesRequest, run: Run) -> Writer:
            body.turn.attached = True
            run.on_close.append(body.turn.ended)  # (however the run ends)
            return Writer.of(body, run, body.turn, door)

        async def detach(body: ResponsesRequest, run: Run, out: Fold) -> Response | None:
            if not body.background:
                return None
            assert isinstance(out, Writer)
            return await backgrounds.start(out, run, bool(body.stream))

        try:
            return await door.serve(http, ResponsesRequest, request, fold, error, detach)
        finally:
            for t in turns:
                if not t.attached:  # refused before it ran
                    t.ended()

    async def stored(rid: str, owner: str) -> dict[str, Any]:
        got = await door.stored(door.store.response, rid, owner) \
            if door.store is not None else None
        if got is None:
            raise not_found("response", rid, None, "response_not_found")
        return got

    @api.get(PREFIX + "/{rid}", response_model=None,
             responses={**error_responses(400, 401, 404, 503), **RESPONSES})
    async def retrieve(rid: str, http: Request, stream: bool = False,
                       starting_after: int | None = None) -> Response:
        """A stored response (a background one as it stands now); with stream=true, a
        background response's events after `starting_after`, then live."""
        owner = owner_of(http)
        try:
            job = backgrounds.get(rid, owner)
            got = job.snapshot() if job is not None and not stream else await stored(rid, owner)
            if stream:
                return backgrounds.stream(rid, owner, starting_after, got)
            return JSONResponse(got)
        except SpecdecError as e:
            return error(e)

    @api.post(PREFIX + "/{rid}/cancel", response_model=None,
              responses=error_responses(400, 401, 404, 409, 503))
    async def cancel(rid: str, http: Request) -> Response:
        """Stop a background response (idempotent: one that ended is answered as is)."""
        owner = owner_of(http)
        try:
            now = await backgrounds.cancel(rid, owner)
            if now is None:
                now = await stored(rid, owner)
                elsewhere(rid, now)
                if not now.get("background"):
                    raise bad_request(f"response {rid!r} was not created with background: "
                                      "true; only a background response can be cancelled",
                                      None)
            return JSONResponse(now)
        except SpecdecError as e:
            return error(e)

    @api.delete(PREFIX + "/{rid}", response_model=None,
                responses=error_responses(401, 404, 503))
    async def delete(rid: str, http: Request) -> Response:
        try:
            await backgrounds.cancel(rid, owner_of(http))  # (one running stops first)
            if door.store is None or not await door.stored(door.store.delete_response, rid,
                                                           owner_of(http)):
                return error(not_found("response", rid, None, "response_not_found"))
        except SpecdecError as e:
            return error(e)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    @api.get(PREFIX + "/{rid}/input_items", response_model=None,
             responses=error_responses(400, 401, 404, 503))
    async def input_items(rid: str, http: Request, after: str | None = None,
                          limit: int = Query(20, ge=1, le=100),
                          order: str = Query("desc", pattern="^(asc|desc)$")) -> Response:
        try:
            items = await door.stored(door.store.input_items, rid, owner_of(http)) \
                if door.store is not None else None
            return JSONResponse(listing(items, after, limit, order, "response", rid,
                                        "response_not_found"))
        except SpecdecError as e:
            return error(e)

    return api
