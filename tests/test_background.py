"""Background responses on a real server (`specdec serve` on loopback, the openai SDK as the
client, the embedded model): answered at once (`queued`), polled to the same answer a
foreground request gets, cancelled (idempotently), streamed and resumed after the client
left by `starting_after` with no gap and no duplicate, and never left `in_progress` by a
server killed while one runs."""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest

from tests.serverproc import Server

LONG = "Count from one to two thousand in words, one number per line."
TERMINAL = ("completed", "incomplete", "failed", "cancelled")


def wait_for(c: openai.OpenAI, rid: str, until, timeout_s: float = 240):
    deadline = time.time() + timeout_s
    while True:
        r = c.responses.retrieve(rid)
        if until(r):
            return r
        assert time.time() < deadline, f"response {rid} stayed {r.status}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server("--store", str(tmp_path_factory.mktemp("bg") / "responses.sqlite3"))
    yield s
    s.stop()


def test_a_background_response_is_answered_at_once_and_polled_to_the_same_answer(server):
    c = server.client()
    ask = dict(model="default", input="Name three colours.", temperature=0,
               max_output_tokens=24)
    r = c.responses.create(**ask, background=True)
    assert r.status == "queued" and r.background is True and r.output == []
    done = wait_for(c, r.id, lambda x: x.status in TERMINAL)
    assert done.status in ("completed", "incomplete") and done.background is True
    fore = c.responses.create(**ask)
    assert done.output_text == fore.output_text and done.output_text  # the same answer
    assert done.usage.output_tokens == fore.usage.output_tokens
    assert [i.content[0].text for i in c.responses.input_items.list(r.id).data] == [
        "Name three colours."]
    # and it continues by id like any stored response
    nxt = c.responses.create(model="default", input="One more.", previous_response_id=r.id,
                             temperature=0, max_output_tokens=8)
    assert len(c.responses.input_items.list(nxt.id).data) == 3


def test_cancel_stops_it_and_is_idempotent(server):
    c = server.client()
    r = c.responses.create(model="default", input=LONG, temperature=0,
                           max_output_tokens=2000, background=True)
    running = wait_for(c, r.id, lambda x: x.status == "in_progress" and x.output_text)
    assert running.output_text  # the output so far, while it runs
    gone = c.responses.cancel(r.id)
    assert gone.status == "cancelled"
    kept = c.responses.retrieve(r.id)
    assert kept.status == "cancelled" and kept.output_text.startswith(running.output_text)
    assert c.responses.cancel(r.id).status == "cancelled"  # again: as it is
    time.sleep(0.5)
    assert c.responses.retrieve(r.id).output_text == kept.output_text  # it stopped
    # a response that ended is answered as it ended; a foreground one cannot be cancelled
    small = c.responses.create(model="default", input="Hi.", max_output_tokens=4,
                               temperature=0, background=True)
    ended = wait_for(c, small.id, lambda x: x.status in TERMINAL)
    assert c.responses.cancel(small.id).status == ended.status
    fore = c.responses.create(model="default", input="Hi.", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError):
        c.responses.cancel(fore.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.cancel("resp_nothing")


def test_a_stream_left_early_resumes_after_its_last_event(server):
    c = server.client()
    seen = []
    stream = c.responses.create(model="default", input="Describe the sea in two sentences.",
                                temperature=0, max_output_tokens=48, background=True,
                                stream=True)
    for ev in stream:
        seen.append(ev)
        if ev.sequence_number >= 6:
            break
    stream.close()  # the client leaves; the response goes on
    rid = seen[0].response.id
    assert seen[0].type == "response.created" and seen[0].response.status == "queued"
    rest = list(c.responses.retrieve(rid, stream=True, starting_after=seen[-1].sequence_number))
    numbers = [e.sequence_number for e in seen + rest]
    assert numbers == list(range(len(numbers)))  # no gap, no duplicate
    assert rest[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta")
    assert text == rest[-1].response.output_text == c.responses.retrieve(rid).output_text
    # from the start, and again: the same events
    again = list(c.responses.retrieve(rid, stream=True))
    assert [e.type for e in again] == [e.type for e in seen + rest]


def test_what_background_needs_is_a_400_naming_it(server):
    c = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="default", input="Hi.", background=True, store=False)
    assert e.value.body["param"] == "background"
    fore = c.responses.create(model="default", input="Hi.", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:
        list(c.responses.retrieve(fore.id, stream=True))
    assert e.value.body["param"] == "stream"


def test_a_server_killed_mid_response_leaves_it_failed_never_in_progress(tmp_path):
    store = str(tmp_path / "responses.sqlite3")
    s = Server("--store", store)
    try:
        c = s.client()
        r = c.responses.create(model="default", input=LONG, temperature=0,
                               max_output_tokens=2000, background=True)
        wait_for(c, r.id, lambda x: x.status == "in_progress" and x.output_text)
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(30)
    finally:
        s.stop()
    s = Server("--store", store)
    try:
        c = s.client()
        got = c.responses.retrieve(r.id)
        assert got.status == "failed" and "stopped" in got.error.message
        assert c.responses.cancel(r.id).status == "failed"  # ended: answered as it is
        with pytest.raises(openai.BadRequestError) as e:  # its events went with the process
            list(c.responses.retrieve(r.id, stream=True, starting_after=3))
        assert e.value.body["param"] == "stream"
    finally:
        s.stop()
