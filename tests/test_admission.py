"""Admission before work, and malformed input as a client error (`server.door`, the wire
models): a full server answers 503 before it reads a body's fields or renders a prompt; a
prompt that cannot fit the context is a 400 before it is tokenized; a large body is parsed
off the event loop; a client that leaves while queued gives its place back; every malformed
number is a 400 naming its parameter; no exception text reaches a client.

In process, on the ASGI app itself (requests driven on one event loop, with a client that can
leave at a moment the test picks), over the embedded model's engine with a scheduler that
never runs a round (`Gate`): what waits in its queue is what the test put there, and
`engine.prepare` calls are counted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import server.door
from server.app import create_app
from server.door import ServeConfig
from specdec.engine import Engine, Request
from specdec.errors import InternalError
from specdec.events import Failed, Finished, GenerationStats, RequestStream, Usage
from specdec.scheduler import Scheduler, Ticket
from specdec.speculative import SpecStats

MAX_BATCH, MAX_QUEUE = 1, 1  # the scheduler holds two requests; a third finds it full


def finished() -> Finished:
    stats = GenerationStats(3, 1, 0.01, None, 0, SpecStats(), 0.01)
    return Finished("stop", "ok", None, (), (5,), (), Usage(3, 1, None), stats)


class Queued:
    """A waiting request's output router: only the scheduler's purge writes to it."""

    def __init__(self, stream: RequestStream) -> None:
        self.stream = stream

    def fail(self, error: Exception) -> None:
        self.stream.put(Failed(error))  # type: ignore[arg-type]


class Gate(Engine):
    """The embedded model's engine (its context, tokenizer, templates and `prepare`) with a
    scheduler that never runs a round. `answer`: a submitted request finishes at once
    (else it waits in the queue); `hold`: `prepare` waits for it; `fault`: what `prepare`
    or the request's run raises."""

    def __init__(self, target: Any) -> None:
        super().__init__(target)
        self.reset()

    def reset(self) -> None:
        self.sched = Scheduler(None, None, max_batch=MAX_BATCH, max_queue=MAX_QUEUE,
                               thread=False)
        self.prepared = 0
        self.answer = True
        self.hold: threading.Event | None = None
        self.fault: tuple[str, Exception] | None = None
        self.tickets: list[Ticket] = []

    def start(self, **_: Any) -> Any:  # type: ignore[override]
        return self.sched

    @property
    def scheduler(self) -> Scheduler:  # type: ignore[override]
        return self.sched

    def check_room(self) -> None:
        self.sched.check_room()

    def prepare(self, request: Any, **fields: Any) -> Request:
        self.prepared += 1
        if self.hold is not None:
            assert self.hold.wait(30), "prepare was never let go"
        if self.fault is not None and self.fault[0] == "prepare":
            raise self.fault[1]
        return super().prepare(request, **fields)

    def submit(self, req: Request, stream: RequestStream | None = None) -> RequestStream:
        assert stream is not None
        if self.fault is not None and self.fault[0] == "run":
            stream.put(Failed(self.fault[1]))  # type: ignore[arg-type]
        elif self.answer:
            stream.put(finished())
        else:
            ticket = Ticket(req, Queued(stream), stream.cancelled)
            self.sched.submit(ticket)
            self.tickets.append(ticket)
        return stream

    def fill(self) -> None:
        """Fill the queue with requests nobody waits for."""
        for _ in range(MAX_BATCH + MAX_QUEUE):
            self.sched.submit(Ticket(None, None))

    def close(self, wait_s: float = 0.0) -> None:
        pass


@pytest.fixture(scope="module")
def gate(embedded: Any) -> Gate:
    return Gate(embedded)


@pytest.fixture
def app(gate: Gate) -> Any:
    gate.reset()
    app = create_app(gate, ServeConfig(max_batch=MAX_BATCH, max_queue=MAX_QUEUE))
    yield app
    app.state.door.close()


# -- driving the app ------------------------------------------------------------------------
class Reply:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> Any:
        return json.loads(self.body)


async def call(app: Any, path: str, body: bytes | dict[str, Any] | None = None, *,
               leave: asyncio.Event | None = None) -> Reply:
    """One request through the ASGI app; the client leaves (`http.disconnect`) when `leave`
    is set, and not before the response is out otherwise."""
    raw = json.dumps(body).encode() if isinstance(body, dict) else body
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "GET" if raw is None else "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"test"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(raw or b"")).encode())],
             "client": ("127.0.0.1", 1), "server": ("test", 80)}
    sent, done = False, asyncio.Event()
    status, headers, chunks = 0, {}, []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw or b"", "more_body": False}
        if done.is_set() or (leave is not None and leave.is_set()):
            return {"type": "http.disconnect"}  # at once: a poll may not wait at all
        waits = [asyncio.ensure_future(done.wait())]
        if leave is not None:
            waits.append(asyncio.ensure_future(leave.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    try:
        await app(scope, receive, send)
    except Exception:  # the app re-raises what its catch-all handler answered
        if not status:
            raise
    return Reply(status, headers, b"".join(chunks))


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))  # type: ignore[arg-type]


