"""What the Responses API keeps between requests: stored responses and conversations.

`Store` is the interface the routes use; `open_store` makes the backend `--store` names.
Two backends, one implementation of the rules in SQL (`SqlStore`): `SqliteStore`, Python's
own `sqlite3`, in a file that survives restarts (`specdec serve --store PATH`, by default
`responses.sqlite3` in the cache directory, `$SPECDEC_CACHE`, or in memory, `--store
memory`), for one machine; and `PostgresStore` (`--store postgresql://...`, psycopg 3), one
database that several replicas share: each transaction first takes one advisory lock, so
the replicas' writes run one at a time as one server's do. Its guarantees, whatever the
backend:

- **A turn is one transaction**: a response, its items and its conversation's new items are
  stored together or not at all (`put_turn`).
- **Linear growth**: a response stores what it added (its own input items, its output once)
  and a link to what it continued (its previous response, or the conversation and how many
  of its items it saw); its context is rebuilt by following the links.
- **Bounds**: every chain of responses (a first response and all that continue it) and every
  conversation (with the responses made in it) is one *unit*, at most `max_object_bytes`
  (a request that would make its unit larger is refused before any work, `check_room`);
  the store keeps at most `max_bytes` and `max_count` objects, evicting whole units, least
  recently used first (a read is a use), never the unit being written; a unit unused for
  `max_age_s` is gone (on every read and write).
- **Deletes act on their own kind**: deleting a response or a conversation deletes that
  object's own items; what continued it no longer sees them (gone everywhere).
- **Duplicate item ids** in one context are refused (`Duplicate`).

An item is stored in its wire form (a dict, as `GET .../input_items` returns it) with its id.
Thread-safe (one connection, one lock); the server calls it off its event loop. A store
that fails (its file, its lock, its disk, its database unreachable) raises
`StoreUnavailable`, or `sqlite3.Error` (the server answers 503 to both).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import Duplicate, StoreUnavailable, TooLarge

Unavailable = StoreUnavailable

Item = dict[str, Any]

SCHEMA_VERSION = 4  # `PRAGMA user_version`; 0 with tables: the first release's layout (v1);
# 2: units and links, no owners; 3: each response and conversation its owner (an API key's);
# 4: the server running each background response (`runner`)
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS units (
    id TEXT PRIMARY KEY, used REAL NOT NULL, bytes INTEGER NOT NULL, objects INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS units_by_use ON units (used);
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, unit TEXT NOT NULL, parent TEXT, conversation TEXT, upto INTEGER,
    created REAL NOT NULL, bytes INTEGER NOT NULL, body TEXT NOT NULL,
    owner TEXT NOT NULL DEFAULT '', runner TEXT);
CREATE INDEX IF NOT EXISTS responses_by_unit ON responses (unit);
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY, created INTEGER NOT NULL, bytes INTEGER NOT NULL,
    next INTEGER NOT NULL, metadata TEXT NOT NULL, owner TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS items (
    owner TEXT NOT NULL, seq INTEGER NOT NULL, id TEXT NOT NULL, part TEXT NOT NULL,
    item TEXT NOT NULL, PRIMARY KEY (owner, seq));
CREATE INDEX IF NOT EXISTS items_by_id ON items (id);
"""

# The same tables in PostgreSQL: 64-bit sizes and times; the schema's version in `meta`
# ("schema"); items numbered as written (`n`, SQLite's rowid there).
PG_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS units (
    id TEXT PRIMARY KEY, used DOUBLE PRECISION NOT NULL, bytes BIGINT NOT NULL,
    objects BIGINT NOT NULL);
CREATE INDEX IF NOT EXISTS units_by_use ON units (used);
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, unit TEXT NOT NULL, parent TEXT, conversation TEXT, upto BIGINT,
    created DOUBLE PRECISION NOT NULL, bytes BIGINT NOT NULL, body TEXT NOT NULL,
    owner TEXT NOT NULL DEFAULT '', runner TEXT);
CREATE INDEX IF NOT EXISTS responses_by_unit ON responses (unit);
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY, created BIGINT NOT NULL, bytes BIGINT NOT NULL,
    next BIGINT NOT NULL, metadata TEXT NOT NULL, owner TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS items (
    owner TEXT NOT NULL, seq BIGINT NOT NULL, id TEXT NOT NULL, part TEXT NOT NULL,
    item TEXT NOT NULL, n BIGSERIAL, PRIMARY KEY (owner, seq));
