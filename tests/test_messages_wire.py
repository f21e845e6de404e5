"""Anthropic Messages wire logic, in process: the official `anthropic` client over an ASGI
transport against the app, with the fake engine (tests/fakeengine.py) that records the
neutral request it was given and emits a scripted event stream (no model, no subprocess)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import anthropic
import httpx2
import pytest
from fastapi import FastAPI

from server import messages
from server.app import create_app
from server.door import ServeConfig
from specdec.errors import RequestError
from specdec.events import (Event, Failed, Finished, ReasoningDelta, TextDelta, ToolCall,
                            ToolCallDelta)
from specdec.grammar import Constraint
from specdec.request import GenerateRequest, NamedTool
from tests import fakeengine
from tests.fakeengine import PROMPT, FakeEngine


def finished(reason: str = "stop", text: str = "", reasoning: str | None = None,
             calls: tuple[ToolCall, ...] = (), n: int = 3, **extra: Any) -> Finished:
    return fakeengine.finished(text, reasoning, reason, calls, prompt_tokens=len(PROMPT),
                               completion_tokens=n, seed=None,
                               reasoning_tokens=None if reasoning is None else 1, **extra)


def engine_for(script: fakeengine.Script) -> FakeEngine:
    return FakeEngine(script, name="fake-model")


def app_for(engine: FakeEngine) -> FastAPI:
    """The app (every API, as `specdec serve` mounts them) over the fake engine."""
    return create_app(engine, ServeConfig())  # type: ignore[arg-type]


def call(script: list[Event], fn: Callable[[anthropic.AsyncAnthropic], Any]
         ) -> tuple[Any, FakeEngine]:
    engine = engine_for(script)
    app = app_for(engine)
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                              base_url="http://test")
    client = anthropic.AsyncAnthropic(api_key="k", base_url="http://test", http_client=http,
                                      max_retries=0)
    try:
        return asyncio.run(fn(client)), engine
    finally:
        app.state.door.close()


def raw(body: dict[str, Any], path: str = "/v1/messages") -> tuple[int, Any, FakeEngine]:
    engine = engine_for([finished(text="ok")])
    app = app_for(engine)

    async def go() -> httpx2.Response:
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                      base_url="http://test") as c:
            return await c.post(path, json=body)

    try:
        r = asyncio.run(go())
    finally:
        app.state.door.close()
    return r.status_code, r.json(), engine


ASK = [{"role": "user", "content": "q"}]
BASE = {"model": "fake-model", "max_tokens": 16, "messages": ASK}
THOUGHT_AND_ANSWER = [ReasoningDelta("Let me "), ReasoningDelta("think."),
                      TextDelta("Hello"), TextDelta(" there"),
                      finished(text="Hello there", reasoning="Let me think.")]
CALL = ToolCall("call_abc", "get_weather", '{"city": "Paris"}')


def test_stream_event_order_and_assembly_equal_the_whole_message():
    async def go(c: anthropic.AsyncAnthropic) -> Any:
        kw: dict[str, Any] = dict(model="fake-model", max_tokens=16, messages=ASK,
                                  thinking={"type": "enabled", "budget_tokens": 8})
        whole = await c.messages.create(**kw)
        async with c.messages.stream(**kw) as s:
            names = [ev.type async for ev in s]
            final = await s.get_final_message()
        return whole, names, final

    (whole, names, final), _ = call(THOUGHT_AND_ANSWER, go)
    core = [n for n in names if n not in ("text", "thinking", "signature")]
    assert core == ["message_start",
                    "content_block_start", "content_block_delta", "content_block_delta",
                    "content_block_delta", "content_block_stop",  # + signature_delta
                    "content_block_start", "content_block_delta", "content_block_delta",
                    "content_block_stop", "message_delta", "message_stop"]
    for m in (whole, final):
        assert [b.type for b in m.content] == ["thinking", "text"]
        assert m.content[0].thinking == "Let me think." and m.content[0].signature == ""
        assert m.content[1].text == "Hello there"
        assert m.stop_reason == "end_turn" and m.stop_sequence is None
        assert (m.usage.input_tokens, m.usage.output_tokens) == (len(PROMPT), 3)
    assert whole.id.startswith("msg_") and whole.model == "fake-model"


def test_tool_call_is_a_tool_use_block_with_an_input_object():
    script = [ToolCallDelta(0, CALL.id, CALL.name, CALL.arguments),
              finished("tool_calls", calls=(CALL,))]

    async def go(c: anthropic.AsyncAnthropic) -> Any:
        kw: dict[str, Any] = dict(model="fake-model", max_tokens=16, messages=ASK,
                                  tools=[{"name": "get_weather",
                                          "input_schema": {"type": "object"}}],
                                  tool_choice={"type": "any"})
        whole = await c.messages.create(**kw)
        async with c.messages.stream(**kw) as s:
            final = await s.get_final_message()
        return whole, final

    (whole, final), engine = call(script, go)
    for m in (whole, final):
        (block,) = m.content
        assert block.type == "tool_use" and block.id == "toolu_abc"
        assert block.name == "get_weather" and block.input == {"city": "Paris"}
        assert m.stop_reason == "tool_use"
    assert engine.seen[0].tool_choice == "required"


def test_a_call_cut_by_max_tokens_is_not_a_tool_use_block():
    script = [ToolCallDelta(0, CALL.id, CALL.name, '{"city": "Pa'), finished("length")]

    async def go(c: anthropic.AsyncAnthropic) -> Any:
        return await c.messages.create(
            model="fake-model", max_tokens=16, messages=ASK, tool_choice={"type": "any"},
            tools=[{"name": "get_weather", "input_schema": {"type": "object"}}])

    whole, _ = call(script, go)
    assert whole.content == [] and whole.stop_reason == "max_tokens"


@pytest.mark.parametrize("finish, extra, want", [
    ("length", {}, ("max_tokens", None)),
    ("stop", {"stop_sequence": "END"}, ("stop_sequence", "END")),
])
def test_stop_reasons(finish, extra, want):
    async def go(c: anthropic.AsyncAnthropic) -> Any:
        return await c.messages.create(model="fake-model", max_tokens=3,
                                       messages=[{"role": "user", "content": "q"}],
                                       stop_sequences=["END"])

    m, engine = call([TextDelta("a b"), finished(finish, text="a b", **extra)], go)
    assert (m.stop_reason, m.stop_sequence) == want
    assert engine.seen[0].stop == ("END",)


def test_failure_mid_stream_is_an_error_event():
    script = [TextDelta("par"), Failed(RequestError("the grammar broke", code="grammar_state"))]

    async def go(c: anthropic.AsyncAnthropic) -> Any:
        async with c.messages.stream(model="fake-model", max_tokens=3,
                                     messages=[{"role": "user", "content": "q"}]) as s:
            with pytest.raises(anthropic.APIStatusError) as e:
                async for _ in s:
                    pass
        return e.value.body

    body, _ = call(script, go)
    assert body["type"] == "error" and body["error"]["code"] == "grammar_state"


def test_history_blocks_map_onto_the_neutral_conversation():
    body = messages.MessagesBody.model_validate({
        **BASE, "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather?",
                                          "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Call it.", "signature": "sig"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "And tomorrow?"}]}]})
    msgs = messages.to_request(body).messages
    assert [(m.role, m.content) for m in msgs] == [
        ("system", "Be brief."), ("user", "Weather?"), ("assistant", ""),
        ("tool", "sunny"), ("user", "And tomorrow?")]
    assert msgs[2].reasoning == "Call it."
    # ids as the engine wrote them (`toolu_` is Anthropic's spelling of ours)
    assert [(c.id, c.name, json.loads(c.arguments)) for c in msgs[2].tool_calls] == [
        ("1", "get_weather", {"city": "Paris"})]
    assert (msgs[3].tool_call_id, msgs[3].name) == ("1", "get_weather")


@pytest.mark.parametrize("extra, check", [
    ({}, lambda r: r.sampling.temperature == 1.0 and r.tool_choice == "auto"
     and not r.thinking and r.spec == "default"),
    ({"temperature": 0, "top_k": 5, "top_p": 0.5, "seed": 7},
     lambda r: (r.sampling.temperature, r.sampling.top_k, r.sampling.top_p,
                r.sampling.seed) == (0, 5, 0.5, 7)),
    ({"thinking": {"type": "enabled", "budget_tokens": 64}},
     lambda r: r.thinking and r.thinking_budget == 64),
    ({"thinking": {"type": "disabled"}}, lambda r: not r.thinking),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True}},
     lambda r: r.tool_choice == NamedTool("f") and not r.parallel_tool_calls
     and r.tools[0].parameters == {"type": "object"}),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "none"}}, lambda r: r.tool_choice == "none"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}},
                        "effort": "low"}},
     lambda r: r.constraint == Constraint.json_schema({"type": "object"}, lenient=False)
     and r.reasoning_effort == "low"),
    ({"output_format": {"type": "json_schema", "schema": {"type": "object"}}},
     lambda r: r.constraint == Constraint.json_schema({"type": "object"}, lenient=False)),
    ({"num_draft_tokens": 0}, lambda r: r.spec is None),
    ({"num_draft_tokens": 2, "prompt_lookup": True},
     lambda r: r.spec == {"k": 2, "lookup": True}),
    ({"metadata": {"user_id": "u"}, "service_tier": "auto", "speed": "standard",
      "cache_control": {"type": "ephemeral"}, "inference_geo": "us"}, lambda r: True),
])
def test_body_fields_map_onto_the_neutral_request(extra, check):
    status, out, engine = raw({**BASE, **extra})
    assert status == 200, out
    assert check(engine.seen[0])


@pytest.mark.parametrize("body, names", [
    ({k: v for k, v in BASE.items() if k != "max_tokens"}, "max_tokens"),
    ({**BASE, "frequency_penalty": 1}, "frequency_penalty"),
    ({**BASE, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]}, "'image'"),
    ({**BASE, "messages": [{"role": "user", "content": "q"}, {"role": "assistant",
      "content": [{"type": "redacted_thinking", "data": "x"}]},
      {"role": "user", "content": "q"}]}, "'redacted_thinking'"),
    ({**BASE, "messages": [{"role": "user", "content": "q"},
                           {"role": "assistant", "content": "The answer is"}]}, "prefill"),
    ({**BASE, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ({**BASE, "thinking": {"type": "enabled"}}, "budget_tokens"),
    ({**BASE, "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({**BASE, "temperature": 1.5}, "temperature"),
    ({**BASE, "output_format": {"type": "json_schema", "schema": {}},
      "output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_format"),
])
def test_refused_bodies_are_400s_in_anthropics_shape(body, names):
    status, out, engine = raw(body)
    assert status == 400 and out["type"] == "error", out
    assert out["error"]["type"] == "invalid_request_error"
    assert names in out["error"]["message"], out
    assert engine.seen == []


def test_engine_errors_name_anthropics_fields():
    def refuse(greq: GenerateRequest) -> list[Event]:
        raise RequestError("stop strings must be non-empty strings", param="stop")

    app = app_for(engine_for(refuse))

    async def go() -> httpx2.Response:
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                      base_url="http://test") as c:
            return await c.post("/v1/messages", json={**BASE, "stop_sequences": [""]})

    r = asyncio.run(go())
    app.state.door.close()
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("stop_sequences: ")


def test_count_tokens_counts_the_prepared_prompt():
    async def go(c: anthropic.AsyncAnthropic) -> Any:
        return await c.messages.count_tokens(
            model="fake-model", messages=[{"role": "user", "content": "q"}],
            tools=[{"name": "f", "input_schema": {"type": "object"}}])

    n, engine = call([], go)
    assert n.input_tokens == len(PROMPT)
    assert engine.seen[0].tools and engine.seen[0].max_tokens is None


def test_omitted_thinking_sends_the_block_without_its_text():
    async def go(c: anthropic.AsyncAnthropic) -> Any:
        kw: dict[str, Any] = dict(model="fake-model", max_tokens=16, messages=ASK, thinking={
            "type": "enabled", "budget_tokens": 8, "display": "omitted"})
        whole = await c.messages.create(**kw)
        async with c.messages.stream(**kw) as s:
            final = await s.get_final_message()
        return whole, final

    (whole, final), _ = call(THOUGHT_AND_ANSWER, go)
    for m in (whole, final):
        assert [(b.type, getattr(b, "thinking", None)) for b in m.content] == [
            ("thinking", ""), ("text", None)]
