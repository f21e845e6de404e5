"""Stored responses and conversations (`server/store.py`, `server/responses.py`,
`server/conversations.py`), through the openai SDK against the app in process (`--store
memory`): `previous_response_id` continues a response (its input and output first, its
answer's KV state restored: truthful `cached_tokens`, and the same output as the whole
history resent), retrieve, delete, `input_items` pages, `item_reference`, `store: false`,
the Conversations API and the `conversation` parameter; 404s in OpenAI's shape for ids not
stored; `--store none`. The SQLite file surviving a restart, and a stream cut mid-answer
storing nothing, are tested against a real server in tests/test_store_server.py.
"""

from __future__ import annotations

import openai
import pytest

from server.store import Bounds, SqliteStore as Store, page
from tests.serverproc import error_of, serve_app

GREEDY = dict(temperature=0, max_output_tokens=12)


@pytest.fixture(scope="module")
def app(served_models):
    s = serve_app("--store", "memory", models=served_models)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(app):
    return app.client()


def _text(r) -> str:
    return "".join(c.text for o in r.output if o.type == "message" for c in o.content)


def test_a_response_continues_by_id_as_its_whole_history_resent(client):
    r1 = client.responses.create(model="default", input="Name a colour.", **GREEDY)
    assert r1.store is True and r1.previous_response_id is None
    r2 = client.responses.create(model="default", previous_response_id=r1.id,
                                 input="Name another one.", **GREEDY)
    assert r2.previous_response_id == r1.id and r2.status in ("completed", "incomplete")
    # the answer kept hot: its prompt restored well past the first turn's prompt
    assert r2.usage.input_tokens_details.cached_tokens > r1.usage.input_tokens
    resent = client.responses.create(model="default", input=[
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": _text(r1)},
        {"role": "user", "content": "Name another one."}], **GREEDY)
    assert _text(resent) == _text(r2) and resent.usage.input_tokens == r2.usage.input_tokens
    items = client.responses.input_items.list(r2.id, order="asc")
    assert [i.type for i in items.data] == ["message", "message", "message"]
    assert [i.role for i in items.data] == ["user", "assistant", "user"]
    assert items.data[1].id == r1.output[-1].id and not items.has_more


def test_retrieve_delete_and_the_404s(app, client):
    r = client.responses.create(model="default", input="Say hi.", **GREEDY)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and _text(got) == _text(r) and got.usage == r.usage
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    err = error_of(app.http.post("/v1/responses", json={
        "model": "default", "input": "Hi", "previous_response_id": r.id}), 404,
        "previous_response_id")
    assert err["code"] == "previous_response_not_found"
    error_of(app.http.delete(f"/v1/responses/{r.id}"), 404)
    error_of(app.http.get(f"/v1/responses/{r.id}/input_items"), 404)
    err = error_of(app.http.post("/v1/responses", json={
        "model": "default", "input": "Hi", "conversation": "conv_nope"}), 404, "conversation")
    assert err["code"] == "conversation_not_found"
    error_of(app.http.post("/v1/responses", json={
        "model": "default", "input": [{"type": "item_reference", "id": "msg_nope"}]}), 404,
        "input[0].id")
    error_of(app.http.post("/v1/responses", json={
        "model": "default", "input": "Hi", "previous_response_id": "resp_x",
        "conversation": "conv_x"}), 400, "previous_response_id")


def test_store_false_keeps_nothing(client):
    r = client.responses.create(model="default", input="Say hi.", store=False, **GREEDY)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_input_items_pages_and_item_references(app, client):
    r1 = client.responses.create(model="default", input=[
        {"role": "user", "content": f"Word {i}."} for i in range(5)], **GREEDY)
    first = client.responses.input_items.list(r1.id, limit=2, order="asc")
    assert [i.content[0].text for i in first.data] == ["Word 0.", "Word 1."]
    assert first.has_more and first.first_id == first.data[0].id
    rest = client.responses.input_items.list(r1.id, limit=10, order="asc", after=first.last_id)
    assert [i.content[0].text for i in rest.data] == ["Word 2.", "Word 3.", "Word 4."]
    assert not rest.has_more
    newest = client.responses.input_items.list(r1.id, limit=1)  # desc by default
    assert newest.data[0].content[0].text == "Word 4."
    error_of(app.http.get(f"/v1/responses/{r1.id}/input_items", params={"after": "nope"}), 400,
             "after")
    # an item_reference is the stored item it names
    ref = client.responses.create(model="default", input=[
        {"type": "item_reference", "id": first.data[1].id},
        {"role": "user", "content": "Repeat it."}], **GREEDY)
    sent = client.responses.input_items.list(ref.id, order="asc").data
    assert sent[0].id == first.data[1].id and sent[0].content[0].text == "Word 1."


