"""`uniqueItems` as the contract states it, computed here from the schema as written: the
oracle's own reading, sharing no code with specdec's rule (specdec/unique.py).

The contract: a token the grammar allows is refused where (a) the answer with it holds an
array under `uniqueItems: true` with two equal items (JSON values: `1` equals `1.0`), or
(b) the item that array has under way can no longer be completed into a value unlike
every earlier item of it. (b) is decided by a breadth-first search over the grammar's
masks from the state after the token, in token-id order, stopping at the first
continuation that completes the item unlike the others or that no earlier item starts
with; it gives up (refuses) after `SEARCH_NODES` states, as specdec's does.

Each judgement re-reads the whole answer (`read`: a forgiving recursive-descent reader of
a JSON prefix) and locates each array's schema by walking the schema along the path.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

import llguidance.numpy as llnp
import numpy as np
from llguidance import LLMatcher

SEARCH_NODES = 256


class _Node:
    """A value read from a JSON prefix: `kind` (object/array/string/number/literal),
    `done` (complete), its parts, and for a scalar its raw text."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.done = False
        self.members: list[tuple[str, _Node]] = []
        self.items: list[_Node] = []
        self.raw = ""


def read(text: str) -> _Node | None:
    """The JSON value `text` begins (complete or not), None before it begins."""
    i = _ws(text, 0)
    if i >= len(text):
        return None
    node, _ = _value(text, i)
    return node


def _ws(t: str, i: int) -> int:
    while i < len(t) and t[i] in " \t\r\n":
        i += 1
    return i


def _value(t: str, i: int) -> tuple[_Node, int]:
    c = t[i]
    if c == "{":
        return _object(t, i + 1)
    if c == "[":
        return _array(t, i + 1)
    if c == '"':
        n = _Node("string")
        j = i + 1
        while j < len(t):
            if t[j] == "\\":
                j += 2
                continue
            if t[j] == '"':
                n.raw, n.done = t[i:j + 1], True
                return n, j + 1
            j += 1
        n.raw = t[i:]
        return n, len(t)
    j = i
    if c in "tfn":
        n = _Node("literal")
        word = {"t": "true", "f": "false", "n": "null"}[c]
        n.raw = t[i:i + len(word)]
        n.done = n.raw == word
        return n, i + len(n.raw)
    n = _Node("number")
    while j < len(t) and t[j] in "0123456789+-.eE":
        j += 1
    n.raw = t[i:j]
    n.done = j < len(t)  # a number ends where something else follows it
    return n, j


def _object(t: str, i: int) -> tuple[_Node, int]:
    n = _Node("object")
    while True:
        i = _ws(t, i)
        if i >= len(t):
            return n, i
        if t[i] == "}":
            n.done = True
            return n, i + 1
        if t[i] == ",":
            i = _ws(t, i + 1)
            if i >= len(t):
                return n, i
        key, i = _value(t, i)
        if not key.done:
            return n, i
        i = _ws(t, i)
        if i >= len(t) or t[i] != ":":
            return n, i
        i = _ws(t, i + 1)
        if i >= len(t):
            return n, i
        val, i = _value(t, i)
        n.members.append((_string(key.raw) or "", val))
        if not val.done:
            return n, i


def _array(t: str, i: int) -> tuple[_Node, int]:
    n = _Node("array")
    while True:
        i = _ws(t, i)
        if i >= len(t):
            return n, i
        if t[i] == "]":
            n.done = True
            return n, i + 1
        if t[i] == ",":
            i = _ws(t, i + 1)
            n.items.append(_Node("pending"))  # an item is due
            if i >= len(t):
                return n, i
            n.items.pop()
        item, i = _value(t, i)
        n.items.append(item)
        if not item.done:
            return n, i


def _string(raw: str) -> str | None:
    """A complete string literal's value."""
    import json
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _partial_string(raw: str) -> tuple[str, bool]:
    """An unfinished string literal's value so far, and whether it ends inside an escape
    (a `\\u` escape of a high surrogate waits for its pair)."""
    body, i = raw[1:], 0
    while i < len(body):
        if body[i] != "\\":
            i += 1
            continue
        need = 6 if body[i + 1:i + 2] == "u" else 2
        if need == 6 and i + 6 <= len(body) and 0xD800 <= int(body[i + 2:i + 6], 16) < 0xDC00:
            need = 12
        if i + need > len(body):
            break
        i += need
    value = _string('"' + body[:i] + '"')
    return (value if value is not None else body[:i]), i < len(body)


def _same(kind: str, raw: str) -> tuple[str, Any]:
    """A complete scalar's value, for equality as JSON compares values."""
    if kind == "string":
        return ("s", _utf8(_string(raw) or ""))
    if kind == "number":
        try:
            return ("n", Decimal(raw))
        except InvalidOperation:
            return ("n?", raw)
    return ("l", raw)


def _utf8(s: str) -> bytes:
    try:
        return s.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return s.encode("utf-8", "surrogatepass")


