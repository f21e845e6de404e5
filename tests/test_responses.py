"""`/v1/responses` on the real server (`specdec serve` on loopback) driven by the official
clients: the openai SDK's `responses.create` / `parse` / `stream`, the openai-agents SDK's
default (Responses) model with a structured `output_type`; and (in process, the same
client over the app) a reasoning template's think block as a reasoning item. Schemas are
bounded so the embedded 135M model finishes within a few dozen tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field


TEMPLATES = Path(__file__).parent / "templates"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Verdict(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sentiment: Literal["positive", "negative", "neutral"]
    reason: str = Field(max_length=40)


@pytest.fixture(scope="module")
def server_args():
    return ("--num-draft-tokens", "4")


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_create_answers_text_with_usage(client):
    r = client.responses.create(model="default", input="Say hello.", max_output_tokens=12,
                                temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.output[0].type == "message"
    assert r.usage.output_tokens <= 12 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_json_schema_format_answers_matching_json(client):
    r = client.responses.create(
        model="default", input="Describe a person as JSON.", max_output_tokens=48,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                         "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)


def test_parse_with_text_format_gives_the_model_instance(client):
    r = client.responses.parse(model="default", input="Name a city in France.",
                               text_format=City, max_output_tokens=48, temperature=0)
    assert isinstance(r.output_parsed, City)


def test_stream_events_end_in_the_same_response_as_without_stream(client):
    args = dict(model="default", input="Name three colors.", max_output_tokens=16,
                temperature=0)
    plain = client.responses.create(**args)
    with client.responses.stream(**args) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert final.output_text == plain.output_text and final.status == plain.status


def test_agents_sdk_default_model_gives_structured_final_output(server):
    from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner,
                        set_tracing_disabled)

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    agent = Agent(name="critic", instructions="Judge the sentiment of the review.",
                  model=OpenAIResponsesModel(model="default", openai_client=client),
                  model_settings=ModelSettings(max_tokens=64, temperature=0),
                  output_type=Verdict)
    result = Runner.run_sync(agent, "The food was wonderful and the staff were kind.")
    assert isinstance(result.final_output, Verdict)


def test_reasoning_effort_gives_a_reasoning_item_then_the_json_answer(embedded):
    # A template with a think block (the embedded vocabulary has no think tokens: the
    # markers are text); the thinking goes into the reasoning item, never into the answer.
    # The official client in process (the app over httpx's ASGI transport): no second server.
    import asyncio

    import httpx

    from server.app import create_app
    from server.door import ServeConfig
    from specdec.config import EngineDefaults
    from specdec.engine import Engine

    engine = Engine(embedded, defaults=EngineDefaults(
        chat_template=(TEMPLATES / "qwen3_style.jinja").read_text()))
    app = create_app(engine, ServeConfig())

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test/v1", timeout=300) as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused",
                                        http_client=http, max_retries=0)
            return await client.responses.create(
                model="default", input="A color as JSON.", reasoning={"effort": "low"},
                text={"format": {"type": "json_object"}}, max_output_tokens=80,
                temperature=0, extra_body={"max_thinking_tokens": 8})

    try:
        r = asyncio.run(ask())
    finally:
        engine.close()
    thought, answer = r.output
    assert thought.type == "reasoning" and thought.content[0].type == "reasoning_text"
    assert answer.type == "message" and "</think>" not in r.output_text
    assert r.usage.output_tokens_details.reasoning_tokens >= 8
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


def test_unsupported_tool_is_a_400_naming_it_and_the_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", input="Hi", max_output_tokens=4,
                                tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools[0].type" and "web_search" in e.value.body["message"]
    r = client.responses.create(model="default", input="Hi", max_output_tokens=4)
    assert r.output_text
