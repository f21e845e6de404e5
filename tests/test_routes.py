"""Every API's one route (`Door.serve`): the same order of checks, the same answer to a client
that went away, the same field names for a failure streamed or whole, in Chat Completions,
Completions, Responses and Messages alike.

In process: the app over the fake engine (tests/fakeengine.py); a client that leaves is an
ASGI receive channel that answers `http.disconnect` once the body is read.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

from specdec.errors import RequestError
from specdec.events import Failed, TextDelta
from tests.fakeengine import post

MSG = [{"role": "user", "content": "hi"}]
# api -> (path, a body it answers, a field of it that the conversion refuses)
APIS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": MSG}, {"top_logprobs": 2}),
    "completions": ("/v1/completions", {"prompt": "hi"}, {"suffix": "x"}),
    "responses": ("/v1/responses", {"input": "hi"}, {"truncation": "auto"}),
    "messages": ("/v1/messages", {"model": "fake", "messages": MSG, "max_tokens": 5},
                 {"mcp_servers": [{}]}),
}
MAX_TOKENS = {"chat": "max_completion_tokens", "completions": "max_tokens",
              "responses": "max_output_tokens", "messages": "max_tokens"}


def error_of(api: str, body: dict[str, Any]) -> tuple[str | None, str]:
    """(code, the field at fault) of an error in the API's shape (Anthropic's has no
    `param`: its message begins with the field)."""
    err = body["error"]
    if api == "messages":
        assert body["type"] == "error"
        return err["code"], re.match(r"[\w.\[\]]*", err["message"]).group()
    return err["code"], err["param"]


@pytest.mark.parametrize("refused", [{"unknown_field": 1}, None], ids=["unknown", "refused"])
@pytest.mark.parametrize("api", APIS)
def test_a_model_not_served_is_a_404_before_the_rest_of_the_body_is_read(fake, fake_app,
                                                                         api, refused):
    # Every API routes first: a body naming a model this server does not serve is a 404,
    # whatever else is wrong with it (an unknown field, a value the conversion refuses).
    path, body, bad = APIS[api]
    r = post(fake_app, path, {**body, **(refused or bad), "model": "gpt-9"})
    assert r.status_code == 404, r.text
    assert error_of(api, r.json()) == ("model_not_found", "model")
    assert fake.seen == []
    r = post(fake_app, path, {**body, **(refused or bad)})  # the model served: a 400
    assert r.status_code == 400, r.text


def leave(app: Any, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    """One request whose client goes away once its body is sent: (status, headers, body)."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("test", 80), "headers": [
                 (b"host", b"test"), (b"content-type", b"application/json"),
                 (b"content-length", str(len(raw)).encode())]}
    messages = [{"type": "http.request", "body": raw, "more_body": False}]
    status, headers, chunks = 0, {}, []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = {k.decode(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    asyncio.run(asyncio.wait_for(app(scope, receive, send), 60))
    return status, headers, b"".join(chunks)


@pytest.mark.parametrize("api", APIS)
def test_a_client_gone_before_the_whole_answer_gets_a_499_and_no_body(fake, fake_app, api):
    # Nobody is left to read an answer, so none is written, in any API's shape.
    fake.script = []  # the run never ends: only the client's leaving ends it
    path, body, _ = APIS[api]
    status, headers, content = leave(fake_app, path, body)
    assert (status, content) == (499, b"")
    assert "content-type" not in headers
    assert len(fake.seen) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", APIS)
def test_a_failure_names_the_field_as_the_body_does_streamed_or_whole(fake, fake_app, api,
                                                                      stream):
    # The run fails naming the engine's `max_tokens`: the client reads the field it sent
    # (chat's `max_completion_tokens` where given), whether the answer streams or not.
    fake.script = [TextDelta("a"), Failed(RequestError("too long", param="max_tokens"))]
    path, body, _ = APIS[api]
    body = {**body, MAX_TOKENS[api]: 5, "stream": stream}
    r = post(fake_app, path, body)
    if not stream:
        assert r.status_code == 400, r.text
        assert error_of(api, r.json())[1] == MAX_TOKENS[api]
        return
    assert r.status_code == 200, r.text
    events = [json.loads(line[5:]) for line in r.text.splitlines()
              if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    last = events[-1]
    if api == "responses":
        assert last["type"] == "response.failed"
        assert last["response"]["error"]["param"] == MAX_TOKENS[api]
    else:
        assert error_of(api, last)[1] == MAX_TOKENS[api]
