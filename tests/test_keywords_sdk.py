"""Where users meet the rewritten keywords and the uniqueness rule: a Pydantic model with a
discriminated union and a model-level `if`/`then` (through `json_schema_extra`), and one
with `set[str]`, `frozenset[Literal[...]]` and `conset` fields (`uniqueItems`, which
Pydantic writes for every set), strict, through each SDK's `parse`
(`chat.completions.parse`, `responses.parse`, anthropic's `messages.parse`) on the app
`specdec serve` runs (in process, the embedded model). The prompt asks for express delivery
with no phone, which the `if`/`then` forbids: every answer parses into the model and
validates against the schema Pydantic wrote, `if`/`then` included. The set prompt asks
for repeated items: the raw answer validates (`uniqueItems` included: Pydantic's own
parse would merge a repeat silently, so the check is on the text)."""

from __future__ import annotations

import json
from typing import Annotated, Literal, Union

import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict, Field, conset

from tests.serverproc import serve_app


class Card(BaseModel):
    kind: Literal["card"]
    number: str = Field(pattern=r"^[0-9]{4}$")


class Cash(BaseModel):
    kind: Literal["cash"]
    currency: Literal["USD", "EUR"]


class Order(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "if": {"properties": {"express": {"const": True}}},
        "then": {"required": ["phone"], "properties": {"phone": {"type": "string"}}}})
    item: str = Field(max_length=20)
    express: bool
    phone: str | None = Field(default=None, pattern=r"^[0-9]{3}-[0-9]{4}$")
    payment: Union[Card, Cash] = Field(discriminator="kind")


class Tagged(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tags: set[Annotated[str, Field(max_length=12)]] = Field(min_length=3, max_length=4)
    sizes: frozenset[Literal["S", "M", "L"]] = Field(min_length=2)
    lucky: conset(int, min_length=3, max_length=3)  # type: ignore[valid-type]


ASK_SETS = ("Tag a desk lamp with lamp, lamp and lamp, in sizes S and S, and give the lucky "
            "numbers 7, 7 and 7.")
ASK = ("Order one desk lamp with express delivery, paid in cash in dollars. I have no phone, "
       "so leave the phone out.")
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def app(served_models):
    s = serve_app(models=served_models)
    yield s
    s.stop()


def check(order: Order | None, text: str) -> None:
    assert isinstance(order, Order), text
    jsonschema.Draft202012Validator(Order.model_json_schema()).validate(
        order.model_dump(mode="json", exclude_unset=True))
    assert Order.model_validate_json(text) == order


def test_chat_completions_parse(app):
    r = app.client().chat.completions.parse(
        model="default", messages=[{"role": "user", "content": ASK}], response_format=Order,
        temperature=0, max_tokens=MAX_TOKENS)
    msg = r.choices[0].message
    check(msg.parsed, msg.content or "")


def test_responses_parse(app):
    r = app.client().responses.parse(model="default", input=ASK, text_format=Order,
                                     temperature=0, max_output_tokens=MAX_TOKENS, store=False)
    check(r.output_parsed, r.output_text)


def test_messages_parse(app):
    # The anthropic SDK moves the keywords its API does not take (`if`/`then` here) into the
    # description as Python's repr; the server reads them back as literals and enforces them.
    m = app.anthropic_client().messages.parse(
        model="default", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": ASK}],
        output_format=Order, extra_body={"temperature": 0},
        extra_headers={"anthropic-beta": "structured-outputs-2025-11-13"})
    check(m.parsed_output, m.content[0].text)


def check_sets(parsed: Tagged | None, text: str) -> None:
    assert isinstance(parsed, Tagged), text
    jsonschema.Draft202012Validator(Tagged.model_json_schema()).validate(json.loads(text))


def test_sets_through_each_sdk(app):
    schema = json.dumps(Tagged.model_json_schema())
    assert schema.count('"uniqueItems": true') == 3
    c = app.client()
    r = c.chat.completions.parse(model="default", messages=[{"role": "user", "content": ASK_SETS}],
                                 response_format=Tagged, temperature=0, max_tokens=MAX_TOKENS)
    check_sets(r.choices[0].message.parsed, r.choices[0].message.content or "")
    r2 = c.responses.parse(model="default", input=ASK_SETS, text_format=Tagged, temperature=0,
                           max_output_tokens=MAX_TOKENS, store=False)
    check_sets(r2.output_parsed, r2.output_text)
    m = app.anthropic_client().messages.parse(
        model="default", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": ASK_SETS}],
        output_format=Tagged, extra_body={"temperature": 0},
        extra_headers={"anthropic-beta": "structured-outputs-2025-11-13"})
    check_sets(m.parsed_output, m.content[0].text)
