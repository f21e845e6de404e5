"""The Responses store on a real server (`specdec serve --store FILE` on loopback): a stored
response survives a restart (retrieved, and continued by `previous_response_id`, by the next
process on the same file); a response whose client leaves mid-stream is not stored (nor is
anything of it added to its conversation); a turn killed inside its write stores nothing."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import openai
import pytest

from tests.serverproc import Server


def test_a_stored_response_survives_a_restart(tmp_path):
    store = str(tmp_path / "responses.sqlite3")
    s = Server("--store", store)
    try:
        r1 = s.client().responses.create(model="default", input="Name a colour.",
                                         temperature=0, max_output_tokens=8)
    finally:
        s.stop()
    s = Server("--store", store)
    try:
        c = s.client()
        got = c.responses.retrieve(r1.id)
        assert got.id == r1.id and got.output_text == r1.output_text
        r2 = c.responses.create(model="default", previous_response_id=r1.id,
                                input="Name another one.", temperature=0, max_output_tokens=8)
        sent = c.responses.input_items.list(r2.id, order="asc").data
        assert [i.role for i in sent] == ["user", "assistant", "user"]
        assert sent[1].content[0].text == r1.output_text
    finally:
        s.stop()


def test_a_stream_left_mid_answer_stores_nothing(tmp_path):
    s = Server("--store", str(tmp_path / "responses.sqlite3"))
    try:
        c = s.client()
        conv = c.conversations.create(items=[{"type": "message", "role": "user",
                                              "content": "Hello."}])
        body = {"model": "default", "input": "Count from one to two hundred in words.",
                "stream": True, "max_output_tokens": 400, "temperature": 0,
                "conversation": conv.id}
        rid = None
        with httpx.stream("POST", s.url + "/v1/responses", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    ev = json.loads(line[6:])
                    rid = rid or ev.get("response", {}).get("id")
                    if ev["type"] == "response.output_text.delta":
                        break  # the client leaves once text arrives
        assert rid is not None
        # the server notices (within ~0.5 s, while tokens flow) and stops the request
        deadline = time.time() + 120
        while "specdec_cancelled_total 1" not in httpx.get(s.url + "/metrics").text:
            assert time.time() < deadline, "the request was not stopped"
            time.sleep(0.2)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(rid)
        assert [i.content[0].text for i in c.conversations.items.list(conv.id).data] == [
            "Hello."]
    finally:
        s.stop()


def test_a_turn_killed_inside_its_transaction_stores_nothing(tmp_path):
    """A real kill (SIGKILL) of a real server while a conversation turn's write stops inside
    its transaction (the store's fault hook, `SPECDEC_STORE_FAULT=pause-in-turn`: after the
    response's rows, before the conversation's), then a restart on the same file: neither
    the response nor the conversation's new items are there; what was there before is."""
    store = str(tmp_path / "responses.sqlite3")
    s = Server("--store", store, env={"SPECDEC_STORE_FAULT": "pause-in-turn"})
    try:
        c = s.client()
        conv = c.conversations.create(items=[{"type": "message", "role": "user",
                                              "content": "Hello."}])
        r = c.responses.create(model="default", input="Name a colour.", conversation=conv.id,
                               temperature=0, max_output_tokens=8)  # answered; kept after
        deadline = time.time() + 60
        while not os.path.exists(store + ".paused"):
            assert time.time() < deadline, "the turn's write never reached the fault hook"
            time.sleep(0.05)
        s.proc.send_signal(signal.SIGKILL)
        s.proc.wait(timeout=30)
    finally:
        s.stop()
    s = Server("--store", store)
    try:
        c = s.client()
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(r.id)
        items = c.conversations.items.list(conv.id, order="asc").data
        assert [i.content[0].text for i in items] == ["Hello."]
        # and the conversation goes on
        c.responses.create(model="default", input="Name a colour.", conversation=conv.id,
                           temperature=0, max_output_tokens=8)
        assert len(c.conversations.items.list(conv.id).data) == 3
    finally:
        s.stop()