def test_conversations_api_and_the_conversation_parameter(app, client):
    conv = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "My name is Ada."}],
        metadata={"topic": "names"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "names"}
    r = client.responses.create(model="default", conversation=conv.id,
                                input="What is my name?", **GREEDY)
    assert r.conversation is not None and r.conversation.id == conv.id
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [i.type for i in items] == ["message", "message", "message"]
    assert items[0].content[0].text == "My name is Ada." and items[2].id == r.output[-1].id
    # the next response reads the conversation, its own input and output added after
    r2 = client.responses.create(model="default", conversation={"id": conv.id},
                                 input="Say it again.", **GREEDY)
    assert len(client.conversations.items.list(conv.id).data) == 5
    assert r2.usage.input_tokens_details.cached_tokens > r.usage.input_tokens
    added = client.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "user", "content": "Thanks."}])
    assert [i.content[0].text for i in added.data] == ["Thanks."]
    one = client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
    assert one.id == added.data[0].id
    client.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
    assert client.conversations.update(conv.id, metadata={"topic": "x"}).metadata == {
        "topic": "x"}
    assert client.conversations.retrieve(conv.id).id == conv.id
    assert client.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
    error_of(app.http.post("/v1/conversations", json={"items": [{"type": "function_call"}]}),
             400, "items[0].call_id")


def test_with_store_none_stored_state_is_a_400(served_models):
    s = serve_app("--store", "none", models=served_models)
    try:
        r = s.http.post("/v1/responses", json={"model": "default", "input": "Hi",
                                               "max_output_tokens": 2})
        assert r.status_code == 200 and r.json()["store"] is False
        for extra, param in (({"store": True}, "store"),
                             ({"previous_response_id": "resp_1"}, "previous_response_id"),
                             ({"conversation": "conv_1"}, "conversation")):
            error_of(s.http.post("/v1/responses", json={"model": "default", "input": "Hi",
                                                        **extra}), 400, param)
        error_of(s.http.get("/v1/responses/resp_1"), 404)
        error_of(s.http.post("/v1/conversations", json={}), 404)
    finally:
        s.stop()


