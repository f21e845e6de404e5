"""Ways into the server that real clients take, over real HTTP (`specdec serve` on
loopback, with an API key): user text in headers, grammars that match nothing, hostile JSON
bodies, chunked bodies, the API key on every non-health path, no-op values of parameters we
do not implement, vLLM's `guided_*` fields, content parts and roles, integers written as
floats, tools and tool choices, logit_bias. After every bad request the server keeps serving.
(What one request maps to, in process: test_chat_wire.py.)"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serverproc import error_of

KEY = "requests-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server_args():
    return ("--api-key", KEY)


def post(server, body, path="/v1/chat/completions", **kw):
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=300, **kw)


def ok_after(server):
    r = post(server, {"messages": MSG, "max_tokens": 3})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_user_text_in_the_warning_header_is_escaped(server, stream):
    # A lenient schema's warning quotes the schema's own text: a non-Latin-1 character and
    # a newline must neither fail the response nor break the header.
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "dâte\nπ"}},
              "required": ["d"]}
    body = {"messages": MSG, "max_tokens": 8, "stream": stream, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH,
                      timeout=300) as r:
        text = r.read().decode()
        assert r.status_code == 200, text
        header = r.headers["warning"]
    assert header.isascii() and "\n" not in header and "d\\u00e2te\\n\\u03c0" in header
    if not stream:
        assert any("dâte\nπ" in w for w in json.loads(text)["specdec"]["warnings"])
    ok_after(server)


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_matches_nothing_is_a_400(server, stream):
    body = {"messages": MSG, "max_tokens": 4, "stream": stream,
            "structured_outputs": {"regex": "[^\\s\\S]"}}
    err = error_of(post(server, body), 400, "response_format")
    assert err["code"] == "invalid_grammar" and "matches no text" in err["message"]
    ok_after(server)


@pytest.mark.parametrize("raw", [
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}",
    b"[" * 100_000 + b"]" * 100_000,
    json.dumps({"messages": MSG, "x": json.loads("[" * 300 + "]" * 300)}).encode(),
    b'{"messages": "\xff\xfe"}',
])
def test_hostile_json_bodies_are_a_400(server, raw):
    r = httpx.post(server.url + "/v1/chat/completions", content=raw,
                   headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    ok_after(server)


def test_a_chunked_body_over_the_limit_is_cut_off_with_a_413(server):
    def chunks():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"a" * (1 << 20)
        yield b'"}]}'

    r = httpx.post(server.url + "/v1/chat/completions", content=chunks(),
                   headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert "content-length" not in {k.lower() for k in r.request.headers}
    error_of(r, 413)
    ok_after(server)


@pytest.mark.parametrize("path", ["/metrics", "/docs", "/openapi.json", "/v1/models"])
def test_the_api_key_guards_everything_but_health(server, path):
    error_of(httpx.get(server.url + path, timeout=30), 401)
    error_of(httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"},
                       timeout=30), 401)
    assert httpx.get(server.url + path, headers=AUTH, timeout=30).status_code == 200
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("extra", [
    {"logprobs": False}, {"presence_penalty": 0}, {"frequency_penalty": 0.0},
    {"logit_bias": {}}, {"tools": [TOOL], "tool_choice": "none"}, {"tools": []},
])
def test_no_op_values_of_those_parameters_are_accepted(server, extra):
    r = post(server, {"messages": MSG, "max_tokens": 3, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    plain = post(server, {"messages": MSG, "max_tokens": 3, "temperature": 0})
    assert r.json()["choices"][0]["message"]["content"] == \
        plain.json()["choices"][0]["message"]["content"]


def test_vllm_guided_fields_constrain_the_output(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = post(server, {"messages": MSG, "max_tokens": 30, "guided_json": schema})
    assert r.status_code == 200, r.text
    assert set(json.loads(r.json()["choices"][0]["message"]["content"])) == {"n"}
    r = post(server, {"messages": MSG, "max_tokens": 10, "guided_choice": ["red", "blue"]})
    assert r.json()["choices"][0]["message"]["content"] in ("red", "blue")
    r = post(server, {"messages": MSG, "max_tokens": 10, "guided_regex": "[a-c]{3}"})
    assert len(r.json()["choices"][0]["message"]["content"]) == 3
    r = post(server, {"prompt": "Colour:", "max_tokens": 10, "guided_choice": ["red", "blue"]},
             path="/v1/completions")
    assert r.json()["choices"][0]["text"] in ("red", "blue")
    error_of(post(server, {"messages": MSG, "guided_regex": "a", "guided_choice": ["a"]}), 400)


def test_content_parts_and_null_assistant_content_are_accepted(server):
    as_text = post(server, {"messages": [{"role": "user", "content": "Say hi twice."}],
                            "max_tokens": 6, "temperature": 0})
    as_parts = post(server, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Say hi"}, {"type": "text", "text": " twice."}]}],
        "max_tokens": 6, "temperature": 0})
    assert as_parts.status_code == 200, as_parts.text
    assert as_parts.json()["choices"][0]["message"]["content"] == \
        as_text.json()["choices"][0]["message"]["content"]
    r = post(server, {"messages": [{"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": None},
                                   {"role": "developer", "content": "Be brief."},
                                   {"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("messages,param", [
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    # A call in the history whose arguments are not a JSON object (an engine 400 naming it).
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1"}}]}],
     "messages[1]"),
])
def test_bad_messages_are_a_400_naming_the_message(server, messages, param):
    r = post(server, {"messages": messages, "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok_after(server)


def test_integers_written_as_floats_are_integers_and_fractions_are_a_400(server):
    # JSON Schema's integer includes 3.0 (the OpenAPI document says integer; generators and
    # some clients write it so). 3.5 is not one.
    as_int = post(server, {"prompt": [504, 3145], "max_tokens": 3, "temperature": 0},
                  path="/v1/completions")
    as_float = post(server, {"prompt": [504.0, 3145.0], "max_tokens": 3.0, "temperature": 0,
                             "seed": 7.0}, path="/v1/completions")
    assert as_float.status_code == 200, as_float.text
    assert as_float.json()["choices"][0]["text"] == as_int.json()["choices"][0]["text"]
    assert as_float.json()["usage"]["completion_tokens"] == 3
    error_of(post(server, {"messages": MSG, "max_tokens": 3.5}), 400, "max_tokens")
    error_of(post(server, {"prompt": [504.5], "max_tokens": 3}, path="/v1/completions"), 400,
             "prompt")


@pytest.mark.parametrize("parameters", [None, "absent"])
def test_a_tool_without_parameters_is_called_with_an_empty_object(server, parameters):
    fn = {"name": "ping"} | ({} if parameters == "absent" else {"parameters": parameters})
    r = post(server, {"messages": MSG, "max_tokens": 40, "tools": [
        {"type": "function", "function": fn}], "tool_choice": "required"})
    assert r.status_code == 200, r.text
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "ping" and json.loads(call["arguments"]) == {}


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_tool_calls_parse_validate_and_do_not_depend_on_speculation(server, choice):
    import jsonschema

    client = server.client(KEY)
    msgs = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    got = {}
    for arm, extra in (("spec", None), ("plain", {"num_draft_tokens": 0})):
        r = client.chat.completions.create(model="default", messages=msgs, max_tokens=80,
                                           temperature=0, tools=[WEATHER, TIME],
                                           tool_choice=choice, parallel_tool_calls=False,
                                           extra_body=extra)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        call = c.message.tool_calls[0]
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments),
                            tool["function"]["parameters"])
        got[arm] = (call.function.name, call.function.arguments)
        if arm == "spec":
            assert r.model_extra["specdec"]["proposed"] > 0
    assert got["spec"] == got["plain"]
    # Streaming: the call arrives as tool_call deltas the client accumulates.
    name, args = "", ""
    with client.chat.completions.create(model="default", messages=msgs, max_tokens=80,
                                        temperature=0, tools=[WEATHER, TIME],
                                        tool_choice=choice, parallel_tool_calls=False,
                                        stream=True) as stream:
        finish = None
        for chunk in stream:
            for ch in chunk.choices:
                for tc in ch.delta.tool_calls or []:
                    name += tc.function.name or ""
                    args += tc.function.arguments or ""
                finish = ch.finish_reason or finish
    assert (name, args) == got["spec"] and finish == "tool_calls"


def test_tool_choice_none_ignores_tools_and_an_unknown_named_tool_is_a_400(server):
    plain = post(server, {"messages": MSG, "max_tokens": 4, "temperature": 0})
    none = post(server, {"messages": MSG, "max_tokens": 4, "temperature": 0,
                         "tools": [WEATHER], "tool_choice": "none"})
    assert none.json()["choices"][0]["message"]["content"] == \
        plain.json()["choices"][0]["message"]["content"]
    error_of(post(server, {"messages": MSG, "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}), 400, "tool_choice")


def test_logit_bias_moves_the_pick_and_bad_bias_is_a_400(server):
    from specdec.models import load

    body = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
    text = post(server, body, path="/v1/completions").json()["choices"][0]["text"]
    tid = load().tokenizer.encode(text, add_special_tokens=False)[0]
    moved = post(server, {**body, "logit_bias": {str(tid): -100}}, path="/v1/completions")
    assert moved.status_code == 200 and moved.json()["choices"][0]["text"] != text
    for bad in ({"x": 1}, {"5": 200}, {"99999999": 1}, {"5": True}):
        error_of(post(server, {**body, "logit_bias": bad}, path="/v1/completions"), 400,
                 "logit_bias")


@pytest.mark.parametrize("extra,param", [({"top_logprobs": 2}, "top_logprobs"),
                                         ({"logprobs": True, "top_logprobs": 21},
                                          "top_logprobs")])
def test_bad_logprobs_requests_are_a_400(server, extra, param):
    r = post(server, {"messages": MSG, "max_tokens": 2, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("rf", [{"type": "text", "json_schema": "not a schema"},
                                {"type": "json_object", "json_schema": {"schema": {}}}])
def test_a_json_schema_beside_another_response_format_type_is_a_400(server, rf):
    # It would be ignored: the client meant something else (found by the OpenAPI fuzzer).
    r = post(server, {"messages": MSG, "max_tokens": 3, "response_format": rf})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format.json_schema", r.text
    ok_after(server)
