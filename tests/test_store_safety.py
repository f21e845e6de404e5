"""The store loses nothing and never stalls (`server/store.py`): deletes of their own kind,
bounds per conversation or chain (a 400 before any work), eviction of whole units least
recently used first (reads count), duplicate item ids refused, deleted and expired content
gone everywhere (expiry on read, the file shrinking), owner-only files whether new or there
before, a schema version and the previous release's file migrated, linear growth (a chain
stores what each turn added), one transaction per turn (a fault inside it stores nothing),
every store failure a 503 on every route, and one turn at a time per conversation.

The store itself is tested directly; the routes through the openai SDK against the app in
process over the stand-in engine (tests/fakeengine.py). The turn killed inside its
transaction is tested against a real server in tests/test_store_server.py."""

from __future__ import annotations

import json
import sqlite3
import stat
import threading
import time
from pathlib import Path

import openai
import pytest

from server.store import (Bounds, Duplicate, SCHEMA_VERSION, PostgresStore, SqliteStore,
                          TooLarge)
from tests.fakeengine import FakeEngine, finished
from tests.serverproc import InProcess

DATA = Path(__file__).parent / "data"


def sdk_error(call) -> openai.APIStatusError:
    """The SDK's error for a call that must fail (its `body` the error object)."""
    with pytest.raises(openai.APIStatusError) as e:
        call()
    return e.value


def msg(iid: str, text: str = "hi", role: str = "user") -> dict:
    return {"type": "message", "id": iid, "role": role, "status": "completed",
            "content": [{"type": "input_text" if role == "user" else "output_text",
                         "text": text}]}


def resp(rid: str, text: str = "x", **extra) -> dict:
    return {"id": rid, "object": "response", "created_at": 1, "status": "completed",
            "model": "default", **extra, "output": [msg(f"msg_{rid}", text, "assistant")]}


# -- the store itself ------------------------------------------------------------------------
@pytest.fixture(params=["sqlite", "postgresql"])
def new_store(request):
    """`new_store(bounds=Bounds())`: a new empty store of each backend (SQLite in memory;
    a new database on the session's real PostgreSQL server)."""
    made = []

    def make(bounds: Bounds = Bounds()):
        if request.param == "sqlite":
            s = SqliteStore(bounds=bounds)
        else:
            s = PostgresStore(request.getfixturevalue("postgres").database(), bounds)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_a_delete_acts_on_its_own_kind_only(new_store):
    s = new_store()
    s.put_turn(resp("resp_1"), [msg("in_1")])
    s.new_conversation("conv_1", {}, [msg("c_1")])
    assert not s.delete_response("conv_1") and not s.delete_conversation("resp_1")
    assert [i["id"] for i in s.conversation_items("conv_1")] == ["c_1"]
    assert [i["id"] for i in s.context("resp_1")] == ["in_1", "msg_resp_1"]
    assert s.delete_response("resp_1") and s.delete_conversation("conv_1")
    assert s.response("resp_1") is None and s.conversation_items("conv_1") is None
    assert s.stats() == {"responses": 0, "conversations": 0, "bytes": 0}


def test_a_chain_stores_what_each_turn_added_and_rebuilds_its_context(new_store):
    s = new_store()
    s.put_turn(resp("resp_1", "a"), [msg("in_1")])
    s.put_turn(resp("resp_2", "b"), [msg("in_2")], parent="resp_1")
    s.put_turn(resp("resp_3", "c"), [msg("in_3")], parent="resp_2")
    assert [i["id"] for i in s.input_items("resp_3")] == [
        "in_1", "msg_resp_1", "in_2", "msg_resp_2", "in_3"]
    assert [i["id"] for i in s.context("resp_3")][-1] == "msg_resp_3"
    assert s.response("resp_3")["output"][0]["content"][0]["text"] == "c"
    # a deleted response is gone everywhere: from what continued it, and by reference
    assert s.delete_response("resp_1")
    assert [i["id"] for i in s.input_items("resp_3")] == ["in_2", "msg_resp_2", "in_3"]
    assert s.item("in_1") is None and s.item("in_2")["id"] == "in_2"


def test_a_50_turn_chain_grows_linearly(new_store):
    s = new_store()
    unique, parent = 0, None
    for n in range(50):
        own = [msg(f"in_{n}", f"question {n} " + "q" * 900)]
        r = resp(f"resp_{n}", f"answer {n} " + "a" * 900)
        s.put_turn(r, own, parent=parent)
        unique += sum(len(json.dumps(it)) for it in own + r["output"])
        parent = r["id"]
    assert len(s.context(parent)) == 100
    assert s.stats()["bytes"] <= 1.2 * unique


