"""Every API's one policy for the body fields its models do not name (`door.Unmodeled`):
a field client libraries send that cannot change the answer is accepted and ignored; one
that would is a 400 naming it, in the API's own error shape, unless given its no-op value;
and the OpenAPI document names them, and no others. In process, over the fake engine."""

from __future__ import annotations

from typing import Any

import pytest

from server import chat_wire, messages_wire, responses_wire
from tests.fakeengine import finished, post

# path, a minimal body, the policy, an ignored field, a refused field's value and its no-op
APIS = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}]},
             chat_wire.CHAT_UNMODELED, "metadata", ("presence_penalty", 0.5, 0)),
    "completions": ("/v1/completions", {"prompt": "q"}, chat_wire.COMPLETION_UNMODELED,
                    "user", ("echo", True, False)),
    "responses": ("/v1/responses", {"input": "q"}, responses_wire.UNMODELED, "user",
                  ("truncation", "auto", "disabled")),
    "messages": ("/v1/messages", {"model": "fake", "max_tokens": 4,
                                  "messages": [{"role": "user", "content": "q"}]},
                 messages_wire.UNMODELED, "metadata", ("mcp_servers", [{"x": 1}], [])),
}


def error_naming(r: Any, api: str) -> tuple[str, str | None]:
    """(message, param) of a 400 in the API's own shape (Anthropic's has no `param`: the
    field leads the message)."""
    assert r.status_code == 400, r.text
    body = r.json()
    if api == "messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"], None
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"], body["error"]["param"]


@pytest.mark.parametrize("api", APIS)
def test_an_unknown_field_is_a_400_naming_it_in_the_apis_shape(fake, fake_app, api):
    path, body, *_ = APIS[api]
    fake.script = [finished("ok")]
    message, param = error_naming(post(fake_app, path, {**body, "frobnicate": 1}), api)
    assert "frobnicate" in message and param in (None, "frobnicate")
    if api == "messages":
        assert message.startswith("frobnicate: ")
    assert fake.seen == []


@pytest.mark.parametrize("api", APIS)
def test_a_refused_field_is_accepted_only_with_its_no_op_value(fake, fake_app, api):
    path, body, _, _, (name, value, noop) = APIS[api]
    fake.script = [finished("ok")]
    message, param = error_naming(post(fake_app, path, {**body, name: value}), api)
    assert name in message and param in (None, name)
    assert post(fake_app, path, {**body, name: noop}).status_code == 200
    assert post(fake_app, path, body).status_code == 200
    assert fake.seen[-2] == fake.seen[-1]


@pytest.mark.parametrize("api", APIS)
def test_an_ignored_field_changes_nothing(fake, fake_app, api):
    path, body, _, ignored, _ = APIS[api]
    fake.script = [finished("ok")]
    assert post(fake_app, path, {**body, ignored: {"any": "value"}}).status_code == 200
    assert post(fake_app, path, body).status_code == 200
    assert fake.seen[-2] == fake.seen[-1]


def test_the_document_names_every_accepted_field_and_no_others(fake_app):
    from server.app import APIS as MODULES

    schemas = fake_app.openapi()["components"]["schemas"]
    bodies = {p: m for api in MODULES for p, m in api.REQUEST_BODIES.items()}
    for api, (path, _, policy, _, _) in APIS.items():
        schema = schemas[bodies[path].__name__]
        assert schema["additionalProperties"] is False, api
        assert set(policy.ignored) | set(policy.noop) <= set(schema["properties"]), api