CREATE INDEX IF NOT EXISTS items_by_id ON items (id);
"""
PG_LOCK = 0x73706563  # the advisory lock every transaction takes first ("spec")
ADD_ITEMS = "INSERT INTO items (owner, seq, id, part, item) VALUES (?, ?, ?, ?, ?)"

DAY = 86400.0
MB = 1 << 20


@dataclass(frozen=True)
class Bounds:
    """How much the store keeps: units (a chain of responses, a conversation) used less
    than `max_age_s` ago, at most `max_count` responses and conversations, at most
    `max_bytes` of their JSON, each unit at most `max_object_bytes` (None: no bound; the
    unit bound defaults to the smaller of 64 MB and `max_bytes`)."""

    max_age_s: float | None = 30 * DAY
    max_count: int | None = 10_000
    max_bytes: int | None = 1 << 30
    max_object_bytes: int | None = None

    @property
    def unit_bytes(self) -> int | None:
        if self.max_object_bytes is not None:
            return self.max_object_bytes
        return min(64 * MB, self.max_bytes) if self.max_bytes is not None else 64 * MB


@dataclass(frozen=True)
class Page:
    """One page of a list (OpenAI's list object)."""

    data: list[Item]
    has_more: bool

    def wire(self) -> dict[str, Any]:
        return {"object": "list", "data": self.data,
                "first_id": self.data[0]["id"] if self.data else None,
                "last_id": self.data[-1]["id"] if self.data else None,
                "has_more": self.has_more}


def page(items: list[Item], after: str | None, limit: int, order: str) -> Page | None:
    """Items in `order` ("asc": as written; "desc": newest first), those after the item
    `after` (None: from the start), at most `limit`; None where `after` is not one of them."""
    seq = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        at = next((i for i, it in enumerate(seq) if it.get("id") == after), None)
        if at is None:
            return None
        start = at + 1
    return Page(seq[start:start + limit], start + limit < len(seq))


def first_duplicate(items: list[Item]) -> str | None:
    """The first item id `items` hold twice (None: none)."""
    seen: set[str] = set()
    for it in items:
        iid = it.get("id")
        if iid in seen:
            return iid
        if iid is not None:
            seen.add(iid)
    return None


def size_of(items: list[Item]) -> int:
    """Bytes `items` take stored."""
    return sum(len(json.dumps(it)) for it in items)


class Store:
    """The interface every backend implements (see the module's guarantees). Reads of a
    response or conversation count as a use of its unit; `None`/`False`: not stored (never
    stored, deleted, evicted or expired) or not `owner`'s: every object belongs to the API
    key that made it (its `owner`; "" where the server has one key or none), and another
    owner's is not there for it."""

    bounds: Bounds
    shared = False  # several servers may use it at once (a database, not a file)

    def check_room(self, unit_of: str | None, adding: int) -> None:
        """Raise `TooLarge` where adding `adding` bytes to the unit `unit_of` (a response
        or conversation id; None: a new unit) would take it past its bound."""
        raise NotImplementedError

    def put_turn(self, response: dict[str, Any], own: list[Item], *, stored: bool = True,
                 parent: str | None = None, conversation: str | None = None,
                 upto: int | None = None, owner: str = "", final: bool = True,
                 runner: str | None = None) -> None:
        """Keep a finished turn in one transaction: the response (where `stored`: its
        object, its own input items `own`, its `output`, continuing `parent` or the first
        `upto` items of `conversation`; replacing the response of that id where one is
        stored) and, where in a conversation and `final`, `own` and the output appended to
        it. `final` False: a background response not (or not successfully) finished: queued,
        in progress, cancelled or failed, which adds nothing to its conversation. Its unit's
        room is checked before the turn's work (`check_room`), not here: a turn that passed
        it is stored. `runner`: the server running a background response (`interrupted`)."""
        raise NotImplementedError

    def interrupted(self, why: str, runner: str | None = None) -> int:
        """Mark every response still queued or in progress (a background response whose
        server stopped) failed, its error `why`: those `runner` ran (None: every one);
        returns how many."""
        raise NotImplementedError

    def runner_of(self, rid: str) -> str | None:
        """The server running (or that ran) background response `rid`, where recorded."""
        raise NotImplementedError

    def response(self, rid: str, owner: str = "") -> dict[str, Any] | None:
        raise NotImplementedError

    def context(self, rid: str, owner: str = "") -> list[Item] | None:
        """What a request continuing response `rid` starts from: its input and output."""
        raise NotImplementedError

    def input_items(self, rid: str, owner: str = "") -> list[Item] | None:
        """A response's whole input (what it continued, then its own), in order."""
        raise NotImplementedError

    def delete_response(self, rid: str, owner: str = "") -> bool:
        raise NotImplementedError

    def item(self, item_id: str, owner: str = "") -> Item | None:
        """A stored item by its id (the latest written where several objects hold it)."""
        raise NotImplementedError

    def new_conversation(self, cid: str, metadata: dict[str, Any], items: list[Item],
                         owner: str = "") -> dict[str, Any]:
        raise NotImplementedError

    def conversation(self, cid: str, owner: str = "") -> dict[str, Any] | None:
        raise NotImplementedError

    def conversation_items(self, cid: str, owner: str = "") -> list[Item] | None:
        """A conversation's items in order."""
        raise NotImplementedError

    def conversation_seen(self, cid: str, owner: str = "") -> tuple[list[Item], int] | None:
        """A conversation's items and the position after them (`upto` for a turn)."""
        raise NotImplementedError

    def update_conversation(self, cid: str, metadata: dict[str, Any], owner: str = ""
                            ) -> dict[str, Any] | None:
        raise NotImplementedError

    def delete_conversation(self, cid: str, owner: str = "") -> bool:
        raise NotImplementedError

    def add_items(self, cid: str, items: list[Item], owner: str = "") -> bool:
        """Append items (False: no such conversation). Raises `TooLarge`, `Duplicate`."""
        raise NotImplementedError

    def delete_item(self, cid: str, item_id: str, owner: str = "") -> bool:
        raise NotImplementedError

    def stats(self) -> dict[str, int]:
        """How many responses and conversations are kept, and their bytes."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def _private(path: str) -> None:
    """The database file and its WAL and shared-memory files: owner only, whether new or
    there before (they hold every stored prompt)."""
    for p in (path, path + "-wal", path + "-shm"):
        try:
            os.chmod(p, 0o600)
        except FileNotFoundError:
            pass


class SqlStore(Store):
    """The store's rules in SQL, over a backend's connection (`_db`: `execute`,
    `executemany` with `?` parameters) and its transactions (`_begin`, `_after`)."""

    FAULT_ENV = "SPECDEC_STORE_FAULT"  # "pause-in-turn": a turn stops inside its transaction
    LATEST = "rowid"  # the items' column in the order they were written
    STATUS = "json_extract(body, '$.status')"  # a response's status, from its body
    path: str
    _db: Any
    _lock: threading.Lock
    _fault: str = ""

    def _begin(self) -> None:
        raise NotImplementedError

    def _commit(self) -> None:
        self._db.execute("COMMIT")

    def _rollback(self) -> None:
        self._db.execute("ROLLBACK")

    def _after(self) -> None:
        """After a committed transaction (SQLite gives freed pages back)."""

    @contextlib.contextmanager
    def _write(self) -> Iterator[None]:
        """The lock and one transaction (committed, or rolled back on any error)."""
        with self._lock:
            self._begin()
            try:
                yield
            except BaseException:
                self._rollback()
                raise
            try:
                self._commit()
            except sqlite3.Error:  # (a full disk, another process's lock)
                self._rollback()
                raise
            self._after()

    _freed = False  # a transaction dropped something: give the pages back after it

    # -- totals and units ---------------------------------------------------------------
    def _set_totals(self, objects: int, nbytes: int) -> None:
        self._db.executemany("INSERT INTO meta VALUES (?, ?) ON CONFLICT (key) DO UPDATE "
                             "SET value = excluded.value",
                             (("objects", objects), ("bytes", nbytes)))

    def _totals(self) -> tuple[int, int]:
        rows = dict(self._db.execute("SELECT key, value FROM meta WHERE key IN "
                                     "('objects', 'bytes')").fetchall())
        return rows.get("objects", 0), rows.get("bytes", 0)

    def _add_totals(self, objects: int, nbytes: int) -> None:
        self._db.execute("UPDATE meta SET value = value + ? WHERE key = 'objects'", (objects,))
        self._db.execute("UPDATE meta SET value = value + ? WHERE key = 'bytes'", (nbytes,))

    def _grow(self, unit: str, nbytes: int, objects: int) -> None:
        """Count `nbytes` and `objects` into `unit` (made where new) and the totals; the
        unit is used now."""
        self._db.execute("INSERT INTO units VALUES (?, ?, ?, ?) ON CONFLICT (id) DO UPDATE "
                         "SET used = excluded.used, bytes = units.bytes + excluded.bytes, "
                         "objects = units.objects + excluded.objects",
                         (unit, time.time(), nbytes, objects))
        self._add_totals(objects, nbytes)

    def _shrink(self, unit: str, nbytes: int, objects: int) -> None:
        self._db.execute("UPDATE units SET bytes = bytes - ?, objects = objects - ? "
                         "WHERE id = ?", (nbytes, objects, unit))
        self._db.execute("DELETE FROM units WHERE id = ? AND objects <= 0", (unit,))
        self._add_totals(-objects, -nbytes)
        self._freed = True

    def _unit_of(self, oid: str) -> str | None:
        row = self._db.execute("SELECT unit FROM responses WHERE id = ?", (oid,)).fetchone()
        if row is not None:
            return row[0]
        row = self._db.execute("SELECT id FROM conversations WHERE id = ?", (oid,)).fetchone()
        return row[0] if row is not None else None

    def _expired(self) -> float | None:
        return time.time() - self.bounds.max_age_s if self.bounds.max_age_s is not None \
            else None

    def _live(self, oid: str) -> str | None:
        """`oid`'s unit where it is stored and its unit not past its age (an expired unit
        is dropped here); None: not stored."""
        unit = self._unit_of(oid)
        if unit is None:
            return None
        cut = self._expired()
        if cut is not None:
            row = self._db.execute("SELECT used FROM units WHERE id = ?", (unit,)).fetchone()
            if row is not None and row[0] < cut:
                self._drop_unit(unit)
                return None
        return unit

    def _use(self, unit: str) -> None:
        self._db.execute("UPDATE units SET used = ? WHERE id = ?", (time.time(), unit))

    def _drop_unit(self, unit: str) -> None:
        """A whole unit: its responses, its conversation, their items."""
        db = self._db
        db.execute("DELETE FROM items WHERE owner IN (SELECT id FROM responses WHERE unit = ?)",
                   (unit,))
        db.execute("DELETE FROM items WHERE owner = ?", (unit,))
        db.execute("DELETE FROM responses WHERE unit = ?", (unit,))
        db.execute("DELETE FROM conversations WHERE id = ?", (unit,))
        row = db.execute("SELECT bytes, objects FROM units WHERE id = ?", (unit,)).fetchone()
        db.execute("DELETE FROM units WHERE id = ?", (unit,))
        if row is not None:
            self._add_totals(-row[1], -row[0])
        self._freed = True

    def _make_room(self, keep: str | None) -> None:
        """Drop whole units past the bounds, the least recently used first, never `keep`:
        those past their age, then while over the count or byte bound. Each step reads one
        row of an index: the work is what is dropped."""
        b, db = self.bounds, self._db
        cut = self._expired()
        while cut is not None:
            row = db.execute("SELECT id FROM units WHERE used < ? AND id <> ? "
                             "ORDER BY used LIMIT 1", (cut, keep or "")).fetchone()
            if row is None:
                break
            self._drop_unit(row[0])
        while True:
            objects, nbytes = self._totals()
            if not ((b.max_count is not None and objects > b.max_count)
                    or (b.max_bytes is not None and nbytes > b.max_bytes)):
                return
            row = db.execute("SELECT id FROM units WHERE id <> ? ORDER BY used LIMIT 1",
                             (keep or "",)).fetchone()
            if row is None:
                return  # only the unit being written is left
            self._drop_unit(row[0])

    def _room(self, unit: str | None, adding: int) -> None:
        bound = self.bounds.unit_bytes
        if bound is None:
            return
        have = 0
        if unit is not None:
            row = self._db.execute("SELECT bytes FROM units WHERE id = ?", (unit,)).fetchone()
            have = row[0] if row else 0
        if have + adding > bound:
            what = "conversation" if unit is not None and unit.startswith("conv_") else \
                "chain of responses"
            raise TooLarge(f"this would make its {what} {have + adding} bytes, over the store's "
                           f"bound of {bound} bytes per conversation or chain (specdec serve "
                           "--store-max-object-mb): start a new one", bound)

    def check_room(self, unit_of: str | None, adding: int) -> None:
        with self._lock:
            unit = self._unit_of(unit_of) if unit_of is not None else None
            self._room(unit, adding)

    # -- responses ----------------------------------------------------------------------
    def _pause(self) -> None:
        """The fault hook: a turn that stops inside its transaction (the tests kill the
        server there)."""
        if self._fault == "pause-in-turn" and isinstance(self, SqliteStore):
            Path(self.path + ".paused").touch()
            time.sleep(3600)

    def put_turn(self, response: dict[str, Any], own: list[Item], *, stored: bool = True,
                 parent: str | None = None, conversation: str | None = None,
                 upto: int | None = None, owner: str = "", final: bool = True,
                 runner: str | None = None) -> None:
        rid = response["id"]
        output = list(response.get("output") or [])
        body = json.dumps({k: v for k, v in response.items() if k != "output"})
        rows = [(rid, n, it["id"], "input", json.dumps(it)) for n, it in enumerate(own)]
        rows += [(rid, len(own) + n, it["id"], "output", json.dumps(it))
                 for n, it in enumerate(output)]
        size = len(body) + sum(len(r[4]) for r in rows)
        with self._write():
            db = self._db
            unit = None
            # What it continued, where still stored (deleted meanwhile: the response
            # starts a unit of its own; a conversation deleted meanwhile gets nothing).
            if conversation is not None and self._conversation(conversation, owner) is None:
                conversation = None
            unit = conversation or (self._live(parent) if parent is not None else None) or rid
            conv_rows: list[tuple[Any, ...]] = []
            if conversation is not None and final:
                nxt = db.execute("SELECT next FROM conversations WHERE id = ?",
                                 (conversation,)).fetchone()[0]
                conv_rows = [(conversation, nxt + n, it["id"], "item", json.dumps(it))
                             for n, it in enumerate(own + output)]
            # (its room was checked before any work, `check_room`: a turn that passed it is
            # stored, even where a turn beside it on the same unit took some of that room)
            if stored:
                old = db.execute("SELECT unit, bytes FROM responses WHERE id = ?",
                                 (rid,)).fetchone()
                if old is not None:  # (a background response's earlier state)
                    db.execute("DELETE FROM responses WHERE id = ?", (rid,))
                    self._shrink(old[0], old[1], 1)
                db.execute("DELETE FROM items WHERE owner = ?", (rid,))
                db.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                           (rid, unit, parent, conversation, upto, time.time(), size, body,
                            owner, runner))
                db.executemany(ADD_ITEMS, rows)
                self._grow(unit, size, 1)
            self._pause()
            if conv_rows:
                db.executemany(ADD_ITEMS, conv_rows)
                grown = sum(len(r[4]) for r in conv_rows)
                db.execute("UPDATE conversations SET next = next + ?, bytes = bytes + ? "
                           "WHERE id = ?", (len(conv_rows), grown, conversation))
                self._grow(unit, grown, 0)
            self._make_room(unit)

    def interrupted(self, why: str, runner: str | None = None) -> int:
        pending: tuple[str, ...] = ("queued", "in_progress")
        mine = "" if runner is None else " AND runner = ?"
        with self._write():
            rows = self._db.execute(
                f"SELECT id, unit, body FROM responses WHERE {self.STATUS} IN (?, ?){mine}",
                pending + (() if runner is None else (runner,))).fetchall()
            for rid, unit, body in rows:
                response = json.loads(body)
                response.update(status="failed", error={"code": "server_error",
                                                        "message": why})
                new = json.dumps(response)
                self._db.execute("UPDATE responses SET body = ?, bytes = bytes + ? WHERE id = ?",
                                 (new, len(new) - len(body), rid))
                self._grow(unit, len(new) - len(body), 0)
        return len(rows)

    def runner_of(self, rid: str) -> str | None:
        with self._write():
            row = self._db.execute("SELECT runner FROM responses WHERE id = ?",
                                   (rid,)).fetchone()
        return row[0] if row is not None else None

    def _used_response(self, rid: str, owner: str) -> str | None:
        """`owner`'s stored response `rid`'s body, its unit used now (None: not there)."""
        row = self._db.execute("SELECT body FROM responses WHERE id = ? AND owner = ?",
                               (rid, owner)).fetchone()
        unit = self._live(rid) if row is not None else None
        if unit is None:
            return None
        self._use(unit)
        return row[0]

    def response(self, rid: str, owner: str = "") -> dict[str, Any] | None:
        with self._write():
            body = self._used_response(rid, owner)
            if body is None:
                return None
            out = json.loads(body)
            out["output"] = self._items(rid, "output")
            return out

    def _chain(self, rid: str) -> list[tuple[str, str | None, int | None]]:
        """The responses `rid` continues and itself, oldest first: (id, conversation, upto);
        the walk stops at a response no longer stored."""
        return [tuple(r) for r in self._db.execute(  # type: ignore[misc]
            "WITH RECURSIVE chain(id, parent, conversation, upto, depth) AS ("
            " SELECT id, parent, conversation, upto, 0 FROM responses WHERE id = ?"
            " UNION ALL SELECT r.id, r.parent, r.conversation, r.upto, c.depth + 1"
            " FROM responses r JOIN chain c ON r.id = c.parent)"
            " SELECT id, conversation, upto FROM chain ORDER BY depth DESC", (rid,))]

    def _items(self, owner: str, part: str | None = None, below: int | None = None
               ) -> list[Item]:
        q, args = "SELECT item FROM items WHERE owner = ?", [owner]
        if part is not None:
            q += " AND part = ?"
            args.append(part)
        if below is not None:
            q += " AND seq < ?"
            args.append(below)
        return [json.loads(r[0]) for r in self._db.execute(q + " ORDER BY seq", args)]

    def _input(self, rid: str, owner: str, with_output: bool) -> list[Item] | None:
        if self._used_response(rid, owner) is None:
            return None
        out: list[Item] = []
        chain = self._chain(rid)
        for n, (oid, conv, upto) in enumerate(chain):
            if conv is not None and upto is not None:
                out += self._items(conv, below=upto)
            out += self._items(oid, "input")
            if n < len(chain) - 1 or with_output:
                out += self._items(oid, "output")
        return out

    def context(self, rid: str, owner: str = "") -> list[Item] | None:
        with self._write():
            return self._input(rid, owner, with_output=True)

    def input_items(self, rid: str, owner: str = "") -> list[Item] | None:
        with self._write():
            return self._input(rid, owner, with_output=False)

    def delete_response(self, rid: str, owner: str = "") -> bool:
        with self._write():
            row = self._db.execute("SELECT unit, bytes FROM responses WHERE id = ? AND "
                                   "owner = ?", (rid, owner)).fetchone()
            if row is None or self._live(rid) is None:
                return False
            self._db.execute("DELETE FROM responses WHERE id = ?", (rid,))
            self._db.execute("DELETE FROM items WHERE owner = ?", (rid,))
            self._shrink(row[0], row[1], 1)
            return True

    def item(self, item_id: str, owner: str = "") -> Item | None:
        with self._write():
            for held_by, item in self._db.execute(
                    f"SELECT owner, item FROM items WHERE id = ? ORDER BY {self.LATEST} DESC",
                    (item_id,)).fetchall():
                if self._owned(held_by, owner) and self._live(held_by) is not None:
                    return json.loads(item)
            return None

    def _owned(self, oid: str, owner: str) -> bool:
        """Whether the response or conversation `oid` is `owner`'s."""
        return self._db.execute(
            "SELECT 1 FROM responses WHERE id = ? AND owner = ? UNION ALL "
            "SELECT 1 FROM conversations WHERE id = ? AND owner = ?",
            (oid, owner, oid, owner)).fetchone() is not None

    # -- conversations ------------------------------------------------------------------
    def new_conversation(self, cid: str, metadata: dict[str, Any], items: list[Item],
                         owner: str = "") -> dict[str, Any]:
        meta = json.dumps(metadata)
        dup = first_duplicate(items)
        if dup is not None:
            raise Duplicate(dup, "items")
        rows = [(cid, n, it["id"], "item", json.dumps(it)) for n, it in enumerate(items)]
        size = len(meta) + sum(len(r[4]) for r in rows)
        with self._write():
            self._room(None, size)
            self._db.execute("INSERT INTO conversations VALUES (?, ?, ?, ?, ?, ?)",
                             (cid, int(time.time()), size, len(rows), meta, owner))
            self._db.executemany(ADD_ITEMS, rows)
            self._grow(cid, size, 1)
            self._make_room(cid)
        return {"id": cid, "object": "conversation", "created_at": int(time.time()),
                "metadata": metadata}

    def _conversation(self, cid: str, owner: str) -> dict[str, Any] | None:
        row = self._db.execute("SELECT created, metadata FROM conversations WHERE id = ? AND "
                               "owner = ?", (cid, owner)).fetchone()
        if row is None or self._live(cid) is None:
            return None
        self._use(cid)
        return {"id": cid, "object": "conversation", "created_at": row[0],
                "metadata": json.loads(row[1])}

    def conversation(self, cid: str, owner: str = "") -> dict[str, Any] | None:
        with self._write():
            return self._conversation(cid, owner)

    def conversation_items(self, cid: str, owner: str = "") -> list[Item] | None:
        with self._write():
            if self._conversation(cid, owner) is None:
                return None
            return self._items(cid)

    def conversation_seen(self, cid: str, owner: str = "") -> tuple[list[Item], int] | None:
        """A conversation's items and the position after them (what a turn saw)."""
        with self._write():
            if self._conversation(cid, owner) is None:
                return None
            nxt = self._db.execute("SELECT next FROM conversations WHERE id = ?",
                                   (cid,)).fetchone()[0]
            return self._items(cid), nxt

    def update_conversation(self, cid: str, metadata: dict[str, Any], owner: str = ""
                            ) -> dict[str, Any] | None:
        meta = json.dumps(metadata)
        with self._write():
            if self._conversation(cid, owner) is None:
                return None
            old = self._db.execute("SELECT length(metadata) FROM conversations WHERE id = ?",
                                   (cid,)).fetchone()[0]
            self._room(cid, len(meta) - old)
            self._db.execute("UPDATE conversations SET metadata = ?, bytes = bytes + ? "
                             "WHERE id = ?", (meta, len(meta) - old, cid))
            self._grow(cid, len(meta) - old, 0)
            return self._conversation(cid, owner)

    def delete_conversation(self, cid: str, owner: str = "") -> bool:
        with self._write():
            if self._conversation(cid, owner) is None:
                return False
            size = self._db.execute("SELECT bytes FROM conversations WHERE id = ?",
                                    (cid,)).fetchone()[0]
            self._db.execute("DELETE FROM conversations WHERE id = ?", (cid,))
            self._db.execute("DELETE FROM items WHERE owner = ?", (cid,))
            self._shrink(cid, size, 1)
            return True

    def add_items(self, cid: str, items: list[Item], owner: str = "") -> bool:
        with self._write():
            if self._conversation(cid, owner) is None:
                return False
            have = {r[0] for r in self._db.execute("SELECT id FROM items WHERE owner = ?",
                                                   (cid,))}
            dup = first_duplicate(items) or next(
                (it["id"] for it in items if it.get("id") in have), None)
            if dup is not None:
                raise Duplicate(dup, "items")
            nxt = self._db.execute("SELECT next FROM conversations WHERE id = ?",
                                   (cid,)).fetchone()[0]
            rows = [(cid, nxt + n, it["id"], "item", json.dumps(it))
                    for n, it in enumerate(items)]
            grown = sum(len(r[4]) for r in rows)
            self._room(cid, grown)
            self._db.executemany(ADD_ITEMS, rows)
            self._db.execute("UPDATE conversations SET next = next + ?, bytes = bytes + ? "
                             "WHERE id = ?", (len(rows), grown, cid))
            self._grow(cid, grown, 0)
            self._make_room(cid)
        return True

    def delete_item(self, cid: str, item_id: str, owner: str = "") -> bool:
        with self._write():
            if self._conversation(cid, owner) is None:
                return False
            row = self._db.execute("SELECT seq, length(item) FROM items WHERE owner = ? AND "
                                   "id = ?", (cid, item_id)).fetchone()
            if row is None:
                return False
            self._db.execute("DELETE FROM items WHERE owner = ? AND seq = ?", (cid, row[0]))
            self._db.execute("UPDATE conversations SET bytes = bytes - ? WHERE id = ?",
                             (row[1], cid))
            self._shrink(cid, row[1], 0)
            return True

    def stats(self) -> dict[str, int]:
        with self._lock:
            r = self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]
            c = self._db.execute("SELECT COUNT(*) FROM conversations").fetchone()[0]
            _, nbytes = self._totals()
        return {"responses": r, "conversations": c, "bytes": nbytes}


