"""What the Responses API keeps between requests: stored responses (their input items and
output), and conversations (their items), in an embedded SQLite database (Python's own
`sqlite3`): a file that survives restarts (`specdec serve --store PATH`, by default
`responses.sqlite3` in the cache directory, `$SPECDEC_CACHE`), or memory (`--store memory`).

Bounded by age, count and bytes (`--store-max-age`, `--store-max-count`, `--store-max-mb`):
past a bound, the least recently written responses and conversations go first.

An item is stored in its wire form (a dict, as `GET .../input_items` returns it) with its
id. A response's items are its *input* (the whole context it answered: a previous
response's input and output, a conversation's items, then its own input) and its *output*;
a conversation's are its items in order. Thread-safe (one connection, one lock).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Item = dict[str, Any]

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, written REAL NOT NULL, body TEXT NOT NULL, bytes INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY, created INTEGER NOT NULL, written REAL NOT NULL,
    metadata TEXT NOT NULL, bytes INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS items (
    owner TEXT NOT NULL, seq INTEGER NOT NULL, id TEXT NOT NULL, part TEXT NOT NULL,
    item TEXT NOT NULL, PRIMARY KEY (owner, seq));
CREATE INDEX IF NOT EXISTS items_by_id ON items (id);
"""

DAY = 86400.0


@dataclass(frozen=True)
class Bounds:
    """How much the store keeps: responses and conversations written less than `max_age_s`
    ago, at most `max_count` of them, at most `max_bytes` of their JSON (None: no bound)."""

    max_age_s: float | None = 30 * DAY
    max_count: int | None = 10_000
    max_bytes: int | None = 1 << 30


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