# -- truthful usage: the prompt positions restored, in every API ---------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_usage_counts_the_restored_prompt_as_cached(client, stream):
    ask = [{"role": "user", "content": f"Spell the word {'stream' if stream else 'whole'}."}]

    def usage():
        if not stream:
            return client.chat.completions.create(model="default", messages=ask, max_tokens=4,
                                                  temperature=0).usage
        chunks = list(client.chat.completions.create(
            model="default", messages=ask, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        return chunks[-1].usage

    first, again = usage(), usage()
    # (a first request may share its template's head with an earlier one)
    assert first.prompt_tokens_details.cached_tokens < first.prompt_tokens - 1
    # the whole prompt but its last token (always computed: its logits pick the first token)
    assert again.prompt_tokens == first.prompt_tokens
    assert again.prompt_tokens_details.cached_tokens == first.prompt_tokens - 1


def test_messages_usage_reads_the_restored_prompt_from_the_cache(app):
    import json

    body = {"model": "default", "max_tokens": 4,
            "messages": [{"role": "user", "content": "Spell the word cache."}]}
    first = app.http.post("/v1/messages", json=body).json()["usage"]
    events = [json.loads(line[6:]) for line in app.http.post(
        "/v1/messages", json={**body, "stream": True}).text.splitlines()
        if line.startswith("data: ")]
    (again,) = [e["usage"] for e in events if e["type"] == "message_delta"]
    total = first["input_tokens"] + first["cache_read_input_tokens"]
    assert first["cache_creation_input_tokens"] == 0 and first["input_tokens"] > 1
    # the message_delta's usage, which the SDK's stream takes over message_start's
    assert again["cache_read_input_tokens"] == total - 1 and again["input_tokens"] == 1


def test_metrics_count_prompt_tokens_restored_and_computed(app, client):
    def counters() -> dict[str, float]:
        text = app.http.get("/metrics").text
        return {k: float(v) for k, v in (line.split() for line in text.splitlines()
                                         if line.startswith("specdec_prompt"))}

    before = counters()
    ask = [{"role": "user", "content": "Spell the word metrics."}]
    u = [client.chat.completions.create(model="default", messages=ask, max_tokens=2).usage
         for _ in range(2)]
    after = counters()
    cached = sum(x.prompt_tokens_details.cached_tokens for x in u)
    assert u[1].prompt_tokens_details.cached_tokens == u[1].prompt_tokens - 1
    assert after["specdec_prompt_cache_hits_total"] - \
        before["specdec_prompt_cache_hits_total"] == sum(
            x.prompt_tokens_details.cached_tokens > 0 for x in u)
    assert after["specdec_prompt_tokens_cached_total"] - \
        before["specdec_prompt_tokens_cached_total"] == cached
    assert after["specdec_prompt_tokens_computed_total"] - \
        before["specdec_prompt_tokens_computed_total"] == 2 * u[0].prompt_tokens - cached


# -- the store itself ------------------------------------------------------------------------

def _response(rid: str, text: str = "x") -> dict:
    return {"id": rid, "object": "response", "output": [
        {"type": "message", "id": f"msg_{rid}", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": text}]}]}


def test_the_store_bounds_count_bytes_and_age(tmp_path):
    s = Store(tmp_path / "s.sqlite3", Bounds(max_age_s=None, max_count=3, max_bytes=None))
    for i in range(5):
        s.put_turn(_response(f"r{i}"), [{"type": "message", "id": f"in{i}", "role": "user",
                                         "content": []}])
    assert [s.response(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert s.item("in0") is None and s.item("in4")["id"] == "in4"
    s = Store(":memory:", Bounds(max_age_s=None, max_count=None, max_bytes=2000))
    for i in range(10):
        s.put_turn(_response(f"r{i}", "y" * 300), [])
    kept = [i for i in range(10) if s.response(f"r{i}") is not None]
    assert kept == list(range(10 - len(kept), 10)) and 0 < len(kept) < 10
    assert s.stats()["bytes"] <= 2000
    s = Store(":memory:", Bounds(max_age_s=0.0, max_count=None, max_bytes=None))
    s.put_turn(_response("old"), [])
    s.put_turn(_response("new"), [])  # writing evicts what is past its age
    assert s.response("old") is None


def test_the_store_survives_reopening(tmp_path):
    path = tmp_path / "s.sqlite3"
    s = Store(path)
    s.put_turn(_response("r1", "kept"), [{"type": "message", "id": "m1", "role": "user",
                                         "content": []}])
    s.new_conversation("conv_1", {"k": "v"}, [{"type": "message", "id": "m2", "role": "user",
                                               "content": []}])
    s.close()
    s = Store(path)
    assert s.response("r1")["output"][0]["content"][0]["text"] == "kept"
    assert [i["id"] for i in s.context("r1")] == ["m1", "msg_r1"]
    assert s.conversation("conv_1")["metadata"] == {"k": "v"}
    assert [i["id"] for i in s.conversation_items("conv_1")] == ["m2"]


def test_pages_are_openai_lists():
    items = [{"id": f"i{n}"} for n in range(5)]
    assert page(items, None, 2, "asc").wire() == {
        "object": "list", "data": items[:2], "first_id": "i0", "last_id": "i1",
        "has_more": True}
    assert page(items, "i1", 2, "desc").data == [{"id": "i0"}]
    assert page(items, "nope", 2, "asc") is None