def test_one_unit_cannot_outgrow_its_bound_or_evict_everyone(new_store):
    s = new_store(Bounds(max_age_s=None, max_count=None, max_bytes=400_000,
                                  max_object_bytes=100_000))
    for n in range(20):
        s.put_turn(resp(f"resp_{n}", "y" * 5_000), [])
    s.new_conversation("conv_big", {}, [])
    with pytest.raises(TooLarge) as e:
        for n in range(100):
            s.add_items("conv_big", [msg(f"m_{n}", "z" * 20_000)])
    assert e.value.bound == 100_000 and "100000 bytes" in str(e.value)
    assert sum(s.response(f"resp_{n}") is not None for n in range(20)) == 20
    with pytest.raises(TooLarge):
        s.check_room("conv_big", 100_000)
    s.check_room(None, 50_000)  # a new unit has room


def test_eviction_drops_whole_units_least_recently_used_never_the_one_written(new_store):
    s = new_store(Bounds(max_age_s=None, max_count=6, max_bytes=None))
    s.put_turn(resp("resp_a1"), [])
    s.put_turn(resp("resp_a2"), [], parent="resp_a1")
    s.put_turn(resp("resp_a3"), [], parent="resp_a2")  # one unit of three
    s.put_turn(resp("resp_b"), [])
    s.put_turn(resp("resp_c"), [])
    time.sleep(0.01)
    assert s.response("resp_a1") is not None  # a read is a use: the chain is the newest
    s.put_turn(resp("resp_d"), [])
    s.put_turn(resp("resp_e"), [])  # 7 > 6: the least recently used unit goes (b)
    assert s.response("resp_b") is None
    assert all(s.response(r) for r in ("resp_a1", "resp_a2", "resp_a3", "resp_c", "resp_e"))
    s2 = new_store(Bounds(max_age_s=None, max_count=2, max_bytes=None))
    for n in range(4):  # the unit being written is never evicted, even past the bound
        s2.put_turn(resp(f"resp_{n}"), [], parent=f"resp_{n - 1}" if n else None)
    assert [s2.response(f"resp_{n}") is not None for n in range(4)] == [True] * 4
    assert len(s2.context("resp_3")) == 4  # no part of a chain evicted


def test_duplicate_item_ids_are_refused(new_store):
    s = new_store()
    with pytest.raises(Duplicate):
        s.new_conversation("conv_1", {}, [msg("a"), msg("a")])
    s.new_conversation("conv_1", {}, [msg("a")])
    with pytest.raises(Duplicate) as e:
        s.add_items("conv_1", [msg("b"), msg("a")])
    assert str(e.value) == "Duplicate item found with id a."
    assert [i["id"] for i in s.conversation_items("conv_1")] == ["a"]  # nothing added


def test_expiry_is_enforced_on_read(new_store):
    s = new_store(Bounds(max_age_s=0.05, max_count=None, max_bytes=None))
    s.put_turn(resp("resp_1"), [msg("in_1")])
    s.new_conversation("conv_1", {}, [msg("c_1")])
    time.sleep(0.1)  # no write since
    assert s.response("resp_1") is None and s.item("in_1") is None
    assert s.conversation("conv_1") is None and s.item("c_1") is None
    assert s.stats()["bytes"] == 0


def test_the_file_gives_deleted_space_back(tmp_path):
    path = tmp_path / "s.sqlite3"
    s = SqliteStore(path)
    for n in range(40):
        s.put_turn(resp(f"resp_{n}", "x" * 100_000), [])
    s._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    full = path.stat().st_size
    for n in range(40):
        assert s.delete_response(f"resp_{n}")
    s._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert path.stat().st_size < full / 4


def test_the_files_are_owner_only_new_or_existing(tmp_path):
    path = tmp_path / "s.sqlite3"
    s = SqliteStore(path)
    s.put_turn(resp("resp_1"), [])
    s.close()
    for p in (path, Path(str(path) + "-wal"), Path(str(path) + "-shm")):
        if p.exists():
            p.chmod(0o644)
    s = SqliteStore(path)
    s.put_turn(resp("resp_2"), [])
    for p in (path, Path(str(path) + "-wal"), Path(str(path) + "-shm")):
        if p.exists():
            assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    assert s.response("resp_1") is not None