class UniqueOracle:
    """The rule for one request: the schema as written and the answer so far."""

    def __init__(self, schema: dict[str, Any], token_bytes: Callable[[int], bytes],
                 vocab_size: int, eos: set[int]) -> None:
        self.schema = schema
        self.token_bytes = token_bytes
        self.vocab_size = vocab_size
        self.eos = eos
        self.text = b""

    def took(self, token: int) -> None:
        if token not in self.eos:
            self.text += self.token_bytes(token)

    # -- the schema along a path

    def _resolve(self, s: Any) -> list[Any]:
        """`s` and what its `$ref`/`allOf`/`anyOf`/`oneOf` add (every branch)."""
        out, todo, seen = [], [s], set()
        while todo:
            x = todo.pop()
            if not isinstance(x, dict) or id(x) in seen:
                continue
            seen.add(id(x))
            out.append(x)
            ref = x.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/"):
                node: Any = self.schema
                for part in ref[2:].split("/"):
                    node = node.get(part.replace("~1", "/").replace("~0", "~")) \
                        if isinstance(node, dict) else None
                todo.append(node)
            for key in ("allOf", "anyOf", "oneOf"):
                if isinstance(x.get(key), list):
                    todo.extend(x[key])
        return out

    @staticmethod
    def _kind_ok(s: dict[str, Any], kind: str) -> bool:
        t = s.get("type")
        if t is None:
            return True
        names = set(t if isinstance(t, list) else [t])
        if "integer" in names:
            names.add("number")
        return kind in names

    def _schemas(self, path: list[Any], kinds: list[str]) -> list[dict[str, Any]]:
        """The schemas that apply at `path` (keys and indexes) whose types allow the kinds
        of the values along it."""
        here = [s for s in self._resolve(self.schema) if self._kind_ok(s, kinds[0])]
        for step, kind in zip(path, kinds[1:]):
            nxt: list[Any] = []
            for s in here:
                if isinstance(step, int):
                    pre = s.get("prefixItems") or []
                    if step < len(pre):
                        nxt.append(pre[step])
                    elif isinstance(s.get("items"), dict):
                        nxt.append(s["items"])
                else:
                    hit = False
                    if isinstance(s.get("properties"), dict) and step in s["properties"]:
                        nxt.append(s["properties"][step])
                        hit = True
                    for pat, sub in (s.get("patternProperties") or {}).items():
                        if re.search(pat, step):
                            nxt.append(sub)
                            hit = True
                    if not hit and isinstance(s.get("additionalProperties"), dict):
                        nxt.append(s["additionalProperties"])
            here = [x for n in nxt for x in self._resolve(n) if self._kind_ok(x, kind)]
        return here

    def _unique_arrays(self, root: _Node) -> list[_Node]:
        out: list[_Node] = []

        def walk(n: _Node, path: list[Any], kinds: list[str]) -> None:
            if n.kind == "array":
                if any(s.get("uniqueItems") is True for s in self._schemas(path, kinds)):
                    out.append(n)
                for i, it in enumerate(n.items):
                    walk(it, path + [i], kinds + [it.kind])
            elif n.kind == "object":
                for k, v in n.members:
                    walk(v, path + [k], kinds + [v.kind])
        walk(root, [], [root.kind])
        return out

    # -- the judgement

    def _state(self, text: bytes) -> tuple[bool, bool, int]:
        """For an answer: (no two equal items in any array under `uniqueItems`, whether
        the item under way could still repeat an earlier one, how many complete items the
        innermost open such array holds)."""
        root = read(text.decode("utf-8", "surrogateescape"))
        if root is None:
            return True, False, 0
        risk, count = False, 0
        for arr in self._unique_arrays(root):  # outer arrays first
            done = [_same(it.kind, it.raw) for it in arr.items if it.done]
            if len(set(done)) < len(done):
                return False, False, 0
            if arr.done or not done:
                continue
            last = arr.items[-1]
            count = len(done)
            if last.kind == "pending":
                risk = True
            elif last.done:
                risk = False
            elif last.kind == "string":
                value, pending = _partial_string(last.raw)
                risk = pending or any(d[0] == "s" and d[1].startswith(_utf8(value))
                                      for d in done)
            else:
                mine = "n" if last.kind == "number" else "l"
                risk = any(d[0] == mine for d in done)
        return True, risk, count

    def refuses(self, matcher: LLMatcher, token: int) -> bool:
        """Whether the rule refuses `token` (which the grammar allows) after the answer so
        far, `matcher` being the grammar's state there."""
        if token in self.eos:
            return False
        text = self.text + self.token_bytes(token)
        ok, risk, _ = self._state(text)
        if not ok:
            return True
        if not risk:
            return False
        m = matcher.deep_copy()
        m.consume_token(token)
        return not self._viable(m, text)

    def _viable(self, m: LLMatcher, text: bytes) -> bool:
        _, _, have = self._state(text)
        queue = deque([(m, text)])
        spent = 0
        row = llnp.allocate_token_bitmask(1, self.vocab_size)
        while queue:
            m, text = queue.popleft()
            spent += 1
            if spent > SEARCH_NODES:
                return False
            llnp.fill_next_token_bitmask(m, row, 0)
            bits = np.unpackbits(row[0].view(np.uint8), bitorder="little")[:self.vocab_size]
            for t in np.flatnonzero(bits).tolist():
                if t in self.eos:
                    continue
                nxt = text + self.token_bytes(t)
                ok, risk, count = self._state(nxt)
                if not ok:
                    continue
                if not risk or count > have:
                    return True
                n = m.deep_copy()
                if n.consume_token(t) and not n.is_error():
                    queue.append((n, nxt))
        return False