class Store:
    """The database; `path` a file, or ":memory:"."""

    def __init__(self, path: str | Path = ":memory:", bounds: Bounds = Bounds()) -> None:
        self.path, self.bounds = str(path), bounds
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            Path(self.path).touch(mode=0o600)  # (it holds every stored prompt: owner only)
        self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=30,
                                   isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            if self.path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- responses ----------------------------------------------------------------------
    def put_response(self, response: dict[str, Any], context: list[Item]) -> None:
        """Keep a finished response (its object, whose `output` are its output items) and
        the context it answered (its input items, with ids)."""
        body = json.dumps(response)
        rows = [(response["id"], n, it["id"], "input", json.dumps(it))
                for n, it in enumerate(context)]
        rows += [(response["id"], len(context) + n, it["id"], "output", json.dumps(it))
                 for n, it in enumerate(response.get("output") or [])]
        size = len(body) + sum(len(r[4]) for r in rows)
        if self.bounds.max_bytes is not None and size > self.bounds.max_bytes:
            raise sqlite3.DataError(f"response {response['id']} takes {size} bytes, over the "
                                    f"store's bound ({self.bounds.max_bytes})")
        with self._lock, self._transaction():
            self._drop("responses", response["id"])
            self._db.execute("INSERT INTO responses VALUES (?, ?, ?, ?)",
                             (response["id"], time.time(), body, size))
            self._db.executemany("INSERT INTO items VALUES (?, ?, ?, ?, ?)", rows)
            self._evict()

    def response(self, rid: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT body FROM responses WHERE id = ?",
                                   (rid,)).fetchone()
        return json.loads(row[0]) if row else None

    def items_of(self, owner: str, part: str | None = None) -> list[Item]:
        """A response's items (`part` "input" or "output"; None: both, input first) or a
        conversation's, in order."""
        q = "SELECT item FROM items WHERE owner = ?" + (" AND part = ?" if part else "")
        with self._lock:
            rows = self._db.execute(q + " ORDER BY seq", (owner, part) if part else (owner,))
            return [json.loads(r[0]) for r in rows.fetchall()]

    def delete_response(self, rid: str) -> bool:
        with self._lock, self._transaction():
            return self._drop("responses", rid)

    def item(self, item_id: str) -> Item | None:
        """A stored item by its id (the latest written where several owners hold it)."""
        with self._lock:
            row = self._db.execute("SELECT item FROM items WHERE id = ? ORDER BY rowid DESC "
                                   "LIMIT 1", (item_id,)).fetchone()
        return json.loads(row[0]) if row else None

    # -- conversations ------------------------------------------------------------------
    def new_conversation(self, cid: str, metadata: dict[str, Any], items: list[Item]
                         ) -> dict[str, Any]:
        meta = json.dumps(metadata)
        with self._lock, self._transaction():
            self._db.execute("INSERT INTO conversations VALUES (?, ?, ?, ?, ?)",
                             (cid, int(time.time()), time.time(), meta, len(meta)))
            self._append(cid, items)
            self._evict()
        return self.conversation(cid) or {}

    def conversation(self, cid: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT created, metadata FROM conversations WHERE id = ?",
                                   (cid,)).fetchone()
        if row is None:
            return None
        return {"id": cid, "object": "conversation", "created_at": row[0],
                "metadata": json.loads(row[1])}

    def update_conversation(self, cid: str, metadata: dict[str, Any]) -> dict[str, Any] | None:
        meta = json.dumps(metadata)
        with self._lock, self._transaction():
            cur = self._db.execute("UPDATE conversations SET metadata = ?, written = ?, "
                                   "bytes = bytes - length(metadata) + ? WHERE id = ?",
                                   (meta, time.time(), len(meta), cid))
            if not cur.rowcount:
                return None
        return self.conversation(cid)

    def delete_conversation(self, cid: str) -> bool:
        with self._lock, self._transaction():
            return self._drop("conversations", cid)

    def add_items(self, cid: str, items: list[Item]) -> bool:
        """Append items to a conversation (False: no such conversation)."""
        with self._lock, self._transaction():
            if not self._db.execute("SELECT 1 FROM conversations WHERE id = ?",
                                    (cid,)).fetchone():
                return False
            self._append(cid, items)
            self._evict()
        return True

    def delete_item(self, cid: str, item_id: str) -> bool:
        with self._lock, self._transaction():
            row = self._db.execute("SELECT seq, length(item) FROM items WHERE owner = ? AND "
                                   "id = ?", (cid, item_id)).fetchone()
            if row is None:
                return False
            self._db.execute("DELETE FROM items WHERE owner = ? AND seq = ?", (cid, row[0]))
            self._db.execute("UPDATE conversations SET bytes = bytes - ?, written = ? "
                             "WHERE id = ?", (row[1], time.time(), cid))
        return True

    # -- inside the lock ----------------------------------------------------------------
    def _transaction(self) -> Any:
        db = self._db

        class _T:
            def __enter__(self) -> None:
                db.execute("BEGIN IMMEDIATE")

            def __exit__(self, kind: Any, *_: Any) -> None:
                if kind is None:
                    try:
                        db.execute("COMMIT")
                        return
                    except sqlite3.Error:  # (a full disk, another process's lock)
                        db.execute("ROLLBACK")
                        raise
                db.execute("ROLLBACK")

        return _T()

    def _append(self, cid: str, items: list[Item]) -> None:
        last = self._db.execute("SELECT COALESCE(MAX(seq), -1) FROM items WHERE owner = ?",
                                (cid,)).fetchone()[0]
        rows = [(cid, last + 1 + n, it["id"], "item", json.dumps(it))
                for n, it in enumerate(items)]
        self._db.executemany("INSERT INTO items VALUES (?, ?, ?, ?, ?)", rows)
        self._db.execute("UPDATE conversations SET bytes = bytes + ?, written = ? WHERE id = ?",
                         (sum(len(r[4]) for r in rows), time.time(), cid))

    def _drop(self, table: str, oid: str) -> bool:
        cur = self._db.execute(f"DELETE FROM {table} WHERE id = ?", (oid,))
        self._db.execute("DELETE FROM items WHERE owner = ?", (oid,))
        return cur.rowcount > 0

    def _evict(self) -> None:
        """Drop what is past the bounds, least recently written first."""
        b = self.bounds
        rows = self._db.execute(
            "SELECT 'responses', id, written, bytes FROM responses UNION ALL "
            "SELECT 'conversations', id, written, bytes FROM conversations "
            "ORDER BY 3").fetchall()
        now, total = time.time(), sum(r[3] for r in rows)
        for n, (table, oid, written, size) in enumerate(rows):
            left = len(rows) - n
            if ((b.max_age_s is not None and now - written > b.max_age_s)
                    or (b.max_count is not None and left > b.max_count)
                    or (b.max_bytes is not None and total > b.max_bytes and left > 1)):
                self._drop(table, oid)
                total -= size
            else:
                break

    def stats(self) -> dict[str, int]:
        """How many responses and conversations are kept, and their bytes."""
        with self._lock:
            r = self._db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM responses"
                                 ).fetchone()
            c = self._db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM "
                                 "conversations").fetchone()
        return {"responses": r[0], "conversations": c[0], "bytes": r[1] + c[1]}
