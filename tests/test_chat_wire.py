"""`/v1/chat/completions` and `/v1/completions` wire mapping, in process: the app over the
fake engine (tests/fakeengine.py) that records the `GenerateRequest` it was given and answers
with a scripted event stream. Every response and chunk is validated against the openai SDK's
own types; the SDK's stream helper reads a stream as a client would."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from specdec import request as neutral
from specdec.errors import DeadlineExceeded, RequestError
from specdec.events import (Failed, ReasoningDelta, TextDelta, TokenLogprob, ToolCall,
                            ToolCallDelta)
from specdec.request import Constraint, GenerateRequest, Message, NamedTool
from tests import fakeengine
from tests.fakeengine import finished, raises

MSG = [{"role": "user", "content": "Hi"}]
ANSWER = [TextDelta("Hel"), TextDelta("lo!"), finished("Hello!", warnings=("a warning",))]
THOUGHT = [ReasoningDelta("Let me "), ReasoningDelta("think."), TextDelta("{\"a\": "),
           TextDelta("1}"), finished("{\"a\": 1}", "Let me think.", reasoning_tokens=2)]
CALLS = (ToolCall("call_1", "get_weather", "{\"city\": \"Paris\"}"),
         ToolCall("call_2", "get_weather", "{\"city\": \"Rome\"}"))
CALLED = [ToolCallDelta(0, CALLS[0].id, CALLS[0].name, "{\"city\": "),
          ToolCallDelta(0, CALLS[0].id, CALLS[0].name, "\"Paris\"}"),
          ToolCallDelta(1, CALLS[1].id, CALLS[1].name, CALLS[1].arguments),
          finished(finish="tool_calls", calls=CALLS)]
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
Post = Callable[..., httpx.Response]


@pytest.fixture
def post(fake, fake_app) -> Iterator[Post]:
    """`post(body)` to /v1/chat/completions (or `path`), model "fake" unless given."""
    fake.script = ANSWER  # unless the test scripts otherwise

    def go(body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
        return fakeengine.post(fake_app, path, {"model": "fake", **body})
    yield go


def chunks_of(r: httpx.Response) -> list[dict[str, Any]]:
    """The SSE stream's chunks, each validated as the SDK's ChatCompletionChunk (a usage
    chunk, too); the stream ends with `[DONE]`. An error chunk is returned unvalidated."""
    assert r.headers["content-type"].startswith("text/event-stream")
    blocks = r.text.strip().split("\n\n")
    assert blocks[-1] == "data: [DONE]"
    out = []
    for block in blocks[:-1]:
        data = json.loads(block.removeprefix("data: "))
        if "error" not in data:
            ChatCompletionChunk.model_validate(data)
        out.append(data)
    return out


def deltas(chunks: list[dict[str, Any]], key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


# -- the request ------------------------------------------------------------------------------
def test_text_answer_is_a_valid_chat_completion_with_usage_and_extension(post):
    r = post({"messages": MSG})
    assert r.status_code == 200, r.text
    c = ChatCompletion.model_validate(r.json())
    assert c.id.startswith("chatcmpl-") and c.object == "chat.completion"
    assert c.model == "fake"
    [choice] = c.choices
    assert choice.message.content == "Hello!" and choice.message.role == "assistant"
    assert choice.finish_reason == "stop" and choice.logprobs is None
    assert choice.message.tool_calls is None
    u = c.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (7, 5, 12)
    assert u.completion_tokens_details is None  # not a thinking request
    ext = r.json()["specdec"]
    assert ext["warnings"] == ["a warning"] and ext["seed"] is None
    assert "acceptance_rate" in ext


def test_conversation_maps_to_neutral_turns(post, fake):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    r = post({"messages": [
        {"role": "developer", "content": "Rules."},
        {"role": "system", "content": [{"type": "text", "text": "Be "},
                                       {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "Weather?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [call],
         "reasoning_content": "Call it.", "refusal": None},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.", "reasoning": "Said it."},
        {"role": "user", "content": "Thanks"}]})
    assert r.status_code == 200, r.text
    assert fake.seen[-1].messages == (
        Message("system", "Rules."), Message("system", "Be brief."),
        Message("user", "Weather?", name="ann"),
        Message("assistant", "", "Call it.",
                (neutral.ToolCall("call_1", "get_weather", "{\"city\": \"Paris\"}"),)),
        Message("tool", "sunny", tool_call_id="call_1"),
        Message("assistant", "Sunny.", "Said it."), Message("user", "Thanks"))


def test_sampling_limits_and_extensions_map_to_neutral_fields(post, fake):
    r = post({"messages": MSG, "max_completion_tokens": 9, "max_tokens": 4, "top_p": 0.5,
              "seed": 4, "top_k": 3, "stop": "END", "logit_bias": {"7": -100, "3": 2},
              "num_draft_tokens": 0, "chat_template_kwargs": {"x": 1}})
    assert r.status_code == 200, r.text
    g = fake.seen[-1]
    assert (g.max_tokens, g.sampling.temperature, g.sampling.top_p, g.sampling.top_k,
            g.sampling.seed) == (9, 1.0, 0.5, 3, 4)  # max_completion_tokens wins
    assert g.sampling.logit_bias == ((3, 2.0), (7, -100.0))
    assert g.stop == ("END",) and g.spec is None and g.template_kwargs == {"x": 1}
    assert g.constraint is None and g.tools == () and g.tool_choice == "none"
    assert not g.thinking and g.logprobs is None
    post({"messages": MSG, "temperature": 0, "stop": ["a", "b"], "num_draft_tokens": 2,
          "prompt_lookup": True})
    g = fake.seen[-1]
    assert g.sampling.temperature == 0 and g.stop == ("a", "b")
    assert g.spec == {"k": 2, "lookup": True}


@pytest.mark.parametrize("extra, thinking, effort, kwargs", [
    ({"reasoning_effort": "low"}, True, "low", {}),
    ({"reasoning_effort": "none"}, False, None, {}),
    ({"max_thinking_tokens": 5}, True, None, {}),
    ({"chat_template_kwargs": {"enable_thinking": True, "x": 1}}, True, None, {"x": 1}),
    ({"chat_template_kwargs": {"enable_thinking": False}}, False, None,
     {"enable_thinking": False})])
def test_reasoning_effort_and_template_switches_turn_thinking_on_or_off(
        post, fake, extra, thinking, effort, kwargs):
    r = post({"messages": MSG, **extra})
    assert r.status_code == 200, r.text
    g = fake.seen[-1]
    assert (g.thinking, g.reasoning_effort, g.template_kwargs) == (thinking, effort, kwargs)


@pytest.mark.parametrize("extra, want", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": True}}},
     Constraint.json_schema({"type": "object"}, lenient=False)),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}},
     Constraint.json_schema({"type": "object"}, lenient=True)),
    ({"response_format": {"type": "json_object"}}, Constraint.json_object()),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"regex": "[a-c]{3}"}}, Constraint("regex", "[a-c]{3}")),
    ({"structured_outputs": {"choice": ["red", "blue"]}},
     Constraint("choice", ["red", "blue"])),
    ({"guided_json": {"type": "object"}},
     Constraint.json_schema({"type": "object"}, lenient=True)),
    ({"guided_grammar": "start: \"a\""}, Constraint("grammar", "start: \"a\""))])
def test_response_format_structured_outputs_and_guided_fields_become_the_constraint(
        post, fake, extra, want):
    r = post({"messages": MSG, **extra})
    assert r.status_code == 200, r.text
    assert fake.seen[-1].constraint == want


def test_tools_and_tool_choice_map(post, fake):
    post({"messages": MSG, "tools": [TOOL]})
    g = fake.seen[-1]
    assert g.tool_choice == "auto" and g.parallel_tool_calls  # tools given, no choice
    assert g.tools == (neutral.Tool("get_weather", "Weather.", strict=True,
                                    parameters=TOOL["function"]["parameters"]),)
    post({"messages": MSG, "tools": [TOOL], "parallel_tool_calls": False,
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    g = fake.seen[-1]
    assert g.tool_choice == NamedTool("get_weather") and not g.parallel_tool_calls
    post({"messages": MSG, "tools": [TOOL], "tool_choice": "required"})
    assert fake.seen[-1].tool_choice == "required"


# -- the answer -------------------------------------------------------------------------------
def test_stream_is_role_then_deltas_then_finish_then_usage_then_done(post):
    r = post({"messages": MSG, "stream": True, "stream_options": {"include_usage": True}})
    chunks = chunks_of(r)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"] for c in chunks[1:3]] == [{"content": "Hel"},
                                                               {"content": "lo!"}]
    assert chunks[3]["choices"][0] == {"index": 0, "finish_reason": "stop", "logprobs": None,
                                       "delta": {}}
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["total_tokens"] == 12
    assert chunks[4]["specdec"]["warnings"] == ["a warning"]
    assert len(chunks) == 5 and len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_stream_without_include_usage_has_no_usage_chunk(post):
    chunks = chunks_of(post({"messages": MSG, "stream": True}))
    assert all(c["choices"] for c in chunks) and "usage" not in chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_reasoning_is_reasoning_content_streamed_and_whole(post, fake):
    fake.script = THOUGHT
    msg = post({"messages": MSG, "reasoning_effort": "low"}).json()
    assert msg["choices"][0]["message"]["reasoning_content"] == "Let me think."
    assert msg["choices"][0]["message"]["content"] == "{\"a\": 1}"
    assert msg["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}
    chunks = chunks_of(post({"messages": MSG, "reasoning_effort": "low", "stream": True}))
    assert deltas(chunks, "reasoning_content") == "Let me think."
    assert deltas(chunks, "content") == "{\"a\": 1}"


def test_tool_calls_whole_and_as_deltas_with_id_and_name_on_each_calls_first(post, fake):
    fake.script = CALLED
    whole = ChatCompletion.model_validate(post({"messages": MSG, "tools": [TOOL]}).json())
    [choice] = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.id, c.type, c.function.name, c.function.arguments)
            for c in choice.message.tool_calls] == [
        (c.id, "function", c.name, c.arguments) for c in CALLS]
    chunks = chunks_of(post({"messages": MSG, "tools": [TOOL], "stream": True}))
    calls = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    assert all(d["content"] is None for d in calls)
    assert [d["tool_calls"] for d in calls] == [
        [{"index": 0, "id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": "{\"city\": "}}],
        [{"index": 0, "function": {"arguments": "\"Paris\"}"}}],
        [{"index": 1, "id": "call_2", "type": "function",
          "function": {"name": "get_weather", "arguments": CALLS[1].arguments}}]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_sdk_stream_helper_accumulates_the_calls(fake, fake_app):
    """The openai SDK's `chat.completions.stream` joins our deltas into the same calls."""
    fake.script = CALLED

    async def go() -> Any:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=fake_app))
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http,
                                    max_retries=0)
        async with client.chat.completions.stream(model="fake", messages=MSG,
                                                  tools=[TOOL]) as s:
            return await s.get_final_completion()
    final = asyncio.run(go())
    calls = final.choices[0].message.tool_calls
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        (c.id, c.name, c.arguments) for c in CALLS]
    assert final.choices[0].finish_reason == "tool_calls"