class SqliteStore(SqlStore):
    """The SQLite backend; `path` a file, or ":memory:". A file written by an earlier
    release is migrated on open (`SCHEMA_VERSION`); one written by a later release is
    refused."""

    def __init__(self, path: str | Path = ":memory:", bounds: Bounds = Bounds()) -> None:
        self.path, self.bounds = str(path), bounds
        self._fault = os.environ.get(self.FAULT_ENV, "")
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            old = os.umask(0o077)
            try:
                Path(self.path).touch(mode=0o600)
            finally:
                os.umask(old)
            _private(self.path)
        self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=5,
                                   isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            # (before anything writes the file's first page: a new file gives the space
            # deletes free back to the file system; on an existing one, a no-op)
            self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")
            if self.path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
                _private(self.path)
            self._db.execute("PRAGMA synchronous=NORMAL" if self.path != ":memory:"
                             else "PRAGMA synchronous=OFF")
            self._open()

    # -- opening and migrating ----------------------------------------------------------
    def _open(self) -> None:
        db = self._db
        version = db.execute("PRAGMA user_version").fetchone()[0]
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if version > SCHEMA_VERSION:
            raise Unavailable(f"the store {self.path} was written by a later release (schema "
                              f"{version}; this one reads up to {SCHEMA_VERSION})")
        if version == SCHEMA_VERSION:
            return
        if version in (2, 3):
            self._begin()
            if version == 2:  # owners: what was stored belongs to no key (one key or none)
                db.execute("ALTER TABLE responses ADD COLUMN owner TEXT NOT NULL DEFAULT ''")
                db.execute("ALTER TABLE conversations ADD COLUMN owner TEXT NOT NULL "
                           "DEFAULT ''")
            db.execute("ALTER TABLE responses ADD COLUMN runner TEXT")  # (background: 4)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            db.execute("COMMIT")
            return
        if not tables:
            db.executescript(SCHEMA)
            self._begin()
            self._set_totals(0, 0)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            db.execute("COMMIT")
            return
        self._migrate_v1()

    def _migrate_v1(self) -> None:
        """The first release's layout: a response's items held its whole context; no units.
        Each response becomes a unit of its own (its items as they were), each conversation
        one; then the file is compacted with incremental vacuum on."""
        db = self._db
        self._begin()
        try:
            db.execute("ALTER TABLE responses RENAME TO responses_v1")
            db.execute("ALTER TABLE conversations RENAME TO conversations_v1")
            for stmt in SCHEMA.split(";"):  # (the items table is the same)
                if stmt.strip():
                    db.execute(stmt)
            for rid, written, body, size in db.execute(
                    "SELECT id, written, body, bytes FROM responses_v1").fetchall():
                obj = json.loads(body)
                obj.pop("output", None)
                db.execute("INSERT INTO responses (id, unit, created, bytes, body) "
                           "VALUES (?, ?, ?, ?, ?)", (rid, rid, written, size, json.dumps(obj)))
                db.execute("INSERT INTO units VALUES (?, ?, ?, 1)", (rid, written, size))
            for cid, created, written, meta, size in db.execute(
                    "SELECT id, created, written, metadata, bytes FROM conversations_v1"
                    ).fetchall():
                nxt = db.execute("SELECT COALESCE(MAX(seq), -1) + 1 FROM items WHERE owner = ?",
                                 (cid,)).fetchone()[0]
                db.execute("INSERT INTO conversations (id, created, bytes, next, metadata) "
                           "VALUES (?, ?, ?, ?, ?)", (cid, created, size, nxt, meta))
                db.execute("INSERT INTO units VALUES (?, ?, ?, 1)", (cid, written, size))
            db.execute("DROP TABLE responses_v1")
            db.execute("DROP TABLE conversations_v1")
            n, b = db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM units").fetchone()
            self._set_totals(n, b)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        db.execute("VACUUM")  # (auto_vacuum takes effect on an existing file by a vacuum)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _begin(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def _after(self) -> None:
        if self._freed:
            self._freed = False
            self._db.executescript("PRAGMA incremental_vacuum")  # (run to its end)


