"""`/v1/responses` wire mapping, in process: the app over the fake engine
(tests/fakeengine.py) that records the `GenerateRequest` it was given and answers with a
scripted event stream. Every response and stream event is validated against the openai SDK's
own types; the SDK's stream helper reads the stream as a client would."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from specdec import request as neutral
from specdec.errors import DeadlineExceeded
from specdec.events import (Failed, Finished, ReasoningDelta, TextDelta, ToolCall,
                            ToolCallDelta)
from specdec.request import Message, NamedTool
from tests import fakeengine
from tests.fakeengine import raises

STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


def finished(text: str = "", reasoning: str | None = None, finish: str = "stop",
             calls: tuple[ToolCall, ...] = ()) -> Finished:
    return fakeengine.finished(text, reasoning, finish, calls, warnings=("a warning",),
                               reasoning_tokens=2 if reasoning is not None else None)


ANSWER = [TextDelta("Hel"), TextDelta("lo!"), finished("Hello!")]
THOUGHT = [ReasoningDelta("Let me "), ReasoningDelta("think."), TextDelta("{\"a\": "),
           TextDelta("1}"), finished("{\"a\": 1}", "Let me think.")]
CALL = ToolCall("call_1", "get_weather", "{\"city\": \"Paris\"}")
CALLED = [ToolCallDelta(0, CALL.id, CALL.name, CALL.arguments),
          finished(finish="tool_calls", calls=(CALL,))]


@pytest.fixture
def post(fake, fake_app) -> Iterator[Callable[[dict[str, Any]], httpx.Response]]:
    fake.script = ANSWER  # unless the test scripts otherwise
    yield lambda body: fakeengine.post(fake_app, "/v1/responses", {"model": "fake", **body})


def events_of(r: httpx.Response) -> list[dict[str, Any]]:
    """The SSE stream's events, each checked: `event:` equals the data's type, and the data
    validates as the SDK's ResponseStreamEvent."""
    out = []
    for block in r.text.strip().split("\n\n"):
        head, data = block.split("\n")
        ev = json.loads(data.removeprefix("data: "))
        assert head == f"event: {ev['type']}"
        STREAM_EVENT.validate_python(ev)
        out.append(ev)
    return out


def test_text_answer_is_a_valid_response_with_usage_and_extension(post):
    r = post({"input": "Hi", "instructions": "Be brief."})
    assert r.status_code == 200, r.text
    resp = Response.model_validate(r.json())
    assert resp.status == "completed" and resp.output_text == "Hello!"
    assert [i.type for i in resp.output] == ["message"]
    assert resp.output[0].status == "completed"
    u = resp.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (7, 5, 12)
    assert u.output_tokens_details.reasoning_tokens == 0
    assert u.input_tokens_details.cached_tokens == 0
    ext = r.json()["specdec"]
    assert ext["warnings"] == ["a warning"] and "acceptance_rate" in ext
    assert r.json()["store"] is True  # absent: stored, as OpenAI does


def test_request_maps_to_neutral_fields(post, fake):
    r = post({"input": [{"role": "developer", "content": "Rules."},
                        {"role": "user", "content": [{"type": "input_text", "text": "A"},
                                                     {"type": "input_text", "text": "B"}]}],
              "instructions": "Sys.", "max_output_tokens": 9, "top_p": 0.5, "seed": 4,
              "top_k": 3, "num_draft_tokens": 0, "max_thinking_tokens": 5,
              "chat_template_kwargs": {"x": 1}, "metadata": {"k": "v"}, "user": "u",
              "store": False, "include": [], "service_tier": "auto"})
    assert r.status_code == 200, r.text
    g = fake.seen[-1]
    assert g.messages == (Message("system", "Sys."), Message("system", "Rules."),
                          Message("user", "AB"))
    assert (g.max_tokens, g.sampling.temperature, g.sampling.top_p, g.sampling.top_k,
            g.sampling.seed) == (9, 1.0, 0.5, 3, 4)
    assert g.spec is None and g.thinking and g.thinking_budget == 5
    assert g.template_kwargs == {"x": 1} and r.json()["metadata"] == {"k": "v"}


def test_history_items_map_to_turns_with_reasoning_and_calls(post, fake):
    post({"input": [
        {"type": "message", "role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Two calls."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": "{\"city\": \"Paris\"}", "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather",
         "arguments": "{\"city\": \"Rome\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Sunny and rain.", "annotations": []}]},
        {"role": "user", "content": "Thanks"}]})
    calls = (neutral.ToolCall("c1", "get_weather", "{\"city\": \"Paris\"}"),
             neutral.ToolCall("c2", "get_weather", "{\"city\": \"Rome\"}"))
    assert fake.seen[-1].messages == (
        Message("user", "Weather in Paris and Rome?"),
        Message("assistant", "", "Two calls.", calls),
        Message("tool", "sunny", tool_call_id="c1", name="get_weather"),
        Message("tool", "rain", tool_call_id="c2", name="get_weather"),
        Message("assistant", "Sunny and rain."), Message("user", "Thanks"))