def test_length_finish_is_length_whole_and_streamed(post, fake):
    fake.script = [TextDelta("Hel"), finished("Hel", finish="length")]
    r = post({"messages": MSG, "max_tokens": 1})
    assert r.json()["choices"][0]["finish_reason"] == "length"
    chunks = chunks_of(post({"messages": MSG, "max_tokens": 1, "stream": True}))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


LPS = (TokenLogprob(5, -0.5, ((5, -0.5), (6, -1.5))), TokenLogprob(9, -0.25, ((9, -0.25),)))


def test_logprobs_name_each_token_with_its_bytes_and_alternatives(post, fake):
    fake.script = [TextDelta("<5>", (5,), LPS[:1]), TextDelta("<9>", (9,), LPS[1:]),
                   finished("<5><9>", logprobs=LPS)]
    r = post({"messages": MSG, "logprobs": True, "top_logprobs": 2})
    assert fake.seen[-1].logprobs == 2
    lp = ChatCompletion.model_validate(r.json()).choices[0].logprobs
    assert [(t.token, t.logprob, t.bytes) for t in lp.content] == [
        ("<5>", -0.5, list(b"<5>")), ("<9>", -0.25, list(b"<9>"))]
    assert [(a.token, a.logprob) for a in lp.content[0].top_logprobs] == [
        ("<5>", -0.5), ("<6>", -1.5)]
    chunks = chunks_of(post({"messages": MSG, "logprobs": True, "stream": True}))
    assert [c["choices"][0]["logprobs"]["content"][0]["token"] for c in chunks[1:3]] == [
        "<5>", "<9>"]
    assert fake.seen[-1].logprobs == 0