def test_the_previous_releases_file_is_migrated(tmp_path):
    """tests/data/store_v1.sqlite3 was written by the previous release's store: a response
    (resp_v1a) continued by another (resp_v1b, its whole context stored with it), and a
    conversation (conv_v1) with two items."""
    path = tmp_path / "s.sqlite3"
    path.write_bytes((DATA / "store_v1.sqlite3").read_bytes())
    s = SqliteStore(path, Bounds(max_age_s=None))  # (written when the fixture was made)
    assert s._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert s.response("resp_v1b")["output"][0]["content"][0]["text"] == "Blue."
    assert [i["role"] for i in s.input_items("resp_v1b")] == ["user", "assistant", "user"]
    assert [i["id"] for i in s.conversation_items("conv_v1")] == ["msg_c1", "msg_c2"]
    s.put_turn(resp("resp_new"), [msg("in_new")], parent="resp_v1b")
    assert len(s.context("resp_new")) == 6  # its 4, the new input, the new answer
    s.close()
    s = SqliteStore(path, Bounds(max_age_s=None))  # opens as it is now
    assert s.response("resp_new") is not None


def test_a_file_from_a_later_release_is_refused(tmp_path):
    from server.store import Unavailable

    path = tmp_path / "s.sqlite3"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(Unavailable, match="later release"):
        SqliteStore(path)


def test_a_turn_is_one_transaction(monkeypatch, new_store):
    s = new_store()
    s.new_conversation("conv_1", {}, [msg("c_1")])

    def fault() -> None:
        raise OSError("disk I/O error")

    monkeypatch.setattr(s, "_pause", fault)  # fails between the response and its items
    with pytest.raises(OSError):
        s.put_turn(resp("resp_1"), [msg("in_1")], conversation="conv_1", upto=1)
    assert s.response("resp_1") is None
    assert [i["id"] for i in s.conversation_items("conv_1")] == ["c_1"]
    monkeypatch.undo()
    s.put_turn(resp("resp_1"), [msg("in_1")], conversation="conv_1", upto=1)
    assert [i["id"] for i in s.conversation_items("conv_1")] == ["c_1", "in_1", "msg_resp_1"]


# -- through the routes ----------------------------------------------------------------------

class SlowEngine(FakeEngine):
    """The stand-in engine answering each request after `delay_s` (from another thread,
    as the scheduler does)."""

    def __init__(self, delay_s: float = 0.05) -> None:
        self.n = 0
        self.lock = threading.Lock()
        super().__init__(self.answer)
        self.delay_s = delay_s

    def answer(self, greq):
        with self.lock:
            self.n += 1
            n = self.n
        return [finished(f"answer {n}")]

    def submit(self, req, stream):
        events = list(self.events)

        def later() -> None:
            time.sleep(self.delay_s)
            for ev in events:
                stream.put(ev)
        threading.Thread(target=later, daemon=True).start()
        return stream


def serve(engine, *args: str):
    from server.app import create_app
    from specdec import cli

    config = cli.serve_config(cli.build_parser().parse_args(["serve", "--store", "memory",
                                                             *args]))
    return InProcess(create_app(engine, config))


def test_a_delete_of_the_wrong_kind_is_a_404_that_deletes_nothing():
    app = serve(FakeEngine([finished("Blue.")]))
    try:
        c = app.client()
        conv = c.conversations.create(items=[{"type": "message", "role": "user",
                                              "content": "Hello."}])
        r = c.responses.create(model="default", input="Name a colour.")
        assert sdk_error(lambda: c.responses.delete(conv.id)).status_code == 404
        assert sdk_error(lambda: c.conversations.delete(r.id)).status_code == 404
        assert len(c.conversations.items.list(conv.id).data) == 1
        assert c.responses.input_items.list(r.id).data[0].content[0].text == "Name a colour."
        r2 = c.responses.create(model="default", input="Again.", previous_response_id=r.id)
        assert [i.type for i in c.responses.input_items.list(r2.id, order="asc").data] == [
            "message", "message", "message"]
    finally:
        app.stop()