class _Pg:
    """A psycopg connection as the store's SQL uses one: `?` parameters."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def execute(self, sql: str, args: Any = ()) -> Any:
        return self.conn.execute(sql.replace("?", "%s"), args)

    def executemany(self, sql: str, rows: Any) -> None:
        with self.conn.cursor() as cur:
            cur.executemany(sql.replace("?", "%s"), list(rows))


class PostgresStore(SqlStore):
    """The PostgreSQL backend (psycopg 3): `url` a `postgresql://` connection URL. Replicas
    given one database share it: every transaction takes one advisory lock first
    (`PG_LOCK`), so their writes run one at a time, as one server's do; the tables are made
    on first open, under that lock. A database that cannot be reached, or was written by a
    later release, is an error at open (`StoreUnavailable`); a connection lost later fails
    that call (503) and the next call connects again."""

    LATEST = "n"
    STATUS = "(body::jsonb ->> 'status')"
    shared = True
    CONNECT_TIMEOUT_S = 10

    def __init__(self, url: str, bounds: Bounds = Bounds()) -> None:
        self.path, self.bounds = url, bounds
        self._lock = threading.Lock()
        self._db = _Pg(self._connect())
        with self._write():
            version = self._schema_version()
            if version > SCHEMA_VERSION:
                raise Unavailable(f"the store at {_safe(url)} was written by a later release "
                                  f"(schema {version}; this one reads up to {SCHEMA_VERSION})")
            if version == 0:
                for stmt in PG_SCHEMA.split(";"):
                    if stmt.strip():
                        self._db.execute(stmt)
                self._set_totals(0, 0)
                self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))

    def _connect(self) -> Any:
        import psycopg

        try:
            return psycopg.connect(self.path, autocommit=True,
                                   connect_timeout=self.CONNECT_TIMEOUT_S)
        except psycopg.Error as e:
            raise Unavailable(f"cannot reach the store's database {_safe(self.path)}: "
                              f"{str(e).strip()}") from None

    def _schema_version(self) -> int:
        has = self._db.execute("SELECT to_regclass('meta') IS NOT NULL").fetchone()[0]
        if not has:
            return 0
        row = self._db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        return int(row[0]) if row is not None else 0

    def _begin(self) -> None:
        import psycopg

        if self._db.conn.closed or self._db.conn.broken:
            self._db = _Pg(self._connect())
        try:
            self._db.execute("BEGIN")
            self._db.execute("SELECT pg_advisory_xact_lock(?)", (PG_LOCK,))
        except psycopg.Error as e:
            self._lost(e)

    def _commit(self) -> None:
        import psycopg

        try:
            self._db.execute("COMMIT")
        except psycopg.Error as e:
            self._lost(e)

    def _rollback(self) -> None:
        import psycopg

        try:
            self._db.execute("ROLLBACK")
        except psycopg.Error:
            pass  # (a lost connection rolled it back)

    def _lost(self, e: Exception) -> None:
        raise Unavailable(f"the store's database failed: {str(e).strip()}") from None

    @contextlib.contextmanager
    def _write(self) -> Iterator[None]:
        import psycopg

        try:
            with super()._write():
                yield
        except psycopg.Error as e:  # (inside the transaction: rolled back)
            self._lost(e)

    def stats(self) -> dict[str, int]:
        with self._write():
            r = self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]
            c = self._db.execute("SELECT COUNT(*) FROM conversations").fetchone()[0]
            _, nbytes = self._totals()
        return {"responses": r, "conversations": c, "bytes": nbytes}

    def close(self) -> None:
        with self._lock:
            self._db.conn.close()


def _safe(url: str) -> str:
    """A database URL without its password (for messages and logs)."""
    return re.sub(r"(//[^:/@]+):[^@/]*@", r"\1:***@", url)


SCHEMES = ("postgresql", "postgres")  # what `--store URL` takes


def open_store(spec: str, bounds: Bounds = Bounds()) -> Store | None:
    """The store `specdec serve --store SPEC` names: "none" (None), "memory", a
    `postgresql://` URL, or an SQLite file's path.

    Raises:
        StoreUnavailable: another URL scheme (never taken as a path), a database that
            cannot be reached, or a store written by a later release.
    """
    if spec == "none":
        return None
    if spec == "memory":
        return SqliteStore(":memory:", bounds)
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", spec)
    if scheme is not None:
        if scheme.group(1).lower() not in SCHEMES:
            raise Unavailable(f"--store {scheme.group(0)}...: not supported (a path, memory, "
                              "none, or a postgresql:// URL)")
        return PostgresStore(spec, bounds)
    return SqliteStore(spec, bounds)
