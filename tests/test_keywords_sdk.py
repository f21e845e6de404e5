"""Where users meet the rewritten keywords: a Pydantic model with a discriminated union and a
model-level `if`/`then` (through `json_schema_extra`), strict, through each SDK's `parse`
(`chat.completions.parse`, `responses.parse`, anthropic's `messages.parse`) on the app
`specdec serve` runs (in process, the embedded model). The prompt asks for express delivery
with no phone, which the `if`/`then` forbids: every answer parses into the model and
validates against the schema Pydantic wrote, `if`/`then` included."""

from __future__ import annotations

from typing import Literal, Union

import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict, Field

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