def test_completions_answer_text_and_logprobs_as_parallel_lists(post, fake):
    fake.script = [TextDelta("<5>", (5,), LPS[:1]), TextDelta("<9>", (9,), LPS[1:]),
                   finished("<5><9>", logprobs=LPS)]
    r = post({"prompt": ["Say"], "logprobs": 2}, "/v1/completions")
    assert r.status_code == 200, r.text
    c = Completion.model_validate(r.json())
    assert c.object == "text_completion" and c.id.startswith("cmpl-")
    assert c.choices[0].text == "<5><9>" and c.choices[0].finish_reason == "stop"
    assert c.choices[0].logprobs.tokens == ["<5>", "<9>"]
    assert c.choices[0].logprobs.text_offset == [0, 3]
    assert c.choices[0].logprobs.top_logprobs == [{"<5>": -0.5, "<6>": -1.5},
                                                  {"<9>": -0.25}]
    g = fake.seen[-1]
    assert g.prompt == "Say" and g.messages == () and g.logprobs == 2  # a batch of one
    r = post({"prompt": [[1, 2, 3]], "stream": True}, "/v1/completions")
    texts = [json.loads(b.removeprefix("data: "))["choices"][0]["text"]
             for b in r.text.strip().split("\n\n")[:-1]]
    assert "".join(texts) == "<5><9>" and fake.seen[-1].prompt == (1, 2, 3)