def test_a_reference_to_an_item_already_in_the_context_is_a_400():
    app = serve(FakeEngine([finished("Blue.")]))
    try:
        c = app.client()
        r = c.responses.create(model="default", input="Name a colour.")
        first = c.responses.input_items.list(r.id).data[0].id
        e = sdk_error(lambda: c.responses.create(
            model="default", previous_response_id=r.id,
            input=[{"type": "item_reference", "id": first}]))
        assert e.status_code == 400
        assert e.body["message"] == f"Duplicate item found with id {first}."
        assert e.body["param"] == "input"
    finally:
        app.stop()


def test_a_turn_past_the_unit_bound_is_a_400_before_any_work():
    engine = FakeEngine([finished("Blue.")])
    app = serve(engine, "--store-max-object-mb", "1")
    try:
        c = app.client()
        e = sdk_error(lambda: c.responses.create(model="default", input="x" * (1 << 20)))
        assert e.status_code == 400 and "bound of 1048576 bytes" in e.body["message"]
        assert e.body["code"] == "store_bound_exceeded" and engine.seen == []
        r = c.responses.create(model="default", input="x" * (1 << 20), store=False)
        assert r.status == "completed" and len(engine.seen) == 1  # not stored: no bound
    finally:
        app.stop()


ROUTES = [
    ("post", "/v1/responses", {"model": "default", "input": "hi"}),
    ("post", "/v1/responses", {"model": "default", "input": "hi",
                               "previous_response_id": "resp_x"}),
    ("get", "/v1/responses/resp_x", None),
    ("delete", "/v1/responses/resp_x", None),
    ("get", "/v1/responses/resp_x/input_items", None),
    ("post", "/v1/conversations", {"items": []}),
    ("get", "/v1/conversations/conv_x", None),
    ("post", "/v1/conversations/conv_x", {"metadata": {"a": "b"}}),
    ("delete", "/v1/conversations/conv_x", None),
    ("get", "/v1/conversations/conv_x/items", None),
    ("post", "/v1/conversations/conv_x/items", {"items": [{"type": "message", "role": "user",
                                                          "content": "hi"}]}),
    ("get", "/v1/conversations/conv_x/items/msg_x", None),
    ("delete", "/v1/conversations/conv_x/items/msg_x", None),
]


