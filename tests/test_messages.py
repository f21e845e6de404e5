"""Anthropic's Messages API on the real server (`specdec serve` on loopback, x-api-key
auth) driven by the official `anthropic` client: plain, streamed, structured output through
`messages.parse`, forced tool calls, count_tokens, errors. Sampling fields are not in this
SDK's signature, so `temperature` travels in `extra_body`, as a client would send it."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict, Field


KEY = "test-key"
GREEDY = {"temperature": 0}
ASK = [{"role": "user", "content": "Name a colour."}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "additionalProperties": False,
                            "required": ["city"],
                            "properties": {"city": {"type": "string", "maxLength": 12}}}}
CLOCK = {"name": "get_time", "description": "The time in a timezone",
         "input_schema": {"type": "object", "additionalProperties": False,
                          "required": ["tz"],
                          "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}}}}


@pytest.fixture(scope="module")
def server_args():
    return ("--num-draft-tokens", "4", "--api-key", KEY)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def create(client: anthropic.Anthropic, **kw: Any) -> anthropic.types.Message:
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 12)
    return client.messages.create(model="default", extra_body=GREEDY, **kw)


def test_create_answers_with_a_text_block(client):
    m = create(client, system="You are terse.", metadata={"user_id": "u1"})
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 12


def test_stream_text_joins_to_the_non_streamed_answer(client):
    whole = create(client)
    with client.messages.stream(model="default", max_tokens=12, messages=ASK,
                                extra_body=GREEDY) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    # (the prompt: its tokens read from the prompt store and those computed)
    prompt = [m.usage.input_tokens + m.usage.cache_read_input_tokens for m in (final, whole)]
    assert prompt[0] == prompt[1] and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again


class Colour(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=12)
    warm: bool


def test_parse_with_output_format_gives_schema_valid_json(client):
    m = client.messages.parse(model="default", max_tokens=40, messages=ASK,
                              output_format=Colour, extra_body=GREEDY,
                              extra_headers={"anthropic-beta": "structured-outputs-2025-11-13"})
    assert m.stop_reason == "end_turn"
    assert isinstance(m.parsed_output, Colour)
    jsonschema.validate(Colour.model_validate_json(m.content[0].text).model_dump(),
                        Colour.model_json_schema())


@pytest.mark.parametrize("choice, tool", [({"type": "any"}, None),
                                          ({"type": "tool", "name": "get_time"}, "get_time")])
def test_forced_tool_call_is_a_tool_use_block(client, choice, tool):
    m = create(client, max_tokens=40, tools=[WEATHER, CLOCK], tool_choice=choice,
               messages=[{"role": "user", "content": "What's the weather in Paris?"}])
    assert m.stop_reason == "tool_use"
    (block,) = m.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert block.name == (tool or block.name) and block.name in ("get_weather", "get_time")
    schema = (WEATHER if block.name == "get_weather" else CLOCK)["input_schema"]
    jsonschema.validate(block.input, schema)


def test_count_tokens_matches_the_prompt_a_message_is_given(client):
    n = client.messages.count_tokens(model="default", messages=ASK, system="You are terse.")
    m = create(client, max_tokens=1, system="You are terse.")
    assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0


def test_missing_max_tokens_is_a_400_in_anthropics_shape(server):
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY,
                   "anthropic-version": "2023-06-01"},
                   json={"model": "default", "messages": ASK})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]


@pytest.mark.parametrize("kw, error, says", [
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]},
     anthropic.BadRequestError, "'image'"),
    # SmolLM2's template has no think block: a loud 400 naming the field, never ignored
    ({"thinking": {"type": "enabled", "budget_tokens": 8}}, anthropic.BadRequestError,
     "thinking"),
    ({"model": "claude-sonnet-4-5"}, anthropic.NotFoundError, "claude-sonnet-4-5"),
])
def test_what_is_not_served_is_refused_in_anthropics_shape(client, kw, error, says):
    with pytest.raises(error) as e:
        client.messages.create(**{"model": "default", "max_tokens": 4, "messages": ASK, **kw})
    assert e.value.body["type"] == "error" and says in e.value.body["error"]["message"]


def test_wrong_key_is_an_authentication_error(server):
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="default", max_tokens=4, messages=ASK)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"


def test_server_keeps_serving_after_errors(client):
    assert create(client, max_tokens=4).content[0].text