# -- errors, in OpenAI's shape ----------------------------------------------------------------
def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err  # type: ignore[no-any-return]


@pytest.mark.parametrize("engine_param, extra, wire", [
    ("constraint", {}, "response_format"), ("max_tokens", {}, "max_tokens"),
    ("max_tokens", {"max_completion_tokens": 3}, "max_completion_tokens"),
    ("thinking", {}, "reasoning_effort"), ("messages[0].content", {}, "messages[0].content"),
    ("sampling.top_k", {}, "top_k"), ("spec", {}, "num_draft_tokens"),
    ("logprobs", {}, "top_logprobs")])
def test_engine_errors_name_chats_fields(post, fake, engine_param, extra, wire):
    fake.script = raises(engine_param)
    err = error_of(post({"messages": MSG, **extra}), 400)
    assert err["param"] == wire and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("engine_param, wire", [
    ("messages", "prompt"), ("constraint", "structured_outputs"), ("logprobs", "logprobs")])
def test_engine_errors_name_completions_fields(post, fake, engine_param, wire):
    fake.script = raises(engine_param)
    assert error_of(post({"prompt": "x"}, "/v1/completions"), 400)["param"] == wire


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": 1}]}, "messages[0].content"),
    ({"messages": MSG, "temperature": "1"}, "temperature"),
    ({"messages": MSG, "n": 2}, "n"),
    ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MSG, "tool_choice": "required"}, "tools"),
    ({"messages": MSG, "logit_bias": {"x": 1}}, "logit_bias"),
    ({"messages": MSG, "reasoning_effort": "none", "max_thinking_tokens": 4},
     "reasoning_effort"),
    ({"messages": MSG, "guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ({"messages": MSG, "response_format": {"type": "json_object"},
      "structured_outputs": {"regex": "a"}}, "structured_outputs")])