@pytest.mark.parametrize("method,path,body", ROUTES)
def test_a_failing_store_is_a_503_on_every_route(method, path, body):
    app = serve(FakeEngine([finished("Blue.")]))
    try:
        store = app._asgi.app.state.door.store  # type: ignore[attr-defined]

        def broken(*a, **k):
            raise sqlite3.OperationalError("database is locked")

        for name in ("put_turn", "response", "context", "input_items", "delete_response",
                     "item", "new_conversation", "conversation", "conversation_items",
                     "conversation_seen", "update_conversation", "delete_conversation",
                     "add_items", "delete_item", "check_room"):
            setattr(store, name, broken)
        r = app.http.request(method.upper(), path, json=body)
        assert r.status_code == 503, (path, r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "store_unavailable"
        assert "database is locked" in err["message"]
    finally:
        app.stop()


def test_concurrent_turns_on_a_conversation_run_one_at_a_time():
    engine = SlowEngine(0.05)
    app = serve(engine)
    try:
        c = app.client()
        conv = c.conversations.create()
        errors: list[BaseException] = []

        def turn(n: int) -> None:
            try:
                c.responses.create(model="default", input=f"turn {n}", conversation=conv.id)
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)

        threads = [threading.Thread(target=turn, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        items = c.conversations.items.list(conv.id, order="asc", limit=100).data
        assert len(items) == 16
        # in a consistent order: each question followed by its answer
        assert [i.role for i in items] == ["user", "assistant"] * 8
        # each turn saw every earlier one: the k-th prepared request holds 2k + 1 messages
        assert sorted(len(g.messages) for g in engine.seen) == [2 * k + 1 for k in range(8)]
    finally:
        app.stop()


def test_a_turn_waiting_past_its_time_limit_is_a_409_naming_the_conversation():
    engine = SlowEngine(3.0)
    app = serve(engine, "--request-timeout", "1")
    try:
        c = app.client()
        conv = c.conversations.create()
        first = threading.Thread(target=lambda: c.responses.create(  # (takes 3 s)
            model="default", input="one", conversation=conv.id))
        first.start()
        turns = app._asgi.app.state.door.turns  # type: ignore[attr-defined]
        deadline = time.time() + 60
        while not (conv.id in turns and turns[conv.id].locked()):  # the first holds it
            assert time.time() < deadline
            time.sleep(0.01)
        e = sdk_error(lambda: c.responses.create(model="default", input="two",
                                                conversation=conv.id))
        assert e.status_code == 409 and conv.id in e.body["message"]
        assert e.body["code"] == "conversation_locked" and e.body["param"] == "conversation"
        first.join()
    finally:
        app.stop()


def test_store_work_never_holds_the_event_loop():
    """A store call that takes a second (a locked file, a slow disk) holds only its own
    request: /health and other routes answer meanwhile."""
    app = serve(FakeEngine([finished("Blue.")]))
    try:
        c = app.client()
        r = c.responses.create(model="default", input="Name a colour.")
        store = app._asgi.app.state.door.store  # type: ignore[attr-defined]
        slow = store.context
        inside, release = threading.Event(), threading.Event()

        def stalled(*args):  # held until the other requests were answered (at most 60 s)
            inside.set()
            release.wait(60)
            return slow(*args)

        store.context = stalled
        done: list = []
        t = threading.Thread(target=lambda: done.append(c.responses.create(
            model="default", input="Again.", previous_response_id=r.id)))
        t.start()
        assert inside.wait(60)  # the turn is inside its store read now
        assert app.http.get("/health").status_code == 200
        assert app.http.get("/v1/models").status_code == 200
        # answered while the store call was still held (a held loop would answer only after)
        assert not release.is_set() and not done
        release.set()
        t.join()
        assert done and done[0].previous_response_id == r.id  # the stalled turn went on
    finally:
        app.stop()


@pytest.mark.parametrize("url, why", [
    ("postgresql://user@127.0.0.1:1/db", "cannot reach"), ("sqlite:///tmp/x.db", "not supported"),
    ("s3://bucket/key", "not supported")])
def test_a_store_url_is_an_error_at_start_never_a_file_path(url, why, tmp_path, monkeypatch):
    """An unknown scheme, or a database that cannot be reached, is an error at start."""
    from specdec import cli
    from specdec.errors import ModelConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelConfigError, match=why):
        cli.serve_config(cli.build_parser().parse_args(["serve", "--store", url]))
    assert list(tmp_path.iterdir()) == []  # no folder named after the scheme


KEYS = ("k-alice", "k-bob")


def test_each_keys_stored_objects_are_its_own():
    """Two keys: every stored-object route and parameter of the other key's objects is a 404
    (nothing about them leaks), and each key's own work as before."""
    app = serve(FakeEngine([finished("Blue.")]), "--api-key", KEYS[0], "--api-key", KEYS[1])
    try:
        alice, bob = app.client(KEYS[0]), app.client(KEYS[1])
        conv = alice.conversations.create(items=[{"type": "message", "role": "user",
                                                  "content": "Hello."}])
        r = alice.responses.create(model="default", input="Name a colour.")
        item = alice.responses.input_items.list(r.id).data[0].id
        conv_item = alice.conversations.items.list(conv.id).data[0].id
        tries = {
            "retrieve": lambda: bob.responses.retrieve(r.id),
            "delete": lambda: bob.responses.delete(r.id),
            "cancel": lambda: bob.responses.cancel(r.id),
            "stream": lambda: list(bob.responses.retrieve(r.id, stream=True)),
            "input_items": lambda: bob.responses.input_items.list(r.id),
            "previous_response_id": lambda: bob.responses.create(
                model="default", input="x", previous_response_id=r.id),
            "conversation": lambda: bob.responses.create(model="default", input="x",
                                                         conversation=conv.id),
            "item_reference": lambda: bob.responses.create(
                model="default", input=[{"type": "item_reference", "id": item}]),
            "conversations.retrieve": lambda: bob.conversations.retrieve(conv.id),
            "conversations.update": lambda: bob.conversations.update(conv.id,
                                                                     metadata={"a": "b"}),
            "conversations.delete": lambda: bob.conversations.delete(conv.id),
            "items.list": lambda: bob.conversations.items.list(conv.id),
            "items.create": lambda: bob.conversations.items.create(
                conv.id, items=[{"type": "message", "role": "user", "content": "x"}]),
            "items.retrieve": lambda: bob.conversations.items.retrieve(conv_item,
                                                                       conversation_id=conv.id),
            "items.delete": lambda: bob.conversations.items.delete(conv_item,
                                                                   conversation_id=conv.id),
            "conversation item_reference": lambda: bob.conversations.create(
                items=[{"type": "item_reference", "id": conv_item}]),
        }
        for name, call in tries.items():
            e = sdk_error(call)
            assert e.status_code == 404, (name, e.status_code, e.body)
        # nothing of alice's changed, and she still has all of it
        assert alice.responses.retrieve(r.id).id == r.id
        assert [i.id for i in alice.conversations.items.list(conv.id).data] == [conv_item]
        assert alice.conversations.retrieve(conv.id).metadata in ({}, None)
        r2 = alice.responses.create(model="default", input="Again.", previous_response_id=r.id)
        assert len(alice.responses.input_items.list(r2.id).data) == 3
        # bob's own objects work for bob
        rb = bob.responses.create(model="default", input="Mine.")
        assert bob.responses.retrieve(rb.id).id == rb.id
        assert sdk_error(lambda: alice.responses.retrieve(rb.id)).status_code == 404
        # a wrong key is a 401, as before
        assert sdk_error(lambda: app.client("nope").responses.retrieve(rb.id)).status_code == 401
    finally:
        app.stop()


def test_the_v2_file_gains_owners(tmp_path):
    """A file of the units layout (schema 2) opens with its objects owned by no key."""
    path = tmp_path / "s.sqlite3"
    s = SqliteStore(path)
    s.put_turn(resp("resp_1"), [msg("in_1")])
    s._db.execute("ALTER TABLE responses DROP COLUMN owner")
    s._db.execute("ALTER TABLE responses DROP COLUMN runner")
    s._db.execute("ALTER TABLE conversations DROP COLUMN owner")
    s._db.execute("PRAGMA user_version=2")
    s.close()
    s = SqliteStore(path)
    assert s.response("resp_1") is not None and s.response("resp_1", "key-x") is None
    assert s._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    s.put_turn({**resp("resp_2"), "status": "queued"}, [], final=False, runner="here:1")
    assert s.runner_of("resp_2") == "here:1"


def test_the_v3_file_gains_runners(tmp_path):
    """A file of schema 3 (owners, no runners) opens with no response's runner recorded."""
    path = tmp_path / "s.sqlite3"
    s = SqliteStore(path)
    s.put_turn(resp("resp_1"), [msg("in_1")], owner="key-a")
    s._db.execute("ALTER TABLE responses DROP COLUMN runner")
    s._db.execute("PRAGMA user_version=3")
    s.close()
    s = SqliteStore(path)
    assert s.response("resp_1", "key-a") is not None and s.runner_of("resp_1") is None
    assert s._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_a_background_response_is_replaced_when_it_ends_and_marked_failed_if_left(new_store):
    """A background response is written queued (adding nothing to its conversation), then
    replaced when it ends (counted once); one left queued or in progress by a stopped server
    is marked failed when the store opens again (`Store.interrupted`)."""
    s = new_store()
    conv = s.new_conversation("conv_1", {}, [msg("m0")])["id"]
    own = [msg("m1", "Hello.")]
    queued = {**resp("resp_b"), "status": "queued", "output": [], "background": True}
    s.put_turn(queued, own, conversation=conv, upto=1, final=False)
    assert s.response("resp_b")["status"] == "queued"
    assert [i["id"] for i in s.conversation_items(conv)] == ["m0"]  # nothing added yet
    s.put_turn({**resp("resp_b", "Hi."), "background": True}, own, conversation=conv, upto=1)
    assert s.response("resp_b")["status"] == "completed"
    assert [i["id"] for i in s.conversation_items(conv)] == ["m0", "m1", "msg_resp_b"]
    alone = new_store()
    alone.new_conversation("conv_1", {}, [msg("m0")])
    alone.put_turn({**resp("resp_b", "Hi."), "background": True}, own, conversation=conv,
                   upto=1)
    assert s.stats() == alone.stats()  # the queued state is not counted twice
    s.put_turn({**queued, "id": "resp_c", "status": "in_progress"}, [msg("m2")], final=False,
               runner="a:1")
    s.put_turn({**queued, "id": "resp_d", "status": "in_progress"}, [msg("m3")], final=False,
               runner="b:1")
    assert s.interrupted("replica b stopped", runner="b:1") == 1  # only what b ran
    assert s.response("resp_d")["status"] == "failed"
    assert s.response("resp_c")["status"] == "in_progress"
    assert s.interrupted("the server stopped") == 1
    left = s.response("resp_c")
    assert left["status"] == "failed" and left["error"]["message"] == "the server stopped"
    assert s.response("resp_b")["status"] == "completed" and s.interrupted("again") == 0