@pytest.mark.parametrize("fmt, kind, lenient", [
    ({"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True},
     "json_schema", False),
    ({"type": "json_schema", "name": "x", "schema": {"type": "object"}}, "json_schema", True),
    ({"type": "json_object"}, "json_object", False), ({"type": "text"}, None, None)])
def test_text_format_becomes_the_constraint(post, fake, fmt, kind, lenient):
    r = post({"input": "Hi", "text": {"format": fmt}})
    assert r.status_code == 200, r.text
    c = fake.seen[-1].constraint
    assert (c.kind if c else None) == kind and (c.lenient if c else None) == lenient
    assert r.json()["text"]["format"]["type"] == fmt["type"]


@pytest.mark.parametrize("effort, thinking", [("low", True), ("high", True), ("none", False),
                                              (None, False)])
def test_reasoning_effort_turns_thinking_on_except_none(post, fake, effort, thinking):
    post({"input": "Hi", "reasoning": {"effort": effort, "summary": "auto"}})
    g = fake.seen[-1]
    # "none" is not passed on to the template: as on Chat Completions, it only turns thinking
    # off (the same request renders the same prompt on both APIs).
    assert (g.thinking, g.reasoning_effort) == (thinking, effort if thinking else None)


def test_function_tools_and_tool_choice_map(post, fake):
    fake.script = lambda g: CALLED
    tool = {"type": "function", "name": "get_weather", "description": "Weather.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            "strict": True}
    r = post({"input": "Weather?", "tools": [tool],
              "tool_choice": {"type": "function", "name": "get_weather"},
              "parallel_tool_calls": False})
    g = fake.seen[-1]
    assert g.tool_choice == NamedTool("get_weather") and not g.parallel_tool_calls
    assert g.tools[0].strict and g.tools[0].parameters == tool["parameters"]
    resp = Response.model_validate(r.json())
    [item] = resp.output
    assert item.type == "function_call" and item.status == "completed"
    assert (item.call_id, item.name, item.arguments) == (CALL.id, CALL.name, CALL.arguments)
    assert resp.output_text == ""


def stream_order(events: list[dict[str, Any]]) -> list[str]:
    """Event types with runs of one delta type collapsed."""
    out: list[str] = []
    for ev in events:
        if not (out and out[-1] == ev["type"] and ev["type"].endswith(".delta")):
            out.append(ev["type"])
    return out


def test_stream_has_the_responses_event_sequence_and_joins_to_the_final_text(post, fake):
    fake.script = lambda g: THOUGHT
    events = events_of(post({"input": "Hi", "stream": True}))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert stream_order(events) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    final = Response.model_validate(events[-1]["response"])
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    thought = "".join(e["delta"] for e in events
                      if e["type"] == "response.reasoning_text.delta")
    assert text == final.output_text == "{\"a\": 1}"
    assert thought == final.output[0].content[0].text == "Let me think."
    assert final.usage.output_tokens_details.reasoning_tokens == 2
    ids = {e["response"]["id"] for e in events if "response" in e}
    assert len(ids) == 1


def test_stream_and_plain_response_have_the_same_output(post, fake):
    fake.script = lambda g: THOUGHT
    plain = post({"input": "Hi"}).json()
    streamed = events_of(post({"input": "Hi", "stream": True}))[-1]["response"]
    strip = lambda r: [{k: v for k, v in i.items() if k != "id"} for i in r["output"]]  # noqa
    assert strip(plain) == strip(streamed)
    assert plain["output"][0]["type"] == "reasoning"


def test_stream_of_a_call_has_argument_events(post, fake):
    fake.script = lambda g: CALLED
    tool = {"type": "function", "name": "get_weather", "parameters": None, "strict": None}
    events = events_of(post({"input": "W?", "tools": [tool], "tool_choice": "required",
                             "stream": True}))
    assert stream_order(events)[2:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert events[-2]["item"]["arguments"] == CALL.arguments


def test_sdk_stream_helper_reads_the_stream(fake, fake_app):
    """The openai SDK's `responses.stream` accumulates our events (it checks identities and
    item order) into the same final response."""
    fake.script = lambda g: THOUGHT
    app = fake_app

    async def go() -> tuple[list[str], Any]:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http)
        async with client.responses.stream(model="fake", input="Hi") as s:
            kinds = [ev.type async for ev in s]
            return kinds, await s.get_final_response()
    kinds, final = asyncio.run(go())
    assert kinds[-1] == "response.completed" and final.output_text == "{\"a\": 1}"


def test_length_finish_is_incomplete_max_output_tokens(post, fake):
    fake.script = lambda g: [TextDelta("Hel"), finished("Hel", finish="length")]
    resp = Response.model_validate(post({"input": "Hi"}).json())
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete"
    events = events_of(post({"input": "Hi", "stream": True}))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-2]["item"]["status"] == "incomplete"


def test_failure_mid_stream_is_response_failed(post, fake):
    fake.script = lambda g: [TextDelta("Hel"), Failed(DeadlineExceeded("too slow"))]
    events = events_of(post({"input": "Hi", "stream": True}))
    last = events[-1]
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert last["response"]["error"]["code"] == "server_error"
    assert "too slow" in last["response"]["error"]["message"]


def test_failure_without_stream_is_an_error_status(post, fake):
    fake.script = lambda g: [Failed(DeadlineExceeded("too slow"))]
    r = post({"input": "Hi"})
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"


@pytest.mark.parametrize("engine_param, wire", [
    ("constraint", "text.format"), ("max_tokens", "max_output_tokens"),
    ("thinking", "reasoning"), ("messages", "input"), ("sampling.top_k", "top_k"),
    ("spec", "num_draft_tokens")])
def test_engine_errors_name_this_apis_fields(post, fake, engine_param, wire):
    fake.script = raises(engine_param)
    r = post({"input": "Hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == wire


@pytest.mark.parametrize("extra, param", [
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"), (
        {"background": True, "store": False}, "background"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"frobnicate": 1}, "frobnicate"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference"}]}, "input[0].id"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"verbosity": "high"}}, "text.verbosity"),
    ({"temperature": -1}, "temperature")])
def test_unsupported_fields_are_a_400_naming_them(post, extra, param):
    r = post({"input": "Hi", **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if param == "tools[0].type":
        assert "web_search" in err["message"]


def test_unknown_model_is_a_404(post):
    r = post({"model": "gpt-4o", "input": "Hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