def post(app: Any, path: str, body: bytes | dict[str, Any]) -> Reply:
    return run(call(app, path, body))


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Wait for a condition the server reaches on its own (never a timing assertion: the
    limit only turns a hang into a failure)."""
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


# -- the bodies -----------------------------------------------------------------------------
ASK = [{"role": "user", "content": "hi"}]
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": ASK, "max_tokens": 2}),
    "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    "messages": ("/v1/messages", {"model": "default", "messages": ASK, "max_tokens": 2}),
}


def with_field(api: str, path: str, raw: str) -> tuple[str, bytes]:
    """The API's small valid body with `path` (dotted: nested objects) set to the raw JSON
    text `raw` (so that 1e400, NaN or a 400-digit integer reach the server as written)."""
    url, base = BODIES[api]
    body = dict(base)
    head, *rest = path.split(".")
    marker = "\x00VALUE\x00"
    node: Any = marker
    for key in reversed(rest):
        node = {key: node}
    body[head] = node
    if head == "thinking":
        body[head] = {"type": "enabled", **node}
    if head == "top_logprobs" and api == "chat":
        body["logprobs"] = True
    return url, json.dumps(body).replace(json.dumps(marker), raw).encode()


def error_of(api: str, r: Reply) -> tuple[str | None, str]:
    """(param, message) of an error: OpenAI's `param`, or the field leading Anthropic's
    message."""
    err = r.json()["error"]
    if api == "messages":
        return err["message"].split(":")[0], err["message"]
    return err["param"], err["message"]


# -- malformed numbers: a 400 naming the parameter -----------------------------------------
BIG = "1" + "0" * 400  # a 400-digit integer: JSON allows it; float(BIG) overflows
NON_FINITE = ["1e400", "-1e400", "NaN", "Infinity", "-Infinity"]  # Python's json takes them
NOT_NUMBERS = ["true", "false", '"1"', '"0.5"']
FLOAT_BAD = [BIG, "-" + BIG, *NON_FINITE, *NOT_NUMBERS]
INT_BAD = ["-" + BIG, "2.5", *NON_FINITE, *NOT_NUMBERS]
COUNT_BAD = [BIG, *INT_BAD]  # an integer with an upper bound
CASES: list[tuple[str, str, list[str]]] = [
    ("chat", "temperature", FLOAT_BAD),
    ("chat", "top_p", FLOAT_BAD + ["0", "-0.0", "1.5"]),
    ("chat", "top_k", INT_BAD),
    ("chat", "max_tokens", COUNT_BAD + ["0", "-0.0"]),
    ("chat", "max_completion_tokens", COUNT_BAD + ["0"]),
    ("chat", "n", COUNT_BAD + ["2", "0", "-0.0"]),
    ("chat", "seed", COUNT_BAD + ["18446744073709551616"]),
    ("chat", "top_logprobs", COUNT_BAD + ["21"]),
    ("chat", "num_draft_tokens", COUNT_BAD + ["17"]),
    ("chat", "max_thinking_tokens", INT_BAD),
    ("chat", "logit_bias.5", FLOAT_BAD + ["101", "-100.5"]),
    ("completions", "temperature", FLOAT_BAD),
    ("completions", "top_p", FLOAT_BAD + ["-0.0"]),
    ("completions", "top_k", INT_BAD),
    ("completions", "max_tokens", COUNT_BAD),
    ("completions", "n", COUNT_BAD),
    ("completions", "seed", COUNT_BAD),
    ("completions", "logprobs", COUNT_BAD + ["21"]),
    ("completions", "num_draft_tokens", COUNT_BAD),
    ("completions", "logit_bias.5", FLOAT_BAD),
    ("responses", "temperature", FLOAT_BAD),
    ("responses", "top_p", FLOAT_BAD + ["-0.0"]),
    ("responses", "top_k", INT_BAD),
    ("responses", "max_output_tokens", COUNT_BAD + ["0"]),
    ("responses", "seed", COUNT_BAD),
    ("responses", "num_draft_tokens", COUNT_BAD),
    ("responses", "max_thinking_tokens", INT_BAD),
    ("responses", "max_tool_calls", INT_BAD),
    ("messages", "temperature", FLOAT_BAD + ["1.5"]),
    ("messages", "top_p", FLOAT_BAD + ["-0.0"]),
    ("messages", "top_k", INT_BAD),
    ("messages", "max_tokens", COUNT_BAD + ["0"]),
    ("messages", "seed", COUNT_BAD),
    ("messages", "num_draft_tokens", COUNT_BAD + ["17"]),
    ("messages", "thinking.budget_tokens", INT_BAD + ["0"]),
]


@pytest.mark.parametrize("api,field,values", CASES, ids=[f"{a}-{f}" for a, f, _ in CASES])
def test_a_malformed_number_is_a_400_naming_its_parameter(app, gate, api, field, values):
    # Huge integers, 1e400 (inf), NaN and Infinity literals, bools and digit strings, and
    # values just out of range: each a 400 naming the field, before any rendering.
    want = field.split(".")[0] if field.startswith("logit_bias") else field
    wrong = []
    for raw in values:
        url, body = with_field(api, field, raw)
        r = post(app, url, body)
        param, message = (error_of(api, r) if r.status == 400 else (None, r.body.decode()))
        if r.status != 400 or param != want:
            wrong.append((raw[:12], r.status, param, message[:120]))
    assert not wrong, wrong
    assert gate.prepared == 0


LOGIT_BIAS_KEYS = ["²", "9" * 5000, "-1", "1.5", "", "١", " 1", "0x1", "1e3"]


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_a_logit_bias_key_that_is_not_a_token_id_is_a_400(app, gate, api):
    # "²" passes str.isdigit and 5000 digits pass a digit pattern; int() of either raised
    # inside the server.
    url, base = BODIES[api]
    wrong = []
    for key in LOGIT_BIAS_KEYS + ["01"]:
        bias = {key: 1} if key != "01" else {"1": 1, "01": 2}  # one token twice
        r = post(app, url, {**base, "logit_bias": bias})
        if r.status != 400 or r.json()["error"]["param"] != "logit_bias" or \
                len(r.json()["error"]["message"]) > 200:
            wrong.append((key[:12], r.status, r.body[:200]))
    assert not wrong, wrong
    assert gate.prepared == 0


def test_a_token_id_that_is_not_a_number_is_a_400_naming_the_prompt(app):
    for raw in [BIG, "NaN", "1e400", "true", "2.5", '"1"', "-1"]:
        url, body = with_field("completions", "prompt", f"[1, {raw}]")
        r = post(app, url, body)
        assert r.status == 400 and r.json()["error"]["param"] == "prompt", (raw, r.body)


LONG_LISTS = [  # (model, body): a long list whose every item is bad
    ("chat", {"messages": ASK, "tools": [1] * 100_000}),
    ("chat", {"messages": [{"role": "user", "content": [1] * 100_000}]}),
    ("chat", {"messages": ASK, "logit_bias": {str(i): "x" for i in range(100_000)}}),
    ("chat", {"messages": [{"role": "user", "content": 1}] * 8000}),
    ("completions", {"prompt": [0.5] * 8000}),
    ("completions", {"prompt": "hi", "structured_outputs": {"choice": [1] * 100_000}}),
    ("responses", {"input": [{"content": 1}] * 8000}),
    ("responses", {"input": "hi", "tools": [1] * 100_000}),
    ("messages", {"model": "m", "max_tokens": 2, "messages": ASK, "tools": [1] * 100_000}),
    ("messages", {"model": "m", "max_tokens": 2, "messages": ASK,
                  "stop_sequences": [1] * 100_000}),
    ("messages", {"model": "m", "max_tokens": 2,
                  "messages": [{"role": "user", "content": [1] * 100_000}]}),
]


@pytest.mark.parametrize("api,body", LONG_LISTS, ids=[a for a, _ in LONG_LISTS])
def test_a_long_list_of_bad_items_is_one_error(app, api, body):
    # pydantic reports every bad item of a list (a million errors for a body of bad token
    # ids, seconds to build); the first one is the answer (with one error per union member
    # where the item is a union).
    from pydantic import ValidationError

    from server.app import APIS

    url = BODIES[api][0]
    model = next(m for api_ in APIS for p, m in api_.REQUEST_BODIES.items() if p == url)
    with pytest.raises(ValidationError) as info:
        model.model_validate(body, context={"context_length": 8192})
    assert info.value.error_count() <= 2


SURROGATE_FIELDS = {"chat": "messages", "completions": "prompt", "responses": "input",
                    "messages": "messages"}


@pytest.mark.parametrize("api", list(SURROGATE_FIELDS))
def test_an_unpaired_surrogate_escape_is_a_400_naming_its_field(app, gate, api):
    # JSON may escape half of a UTF-16 pair ("\ud800"); Python's json takes it, and the
    # string then is not Unicode text: tokenizers and grammars raised inside the server.
    url, base = BODIES[api]
    field = SURROGATE_FIELDS[api]
    text = json.dumps({**base, field: "a@b" if api in ("completions", "responses")
                       else [{"role": "user", "content": "a@b"}]})
    r = post(app, url, text.replace("@", "\\udc00").encode())  # the escape, as JSON text
    assert r.status == 400, r.body
    param, message = error_of(api, r)
    assert param.startswith(field) and "surrogate" in message
    # A pair is one character (an emoji), and fine.
    r = post(app, url, text.replace("@", "\\ud83d\\ude00").encode())
    assert r.status == 200, r.body
    assert gate.prepared == 1


# -- no exception text reaches a client -----------------------------------------------------
@pytest.mark.parametrize("api", ["chat", "completions", "responses", "messages"])
@pytest.mark.parametrize("where", ["prepare", "run"])
def test_an_internal_fault_is_answered_with_a_reference_not_its_text(app, gate, caplog, api,
                                                                     where):
    secret = "secret-detail-/srv/model/weights"
    gate.fault = (where, RuntimeError(secret) if where == "prepare"
                  else InternalError(f"proposing tokens failed: {secret}"))
    url, body = BODIES[api]
    with caplog.at_level(logging.ERROR, logger="specdec.server"):
        r = post(app, url, body)
    assert r.status == 500
    text = r.body.decode()
    assert secret not in text, text
    ref = re.search(r"\(ref ([0-9a-f]{8})\)", text)
    assert ref, text
    logged = [rec for rec in caplog.records if ref.group(1) in rec.getMessage()]
    assert logged, [rec.getMessage() for rec in caplog.records]
    assert any(secret in (rec.getMessage() + (rec.exc_text or "")) or
               (rec.exc_info and secret in str(rec.exc_info[1])) for rec in logged)


# -- admission before work --------------------------------------------------------------------
def test_a_full_queue_answers_503_before_any_work(app, gate):
    gate.fill()
    for api, (url, body) in BODIES.items():
        r = post(app, url, body)
        assert r.status == 503, (api, r.body)
        assert r.headers.get("retry-after") == "1"
        code = r.json()["error"]["code"]
        assert code == "queue_full", (api, r.body)
    assert gate.prepared == 0
    # Counting tokens queues nothing: a full queue does not refuse it.
    r = post(app, "/v1/messages/count_tokens", {"model": "default", "messages": ASK})
    assert r.status == 200 and r.json()["input_tokens"] > 0


def test_an_8_mib_body_next_to_a_full_queue_is_refused_unread(app, gate, monkeypatch):
    # Refused before its JSON is parsed: no parse, no prepare, nothing on the event loop.
    parsed = []
    door = app.state.door
    real = door.validate
    monkeypatch.setattr(door, "validate", lambda raw, model: (parsed.append(1),
                                                              real(raw, model))[1])
    gate.fill()
    limit = ServeConfig().max_body_bytes
    big = json.dumps({"prompt": [1] * ((limit - 64) // 3), "max_tokens": 2}).encode()
    assert limit - 64 <= len(big) <= limit  # 8 MiB of token ids

    async def go() -> tuple[Reply, Reply]:
        refused = asyncio.ensure_future(call(app, "/v1/completions", big))
        health = await call(app, "/health")
        return await refused, health

    refused, health = run(go())
    assert refused.status == 503 and refused.json()["error"]["code"] == "queue_full"
    assert health.status == 200
    assert parsed == [] and gate.prepared == 0


def test_a_large_body_is_parsed_off_the_event_loop(app, gate, monkeypatch):
    # The big body's parse is held at its depth check until a /health request has been
    # answered: were it on the event loop, /health could not be answered meanwhile (the
    # hold would time out and the test fail), whatever the machine's speed.
    answered, where = threading.Event(), []
    real = server.door._depth

    def held(x: Any) -> int:
        where.append(threading.current_thread().name)
        if len(where) == 1:
            answered.wait(30)
        return real(x)

    monkeypatch.setattr(server.door, "_depth", held)
    ids = [1] * 1_500_000  # ~4.5 MB of token ids, far over the context
    big = json.dumps({"prompt": ids, "max_tokens": 2}).encode()

    async def go() -> tuple[Reply, Reply, Reply]:
        parsing = asyncio.ensure_future(call(app, "/v1/completions", big))
        await until(lambda: bool(where), "the big body's parse to start")
        health = await call(app, "/health")
        answered.set()
        small = await call(app, "/v1/completions", {"prompt": [1] * 9000, "max_tokens": 2})
        return await parsing, health, small

    refused, health, small = run(go())
    assert health.status == 200
    assert where[0].startswith("specdec-parse")  # the big body: a parse thread
    assert where[1] == threading.current_thread().name  # a small body: on the event loop
    for r in (refused, small):  # a prompt of token ids is checked by length, not rendered
        err = r.json()["error"]
        assert r.status == 400 and (err["param"], err["code"]) == ("prompt",
                                                                  "context_length_exceeded")
    assert gate.prepared == 0


@pytest.mark.parametrize("api", ["chat", "completions", "responses", "messages"])
def test_a_prompt_that_cannot_fit_the_context_is_refused_before_rendering(app, gate, api):
    bound = app.state.door.bound
    text = "a" * int(bound.context * bound.bytes_per_token + 1)  # over even at the bound
    url, base = BODIES[api]
    body = dict(base)
    key = {"chat": "messages", "completions": "prompt", "responses": "input",
           "messages": "messages"}[api]
    body[key] = text if api in ("completions", "responses") else [
        {"role": "user", "content": text}]
    r = post(app, url, body)
    assert r.status == 400, r.body[:300]
    if api == "messages":
        assert r.json()["error"]["message"].startswith("messages")
    else:
        err = r.json()["error"]
        assert (err["param"], err["code"]) == (key, "context_length_exceeded")
    assert gate.prepared == 0


def test_many_turns_and_max_tokens_are_checked_against_the_context_before_rendering(app, gate):
    ctx = app.state.door.bound.context
    turns = [{"role": "user", "content": ""}] * ctx  # a role marker each, at least
    r = post(app, "/v1/chat/completions", {"messages": turns, "max_tokens": 2})
    assert r.status == 400 and r.json()["error"]["param"] == "messages"
    r = post(app, "/v1/completions", {"prompt": [1] * (ctx - 10), "max_tokens": 11})
    assert r.status == 400 and r.json()["error"]["param"] == "max_tokens"
    r = post(app, "/v1/chat/completions", {"messages": ASK, "max_completion_tokens": ctx})
    assert r.status == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    assert gate.prepared == 0
    r = post(app, "/v1/completions", {"prompt": [1] * (ctx - 11), "max_tokens": 11})
    assert r.status == 200 and gate.prepared == 1  # at the limit: admitted


def test_prepares_past_the_pool_bound_answer_503(app, gate):
    # Rendering and tokenizing run in a bounded pool: past its workers and max_queue
    # waiting, a request is refused rather than queued behind unbounded work.
    gate.hold = threading.Event()
    limit = server.door.PREPARE_WORKERS + MAX_QUEUE
    url, body = BODIES["chat"]

    async def go() -> tuple[list[Reply], Reply]:
        held = [asyncio.ensure_future(call(app, url, body)) for _ in range(limit)]
        await until(lambda: app.state.door.prepares.pending == limit, "the pool to fill")
        refused = await call(app, url, body)
        gate.hold.set()
        return list(await asyncio.gather(*held)), refused

    done, refused = run(go())
    assert refused.status == 503 and refused.json()["error"]["code"] == "queue_full"
    assert [r.status for r in done] == [200] * limit
    assert gate.prepared == server.door.PREPARE_WORKERS + MAX_QUEUE


def test_a_client_that_leaves_while_queued_frees_its_place_at_once(app, gate):
    gate.answer = False  # submitted requests wait in the queue
    url, body = BODIES["chat"]
    leave = [asyncio.Event() for _ in range(3)]

    async def go() -> tuple[Reply, list[Reply]]:
        first = [asyncio.ensure_future(call(app, url, body, leave=leave[i])) for i in range(2)]
        await until(lambda: gate.sched.queue_depth == 2, "two requests queued")
        full = await call(app, url, body)
        leave[0].set()  # the first client goes away while its request waits
        await until(lambda: any(t.cancelled.is_set() for t in gate.tickets),
                    "its request cancelled")
        late = asyncio.ensure_future(call(app, url, body, leave=leave[2]))
        await until(lambda: len(gate.tickets) == 3 or late.done(), "the next one's fate")
        assert not late.done(), late.result().body  # admitted, not refused
        assert gate.sched.queue_depth == 2  # the left one's place is the late one's
        for ev in leave:
            ev.set()
        return full, list(await asyncio.gather(*first, late))

    full, rest = run(go())
    assert full.status == 503 and full.json()["error"]["code"] == "queue_full"
    assert all(r.status == 499 for r in rest), [r.status for r in rest]