def test_bad_requests_are_400s_naming_the_field(post, fake, body, param):
    err = error_of(post(body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert fake.seen == []


def test_failure_without_stream_is_an_error_status(post, fake):
    fake.script = [Failed(DeadlineExceeded("too slow"))]
    err = error_of(post({"messages": MSG}), 504)
    assert err["code"] == "timeout" and "too slow" in err["message"]


def test_failure_mid_stream_is_an_error_chunk_before_done(post, fake):
    fake.script = [TextDelta("Hel"), Failed(RequestError("the grammar broke",
                                                         code="grammar_state"))]
    chunks = chunks_of(post({"messages": MSG, "stream": True}))
    assert deltas(chunks[:-1], "content") == "Hel"
    err = chunks[-1]["error"]
    assert err["code"] == "grammar_state" and err["type"] == "invalid_request_error"


def test_unknown_model_is_a_404(post):
    err = error_of(post({"model": "gpt-4o", "messages": MSG}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"


# -- fields the models do not name: one policy (`door.Unmodeled`) ------------------------------
@pytest.mark.parametrize("param, value", [
    ("presence_penalty", 0.5), ("frequency_penalty", 1),
    ("repetition_penalty", 1.1), ("min_p", 0.1), ("functions", [TOOL["function"]]),
    ("function_call", "auto"), ("verbosity", "high"), ("web_search_options", {}),
    ("prediction", {"type": "content", "content": "x"}), ("modalities", ["audio"]),
    ("grammar", 'start: "a"'),  # llama.cpp's top-level field: ours is structured_outputs
    ("frobnicate", 1), ("ignore_eos", False)])
def test_a_parameter_we_do_not_implement_is_a_400_naming_it(post, fake, param, value):
    err = error_of(post({"messages": MSG, param: value}), 400)
    assert err["param"] == param and err["code"] == "unsupported_parameter"
    assert fake.seen == []
    if param == "grammar":
        assert "structured_outputs" in err["message"]


@pytest.mark.parametrize("extra", [
    {"presence_penalty": 0}, {"frequency_penalty": 0.0}, {"functions": []},
    {"function_call": "none"}, {"verbosity": "medium"}, {"modalities": ["text"]},
    {"prediction": None}, {"n": 1}, {"logprobs": False}, {"logit_bias": {}},
    {"tools": [TOOL], "tool_choice": "none"}, {"tools": []}])
def test_no_op_values_of_those_parameters_make_the_same_request(post, fake, extra):
    assert post({"messages": MSG, **extra}).status_code == 200
    assert post({"messages": MSG}).status_code == 200
    with_it, plain = fake.seen[-2:]
    if "tools" in extra:
        with_it = GenerateRequest(**{**with_it.__dict__, "tools": ()})
    assert with_it == plain


def test_fields_clients_send_that_cannot_change_the_answer_are_accepted(post, fake):
    sent = {"metadata": {"k": "v"}, "user": "u", "store": True, "service_tier": "auto",
            "safety_identifier": "s", "prompt_cache_key": "k",
            "prompt_cache_retention": "24h", "prompt_cache_options": {},
            "stream_options": {"include_usage": False}}
    assert post({"messages": MSG, **sent}).status_code == 200
    assert post({"messages": MSG}).status_code == 200
    with_them, plain = fake.seen[-2:]
    # prompt_cache_key only picks the prompt store's partition (`door.cache_scope`)
    assert with_them.cache_scope == "\x1fk" and plain.cache_scope == ""
    assert replace(with_them, cache_scope="") == plain


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [TOOL]}, "tools"), ({"messages": MSG}, "messages"),
    ({"chat_template_kwargs": {}}, "chat_template_kwargs"), ({"echo": True}, "echo")])
def test_completions_refuse_what_is_not_theirs_by_name(post, fake, body, param):
    err = error_of(post({"prompt": "x", **body}, "/v1/completions"), 400)
    assert err["param"] == param and err["code"] == "unsupported_parameter"
    assert fake.seen == []
