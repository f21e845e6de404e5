"""`uniqueItems`: a rule beside the grammar that knows the items written so far.

No context-free grammar holds "every item differs from every other". Here the schema goes
to the compiler with each `uniqueItems: true` it can follow replaced by a mark (`MARK`, an
annotation llguidance ignores), and each request's grammar state is wrapped in a
`UniqueCursor`, which reads the answer as it is written (`Scan`: an incremental JSON
reader that locates each array's schema) and restricts the grammar's masks:

- a token that would complete an item equal to an earlier item of its array (compared as
  JSON values: `1` and `1.0` are equal, `"a"` and `"\\u0061"` too) is refused;
- a token after which the item under way can only be completed into such a duplicate (a
  string at its `maxLength` that spells an earlier item, the last value of an `enum`
  already used) is refused too, so the rule never leaves the answer at a dead end where a
  valid completion existed. That is decided by a search over the grammar's own masks from
  the state after the token (`UniqueRule.viable`), which stops at the first continuation
  that can no longer be a duplicate; a search that runs past `SEARCH_NODES` states refuses
  the token (fail closed).

Only the tokens that could matter are tried (`UniqueRule.candidates`: inside a string item,
those holding a quote or an escape, or starting with the next byte of an earlier item it
could still become; elsewhere those that open an array or start an item); every other
allowed token stays allowed unread.

What is followed: arrays reached from the root through `properties`,
`patternProperties`, `additionalProperties`, `items`, `prefixItems`, `$ref`, `allOf`, and
`anyOf`/`oneOf` branches whose JSON types no other branch shares (`Optional[set[str]]`),
whose items are scalars (strings, numbers, booleans, null, their enums and consts). A
`uniqueItems` elsewhere (items that are objects or arrays, a branch that overlaps
another's type, under `not` or `contains`) is left as written: strict mode refuses it
naming the keyword, lenient mode warns. A finite item domain (an enum, a const, booleans,
null, an integer range) smaller than `minItems` is refused outright: no answer exists.

The oracle (oracle/unique.py) enforces the same rule with its own code.
"""

from __future__ import annotations

import codecs
import json
import re
from decimal import Decimal, InvalidOperation
from typing import Any

import numpy as np

from .errors import GrammarError
from .reasoning import Thinking, reasoning_bounds
from .types import GrammarState, TokenId

MARK = "x-specdec-uniqueItems"
# States a viability search may visit before it refuses the token it was asked about.
SEARCH_NODES = 256
_KINDS = ("object", "array", "string", "number", "boolean", "null")
_SCALARS = frozenset({"string", "number", "boolean", "null"})
_ALL = frozenset(_KINDS)


# ---------------------------------------------------------------------------------------
# The schema side: where the rule applies


def _kinds_of_type(t: Any) -> frozenset[str]:
    names = t if isinstance(t, list) else [t]
    out = set()
    for n in names:
        if n == "integer":
            n = "number"
        if n in _KINDS:
            out.add(n)
    return frozenset(out)


def _kind_of_value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


class _Schema:
    """The root schema with its `$ref` resolution and per-node facts, memoized by node."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self._kinds: dict[int, frozenset[str]] = {}
        self._marked: dict[int, bool] = {}

    def resolve(self, ref: str) -> Any:
        if not ref.startswith("#"):
            return None
        node = self.root
        for part in ref[1:].split("/")[1:] if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def kinds(self, s: Any, seen: frozenset[int] = frozenset()) -> frozenset[str]:
        """The JSON kinds a value matching `s` can have (a superset)."""
        if s is False:
            return frozenset()
        if not isinstance(s, dict) or id(s) in seen:
            return _ALL
        got = self._kinds.get(id(s))
        if got is not None:
            return got
        seen = seen | {id(s)}
        out = _ALL
        if "type" in s:
            out &= _kinds_of_type(s["type"])
        if "const" in s:
            out &= {_kind_of_value(s["const"])}
        if isinstance(s.get("enum"), list):
            out &= {_kind_of_value(v) for v in s["enum"]}
        if isinstance(s.get("$ref"), str):
            target = self.resolve(s["$ref"])
            if target is not None:
                out &= self.kinds(target, seen)
        for b in s.get("allOf", []) if isinstance(s.get("allOf"), list) else []:
            out &= self.kinds(b, seen)
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list):
                union: set[str] = set()
                for b in s[key]:
                    union |= self.kinds(b, seen)
                out &= union
        self._kinds[id(s)] = frozenset(out)
        return frozenset(out)

    def marked(self, s: Any, seen: frozenset[int] = frozenset()) -> bool:
        """Whether a followed `MARK` lies at or below `s`."""
        if not isinstance(s, dict) or id(s) in seen:
            return False
        got = self._marked.get(id(s))
        if got is not None:
            return got
        seen = seen | {id(s)}
        out = bool(s.get(MARK)) or any(self.marked(c, seen) for c in self._followed(s))
        self._marked[id(s)] = out
        return out

    def _followed(self, s: dict[str, Any]) -> list[Any]:
        out: list[Any] = []
        for key in ("properties", "patternProperties"):
            if isinstance(s.get(key), dict):
                out.extend(s[key].values())
        for key in ("additionalProperties", "items"):
            if isinstance(s.get(key), dict):
                out.append(s[key])
        for key in ("prefixItems", "allOf", "anyOf", "oneOf"):
            if isinstance(s.get(key), list):
                out.extend(s[key])
        if isinstance(s.get("$ref"), str):
            target = self.resolve(s["$ref"])
            if target is not None:
                out.append(target)
        return out


def mark(schema: Any, text: str | None = None) -> Any:
    """`schema` with each `uniqueItems: true` the rule can follow replaced by `MARK` (and
    each `uniqueItems: false` dropped); a new object where anything changed. `text`: its
    JSON text where the caller has it.

    Raises:
        GrammarError: an array whose items can take fewer distinct values than its
            `minItems` asks for.
    """
    if not isinstance(schema, dict):
        return schema
    if text is None or "\\" in text:  # (a key spelled with an escape: write it plainly)
        text = json.dumps(schema)
    if '"uniqueItems"' not in text:
        return schema
    root = json.loads(json.dumps(schema))  # a copy to mark in place
    facts = _Schema(root)
    elsewhere: set[int] = set()
    _reach(root, facts, False, set(), elsewhere)
    _mark(root, facts, set(), elsewhere)
    return root


# subschemas of the same instance or a part of it that the rule does not follow
_UNFOLLOWED_ONE = ("not", "if", "then", "else", "contains", "propertyNames",
                   "additionalItems", "unevaluatedItems", "unevaluatedProperties")


def _disjoint(branches: list[Any], facts: _Schema) -> list[bool]:
    """Which `anyOf`/`oneOf` branches no other branch shares a JSON kind with."""
    kinds = [facts.kinds(b) for b in branches]
    return [not kinds[i] & frozenset().union(*(k for j, k in enumerate(kinds) if j != i))
            for i in range(len(branches))]


def _reach(s: Any, facts: _Schema, under: bool, seen: set[tuple[int, bool]],
           elsewhere: set[int]) -> None:
    """Collect in `elsewhere` the nodes reachable through an edge the rule does not follow
    (`under`): a `uniqueItems` there must stay as written."""
    if not isinstance(s, dict) or (id(s), under) in seen:
        return
    seen.add((id(s), under))
    if under:
        elsewhere.add(id(s))
    for key in ("properties", "patternProperties", "dependentSchemas"):
        if isinstance(s.get(key), dict):
            for c in s[key].values():
                _reach(c, facts, under or key == "dependentSchemas", seen, elsewhere)
    for key in ("additionalProperties", "items"):
        _reach(s.get(key), facts, under, seen, elsewhere)
    for key in _UNFOLLOWED_ONE:
        _reach(s.get(key), facts, True, seen, elsewhere)
    for key in ("prefixItems", "allOf"):
        if isinstance(s.get(key), list):
            for c in s[key]:
                _reach(c, facts, under, seen, elsewhere)
    for key in ("anyOf", "oneOf"):
        if isinstance(s.get(key), list):
            for c, alone in zip(s[key], _disjoint(s[key], facts)):
                _reach(c, facts, under or not alone, seen, elsewhere)
    if isinstance(s.get("$ref"), str):
        _reach(facts.resolve(s["$ref"]), facts, under, seen, elsewhere)


def _mark(s: Any, facts: _Schema, seen: set[int], elsewhere: set[int]) -> None:
    """Mark what is followed from `s` (a node of the copy)."""
    if not isinstance(s, dict) or id(s) in seen:
        return
    seen.add(id(s))
    if s.get("uniqueItems") is False:
        s.pop("uniqueItems")
    if s.get("uniqueItems") is True and _items_scalar(s, facts) and id(s) not in elsewhere:
        s.pop("uniqueItems")
        s[MARK] = True
        _check_domain(s, facts)
    for key in ("anyOf", "oneOf"):
        branches = s.get(key)
        if not isinstance(branches, list):
            continue
        for b, alone in zip(branches, _disjoint(branches, facts)):
            if alone:
                _mark(b, facts, seen, elsewhere)
    for key in ("properties", "patternProperties"):
        if isinstance(s.get(key), dict):
            for c in s[key].values():
                _mark(c, facts, seen, elsewhere)
    for key in ("additionalProperties", "items"):
        _mark(s.get(key), facts, seen, elsewhere)
    for key in ("prefixItems", "allOf"):
        if isinstance(s.get(key), list):
            for c in s[key]:
                _mark(c, facts, seen, elsewhere)
    if isinstance(s.get("$ref"), str):
        _mark(facts.resolve(s["$ref"]), facts, seen, elsewhere)


def _item_schemas(s: dict[str, Any]) -> list[Any]:
    out = list(s.get("prefixItems", [])) if isinstance(s.get("prefixItems"), list) else []
    out.append(s.get("items", True))
    return out


def _items_scalar(s: dict[str, Any], facts: _Schema) -> bool:
    return all(facts.kinds(i) <= _SCALARS for i in _item_schemas(s))


def _check_domain(s: dict[str, Any], facts: _Schema) -> None:
    """Refuse an array whose items' finite domain is smaller than its `minItems`."""
    need = s.get("minItems", 0)
    if not isinstance(need, int) or need < 2 or s.get("prefixItems"):
        return
    size = _domain_size(s.get("items", True), facts)
    if size is not None and size < need:
        raise GrammarError("json_schema", f"uniqueItems: the items can take only {size} "
                                          f"distinct values, fewer than minItems ({need})")


def _domain_size(s: Any, facts: _Schema) -> int | None:
    """How many distinct values `s` allows, where that is plainly finite (None: open or not
    worked out)."""
    if s is False:
        return 0
    if not isinstance(s, dict):
        return None
    if isinstance(s.get("$ref"), str) and len(s) == 1:
        return _domain_size(facts.resolve(s["$ref"]), facts)
    if "const" in s:
        return 1
    if isinstance(s.get("enum"), list):
        return len({_canonical_json(v) for v in s["enum"]})
    kinds = facts.kinds(s)
    if kinds == {"boolean"}:
        return 2
    if kinds == {"null"}:
        return 1
    if s.get("type") == "integer":
        lo = s.get("minimum", s.get("exclusiveMinimum"))
        hi = s.get("maximum", s.get("exclusiveMaximum"))
        if isinstance(lo, (int, float)) and isinstance(hi, (int, float)):
            lo_i = int(np.ceil(lo)) + (1 if "exclusiveMinimum" in s and "minimum" not in s
                                       and float(lo).is_integer() else 0)
            hi_i = int(np.floor(hi)) - (1 if "exclusiveMaximum" in s and "maximum" not in s
                                        and float(hi).is_integer() else 0)
            return max(0, hi_i - lo_i + 1)
    return None


def _int_span(bounds: list[tuple[str, float]], most: int = 10_000) -> range | None:
    """The integers the bounds allow, where both ends are bounded and they number at most
    `most`."""
    lo, hi = -float("inf"), float("inf")
    for k, v in bounds:
        if k == "minimum":
            lo = max(lo, np.ceil(v))
        elif k == "exclusiveMinimum":
            lo = max(lo, np.floor(v) + 1)
        elif k == "maximum":
            hi = min(hi, np.floor(v))
        else:
            hi = min(hi, np.ceil(v) - 1)
    if not (np.isfinite(lo) and np.isfinite(hi)) or hi - lo + 1 > most:
        return None
    return range(int(lo), int(hi) + 1)


def _canonical_json(v: Any) -> Any:
    if isinstance(v, bool) or v is None:
        return ("b", v)
    if isinstance(v, (int, float)):
        return ("n", Decimal(repr(v)) if isinstance(v, float) else Decimal(v))
    if isinstance(v, str):
        return ("s", v.encode("utf-8", "surrogatepass"))
    return ("j", json.dumps(v, sort_keys=True))


# ---------------------------------------------------------------------------------------
# The reader: where the answer is, as it is written


class Locator:
    """The schema nodes that apply to a value, child by child (only nodes with a `MARK` at
    or below them: the rest cannot matter)."""

    def __init__(self, marked_root: dict[str, Any]) -> None:
        self.facts = _Schema(marked_root)
        self._domains: dict[tuple[tuple[int, ...], int], tuple[str, Any] | None] = {}

    def expand(self, s: Any, kind: str, out: list[dict[str, Any]], seen: set[int]) -> None:
        if not isinstance(s, dict) or id(s) in seen or not self.facts.marked(s):
            return
        seen.add(id(s))
        out.append(s)
        if isinstance(s.get("$ref"), str):
            self.expand(self.facts.resolve(s["$ref"]), kind, out, seen)
        for b in s.get("allOf", []) if isinstance(s.get("allOf"), list) else []:
            self.expand(b, kind, out, seen)
        for key in ("anyOf", "oneOf"):
            branches = s.get(key)
            if isinstance(branches, list):
                for b, alone in zip(branches, _disjoint(branches, self.facts)):
                    if alone and kind in self.facts.kinds(b):
                        self.expand(b, kind, out, seen)

    def nodes(self, parents: list[Any], kind: str) -> tuple[dict[str, Any], ...] | None:
        out: list[dict[str, Any]] = []
        seen: set[int] = set()
        for p in parents:
            self.expand(p, kind, out, seen)
        return tuple(out) or None

    def domain(self, nodes: tuple[dict[str, Any], ...] | None, index: int
               ) -> tuple[str, Any] | None:
        """What the unique array's item at `index` may be, where that is simple: ("plain",
        its `maxLength` or inf) for a string with length bounds only, ("enum", its values)
        for an `enum`/`const` (through `$ref` and `allOf`); None for anything else."""
        if nodes is None:
            return None
        # (by the schema nodes themselves, which live as long as this locator: a tuple of
        # them is made per array, and its id may be reused)
        key = (tuple(map(id, nodes)), index if any(n.get("prefixItems") for n in nodes) else -1)
        if key in self._domains:
            return self._domains[key]
        todo, cap, plain, seen = Locator.item(nodes, index), float("inf"), False, set()
        values: frozenset[Any] | None = None
        out: tuple[str, Any] | None = None
        ints, bounds = False, []
        while todo:
            s = todo.pop()
            if s is True:
                continue
            if not isinstance(s, dict) or id(s) in seen or set(s) - _SIMPLE:
                break
            seen.add(id(s))
            if s.get("type") == "string":
                plain = True
            elif s.get("type") == "integer":
                ints = True
            elif "type" in s:
                break
            for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if isinstance(s.get(k), (int, float)) and not isinstance(s.get(k), bool):
                    bounds.append((k, s[k]))
            if "enum" in s or "const" in s:
                got = frozenset(map(_canonical_json, s["enum"] if isinstance(
                    s.get("enum"), list) else [s.get("const")]))
                values = got if values is None else values & got
            if isinstance(s.get("maxLength"), int):
                cap = min(cap, s["maxLength"])
            if isinstance(s.get("$ref"), str):
                todo.append(self.facts.resolve(s["$ref"]))
            todo.extend(s.get("allOf", []) if isinstance(s.get("allOf"), list) else [])
        else:
            if values is not None and cap == float("inf") and not (
                    plain and any(v[0] != "s" for v in values)):
                out = ("enum", values)
            elif values is None and plain and not ints and not bounds:
                out = ("plain", cap)
            elif values is None and ints and not plain:
                span = _int_span(bounds)
                if span is not None:
                    out = ("ints", span)
        self._domains[key] = out
        return out

    @staticmethod
    def member(nodes: tuple[dict[str, Any], ...], key: str) -> list[Any]:
        out: list[Any] = []
        for n in nodes:
            props = n.get("properties") if isinstance(n.get("properties"), dict) else {}
            matched = key in props
            if matched:
                out.append(props[key])
            pats = n.get("patternProperties")
            if isinstance(pats, dict):
                for pat, sub in pats.items():
                    try:
                        hit = re.search(pat, key) is not None
                    except re.error:
                        hit = True  # (a pattern Python cannot read: follow it anyway)
                    if hit:
                        out.append(sub)
                        matched = True
            if not matched and isinstance(n.get("additionalProperties"), dict):
                out.append(n["additionalProperties"])
        return out

    @staticmethod
    def item(nodes: tuple[dict[str, Any], ...], index: int) -> list[Any]:
        out: list[Any] = []
        for n in nodes:
            pre = n.get("prefixItems") if isinstance(n.get("prefixItems"), list) else []
            if index < len(pre):
                out.append(pre[index])
            elif isinstance(n.get("items"), dict):
                out.append(n["items"])
        return out


# what an item `Locator.domain` decides may hold
_SIMPLE = frozenset({"type", "maxLength", "minLength", "enum", "const", "$ref", "allOf",
                     "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                     "title", "description", "default", "examples", "$comment", "deprecated",
                     "readOnly", "writeOnly"})
# reader modes
VALUE, OPEN, KEY, COLON, AFTER, STR, NUM, LIT, END = range(9)
_WS = frozenset(b" \t\n\r")
_NUM = frozenset(b"0123456789+-.eE")
_LITS = {ord("t"): b"true", ord("f"): b"false", ord("n"): b"null"}
_ESC = {ord('"'): b'"', ord("\\"): b"\\", ord("/"): b"/", ord("b"): b"\b",
        ord("f"): b"\f", ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t"}


class _Frame:
    __slots__ = ("array", "nodes", "unique", "items", "index", "key")

    def __init__(self, array: bool, nodes: tuple[dict[str, Any], ...] | None,
                 unique: bool) -> None:
        self.array, self.nodes, self.unique = array, nodes, unique
        self.items: tuple[Any, ...] = ()
        self.index = 0
        self.key: bytes | None = None

    def copy(self) -> _Frame:
        f = _Frame(self.array, self.nodes, self.unique)
        f.items, f.index, f.key = self.items, self.index, self.key
        return f


class Scan:
    """The answer's JSON read so far: a stack of containers (each array that must hold
    unique items keeps its items, as JSON values), the mode, and the scalar under way."""

    __slots__ = ("loc", "stack", "mode", "buf", "esc", "item", "root")

    def __init__(self, loc: Locator) -> None:
        self.loc = loc
        self.stack: list[_Frame] = []
        self.mode = VALUE
        self.buf = bytearray()  # a string's decoded bytes, a number's or literal's text
        self.esc = b""  # an escape under way in a string (from its backslash)
        self.item = False  # the scalar under way is an item of a unique array
        self.root: tuple[dict[str, Any], ...] | None = (loc.facts.root,)

    def copy(self) -> Scan:
        s = Scan.__new__(Scan)
        s.loc, s.mode, s.item, s.esc, s.root = self.loc, self.mode, self.item, self.esc, \
            self.root
        s.stack = [f.copy() for f in self.stack]
        s.buf = bytearray(self.buf)
        return s

    # -- what the rule reads

    def top_unique(self) -> _Frame | None:
        f = self.stack[-1] if self.stack else None
        return f if f is not None and f.unique else None

    def strings(self) -> list[bytes]:
        """The earlier string items of the unique array under way that the string under
        way could still become."""
        f = self.stack[-1]
        v = bytes(self.buf)
        return [x[1] for x in f.items if x[0] == "s" and x[1].startswith(v)]

    def at_risk(self) -> bool:
        """Whether the item under way could still turn out a duplicate (then a search over
        the grammar's masks decides whether it can still differ). Two kinds of item are
        decided here: a plain string (no `pattern`, `format`, `enum` or `const`) can always
        differ while it is shorter than its `maxLength` (another character is free to
        choose), and a string `enum` while one of its unused values starts as it does."""
        f = self.top_unique()
        if f is None or not f.items:
            return False
        if self.mode == VALUE:
            dom = self.loc.domain(f.nodes, f.index)
            if dom is None:
                return True
            if dom[0] == "plain":
                return dom[1] == 0
            if dom[0] == "ints":
                return not any(("n", Decimal(n)) not in f.items for n in dom[1])
            return not any(e not in f.items for e in dom[1])
        if self.mode == STR and self.item:
            if not self.strings():
                return False  # no earlier item starts so
            dom = self.loc.domain(f.nodes, f.index)
            if dom is None or (self.esc and dom[0] == "enum"):
                return True
            v = bytes(self.buf)
            if dom[0] == "enum":
                return not any(e[0] == "s" and e[1].startswith(v) and e not in f.items
                               for e in dom[1])
            done = codecs.getincrementaldecoder("utf-8")("ignore").decode(v)
            # (a character under way is one character, whichever it turns out)
            chars = len(done) + (len(done.encode()) < len(v)) + bool(self.esc)
            return chars >= dom[1]
        if self.mode in (NUM, LIT) and self.item:
            kind = "n" if self.mode == NUM else "b"
            if not any(x[0] == kind for x in f.items):
                return False
            dom = self.loc.domain(f.nodes, f.index)
            if self.mode == NUM and dom is not None and dom[0] == "ints":
                p = self.buf.decode("latin-1")
                return not any(str(n).startswith(p) and ("n", Decimal(n)) not in f.items
                               for n in dom[1])
            return True
        return False

    # -- reading

    def feed(self, data: bytes) -> bool:
        """Read `data`; False where it completes an item equal to an earlier one of its
        unique array (the reader is then left mid-way and must be dropped)."""
        for b in data:
            if not self._byte(b):
                return False
        return True

    def _value_nodes(self) -> list[Any] | None:
        if not self.stack:
            return list(self.root) if self.root else None
        f = self.stack[-1]
        if f.nodes is None:
            return None
        if f.array:
            return Locator.item(f.nodes, f.index)
        key = (f.key or b"").decode("utf-8", "replace")
        return Locator.member(f.nodes, key)

    def _start(self, b: int) -> bool:
        parent = self.stack[-1] if self.stack else None
        in_unique = parent is not None and parent.unique
        if b == ord("{") or b == ord("["):
            parents = self._value_nodes()
            kind = "object" if b == ord("{") else "array"
            nodes = self.loc.nodes(parents, kind) if parents else None
            unique = kind == "array" and nodes is not None and any(n.get(MARK) for n in nodes)
            self.stack.append(_Frame(kind == "array", nodes, unique))
            self.mode = OPEN if kind == "object" else VALUE
            return True
        self.item = in_unique
        self.buf = bytearray()
        self.esc = b""
        if b == ord('"'):
            self.mode = STR
        elif b in _LITS:
            self.mode = LIT
            self.buf.append(b)
            return self._literal_done()
        else:
            self.mode = NUM
            self.buf.append(b)
        return True

    def _literal_done(self) -> bool:
        for lit in _LITS.values():
            if bytes(self.buf) == lit:
                value = None if lit == b"null" else lit == b"true"
                return self._scalar(("b", value))
        return True

    def _scalar(self, value: Any) -> bool:
        """A scalar value completed."""
        ok = True
        if self.item:
            f = self.stack[-1]
            ok = value not in f.items
            f.items = f.items + (value,)
        self.item = False
        self._after_value()
        return ok

    def _after_value(self) -> None:
        self.mode = AFTER if self.stack else END

    def _byte(self, b: int) -> bool:
        mode = self.mode
        if mode == STR:
            return self._string_byte(b)
        if mode == KEY:
            f = self.stack[-1]
            if self.esc:
                self.esc += bytes([b])
                done = _escape(self.esc)
                if done is not None:
                    f.key = (f.key or b"") + done
                    self.esc = b""
            elif b == ord("\\"):
                self.esc = b"\\"
            elif b == ord('"'):
                self.mode = COLON
            else:
                f.key = (f.key or b"") + bytes([b])
            return True
        if mode == NUM:
            if b in _NUM:
                self.buf.append(b)
                return True
            try:
                value = Decimal(self.buf.decode())
            except (InvalidOperation, UnicodeDecodeError):
                value = self.buf.decode("latin-1")
            if not self._scalar(("n", value)):
                return False
            return self._byte(b)
        if mode == LIT:
            self.buf.append(b)
            return self._literal_done()
        if b in _WS:
            return True
        if mode == VALUE:
            if b == ord("]") and self.stack and self.stack[-1].array:
                return self._close()
            return self._start(b)
        if mode == OPEN:
            if b == ord("}"):
                return self._close()
            if b == ord('"'):
                self.stack[-1].key = b""
                self.mode = KEY
            return True
        if mode == COLON:
            if b == ord(":"):
                self.mode = VALUE
            return True
        if mode == AFTER:
            f = self.stack[-1]
            if b == ord(","):
                if f.array:
                    f.index += 1
                    self.mode = VALUE
                    f.key = None
                else:
                    self.mode = OPEN
                return True
            if b in (ord("]"), ord("}")):
                return self._close()
            return True
        return True  # END: trailing bytes

    def _close(self) -> bool:
        self.stack.pop()
        self._after_value()
        return True

    def _string_byte(self, b: int) -> bool:
        if self.esc:
            self.esc += bytes([b])
            done = _escape(self.esc)
            if done is not None:
                if self.item:
                    self.buf += done
                self.esc = b""
            return True
        if b == ord("\\"):
            self.esc = b"\\"
            return True
        if b == ord('"'):
            return self._scalar(("s", bytes(self.buf)))
        if self.item:
            self.buf.append(b)
        return True


def _escape(esc: bytes) -> bytes | None:
    """The UTF-8 bytes of a complete escape (from its backslash), None while incomplete
    (a high surrogate waits for its pair)."""
    if len(esc) < 2:
        return None
    c = esc[1]
    if c != ord("u"):
        return _ESC.get(c, esc[1:2])
    if len(esc) < 6:
        return None
    try:
        hi = int(esc[2:6], 16)
    except ValueError:
        return esc[2:6]
    if 0xD800 <= hi < 0xDC00:
        if len(esc) < 12:
            if len(esc) >= 7 and esc[6] != ord("\\") or len(esc) >= 8 and esc[7] != ord("u"):
                return chr(hi).encode("utf-8", "surrogatepass") + esc[6:]
            return None
        try:
            lo = int(esc[8:12], 16)
        except ValueError:
            return chr(hi).encode("utf-8", "surrogatepass")
        if 0xDC00 <= lo < 0xE000:
            return chr(0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)).encode()
        return (chr(hi) + chr(lo)).encode("utf-8", "surrogatepass")
    return chr(hi).encode("utf-8", "surrogatepass")


# ---------------------------------------------------------------------------------------
# The rule


class Vocab:
    """Each token's bytes and the facts the rule filters candidates by (per tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        n = tokenizer.vocab_size
        self.n = n
        self.bytes: list[bytes] = []
        self.ids: dict[bytes, list[int]] = {}  # the tokens spelled so
        first = np.full(n, 256, dtype=np.int16)
        second = np.full(n, 256, dtype=np.int16)
        quotes = np.zeros(n, dtype=np.int8)
        bs = np.zeros(n, dtype=bool)
        comma = np.zeros(n, dtype=bool)
        opens = np.zeros(n, dtype=bool)
        for i in range(n):
            b = b"" if tokenizer.is_special_token(i) else tokenizer.decode_bytes([i])
            self.bytes.append(b)
            if b:
                self.ids.setdefault(b, []).append(i)
                first[i] = b[0]
                if len(b) > 1:
                    second[i] = b[1]
                quotes[i] = min(b.count(b'"'), 2)
                bs[i] = b"\\" in b
                comma[i] = b"," in b
                opens[i] = b"[" in b
        self.first, self.second, self.bs, self.comma, self.opens = first, second, bs, comma, \
            opens
        self.quote = quotes > 0
        self.two_quotes = quotes > 1
        self.not_quote_first = first != ord('"')

    def prefixes(self, rests: list[bytes], lead: bytes = b"") -> list[int]:
        """The tokens spelled `lead` then a non-empty start of one of `rests`."""
        out: list[int] = []
        for rest in set(rests):
            for k in range(1, len(rest) + 1):
                out.extend(self.ids.get(lead + rest[:k], ()))
        return out


class UniqueRule:
    """A compiled schema's uniqueness rule over one tokenizer's vocabulary."""

    def __init__(self, marked_schema: dict[str, Any], vocab: Vocab,
                 thinking: Thinking | None = None) -> None:
        self.locator = Locator(marked_schema)
        self.vocab = vocab
        self.thinking = thinking

    def candidates(self, scan: Scan | None, allowed: np.ndarray) -> np.ndarray:
        """The allowed tokens whose effect the rule must read (ids)."""
        v = self.vocab
        n = min(v.n, allowed.size)
        a = allowed[:n]
        if scan is None:  # before the answer: a token that begins it could open an array
            return np.flatnonzero(a & v.opens[:n])
        f = scan.top_unique()
        mode = scan.mode
        if f is None:
            if mode in (STR, KEY):
                s = v.quote & v.opens
            else:
                s = v.opens
        elif mode == STR:
            s = v.quote | v.bs if scan.item else v.quote
            if scan.item and f.items:
                at = len(scan.buf)
                return _with(np.flatnonzero(a & s[:n]), a,
                             v.prefixes([x[at:] for x in scan.strings()]))
        elif mode in (NUM, LIT):
            s = np.ones(v.n, dtype=bool)
        elif mode == VALUE:
            s = v.two_quotes | v.comma | v.opens | v.bs
            if f.items:
                s = s | v.not_quote_first
                strings = [x[1] for x in f.items if x[0] == "s"]
                return _with(np.flatnonzero(a & s[:n]), a, v.prefixes(strings, b'"') +
                             list(v.ids.get(b'"', ())))
        else:  # AFTER
            s = v.comma | v.opens
        return np.flatnonzero(a & s[:n])

    def judge(self, inner: Any, scan: Scan, token: TokenId, budget: list[int]) -> bool:
        """Whether the rule takes `token` at `scan` (the grammar, `inner`, allows it)."""
        b = self.vocab.bytes[token]
        if scan.mode == STR and scan.item and not scan.esc and b"\\" not in b:
            q = b.find(b'"')
            if q >= 0 and b.count(b'"') == 1 and b"," not in b[q:] and b"[" not in b[q:]:
                # closes the string item and no other: it repeats, or it does not
                return ("s", bytes(scan.buf) + b[:q]) not in scan.stack[-1].items
        s = scan.copy()
        if not s.feed(b):
            return False
        if not s.at_risk():
            return True
        m = inner.deep_copy()
        if not m.consume_token(token) or m.is_error():
            return False
        return self.viable(m, s, budget)

    def viable(self, m: Any, scan: Scan, budget: list[int]) -> bool:
        """Whether the item under way at `scan` (grammar state `m`) can still be completed
        into a value unlike every earlier item of its array: a breadth-first search over
        the grammar's masks, to the first continuation that completes it so or can no
        longer repeat (`budget[0]`: the states it may still expand)."""
        depth = len(scan.stack)
        have = len(scan.stack[-1].items)
        queue = [(m, scan)]
        while queue:
            m, scan = queue.pop(0)
            budget[0] -= 1
            if budget[0] < 0:
                return False
            allowed = _allowed(m, self.vocab.n)
            if allowed is None:
                continue
            cands = self.candidates(scan, allowed)
            if int(allowed.sum()) > len(cands):
                return True  # an allowed token the rule need not read: it cannot repeat
            for t in cands.tolist():
                s = scan.copy()
                if not s.feed(self.vocab.bytes[t]):
                    continue  # a duplicate
                if len(s.stack) < depth or len(s.stack[depth - 1].items) > have \
                        or not s.at_risk():
                    return True  # completed unlike the others, or can no longer repeat
                n = m.deep_copy()
                if n.consume_token(t) and not n.is_error():
                    queue.append((n, s))
        return False


def _with(ids: np.ndarray, allowed: np.ndarray, more: list[int]) -> np.ndarray:
    """`ids` and the allowed ones of `more`, in order, once each."""
    extra = [t for t in more if t < allowed.size and allowed[t]]
    return np.union1d(ids, np.asarray(extra, dtype=ids.dtype)) if extra else ids


def _allowed(m: Any, vocab_n: int) -> np.ndarray | None:
    words = (vocab_n + 31) // 32
    row = np.zeros(words, dtype=np.int32)
    m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    if m.is_error():
        return None
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_n].astype(bool)


class UniqueCursor:
    """A grammar state with the uniqueness rule (a `types.GrammarState`): the request's
    `LLMatcher` and the answer's reader, advanced together."""

    def __init__(self, inner: Any, rule: UniqueRule, scan: Scan | None = None,
                 before: bytes | None = None, error: str | None = None) -> None:
        self.inner, self.rule = inner, rule
        # the reader, from the answer's first byte; while a reasoning protocol's answer has
        # not begun, None and the output so far in `before`
        if scan is None and before is None:
            if rule.thinking is None:
                scan = Scan(rule.locator)
            else:
                before = b""
        self.scan, self.before, self.error = scan, before, error

    @staticmethod
    def of(inner: Any, rule: UniqueRule) -> UniqueCursor:
        return UniqueCursor(inner, rule)

    # -- the reader through a reasoning protocol

    def _advanced(self, token: TokenId) -> tuple[Scan | None, bytes | None, bool]:
        data = self.rule.vocab.bytes[token] if token < self.rule.vocab.n else b""
        if self.scan is not None:
            s = self.scan.copy()
            return s, None, s.feed(data)
        before = (self.before or b"") + data
        text = before.decode("utf-8", "surrogateescape")
        assert self.rule.thinking is not None
        _, _, start = reasoning_bounds(text, self.rule.thinking)
        if start is None:
            return None, before, True
        s = Scan(self.rule.locator)
        return s, None, s.feed(text[start:].encode("utf-8", "surrogateescape"))

    def _takes(self, token: TokenId) -> tuple[bool, Scan | None, bytes | None]:
        """Whether the rule takes `token` here (the grammar allowing it)."""
        scan, before, ok = self._advanced(token)
        if not ok:
            return False, scan, before
        if scan is not None and scan.at_risk():
            m = self.inner.deep_copy()
            if not m.consume_token(token) or m.is_error():
                return False, scan, before
            return self.rule.viable(m, scan, [SEARCH_NODES]), scan, before
        return True, scan, before

    # -- types.GrammarState

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        self.inner.unsafe_compute_mask_ptr(ptr, size)
        if self.error is not None or self.inner.is_error():
            return
        row = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_int32 * (size // 4))
                                    .from_address(ptr))
        n = min(self.rule.vocab.n, (size // 4) * 32)
        allowed = np.unpackbits(row.view(np.uint8), bitorder="little")[:n].astype(bool)
        if self.scan is None:
            cands = self.rule.candidates(None, allowed)
            refuse = [int(t) for t in cands if not self._takes(int(t))[0]]
        else:
            refuse = []
            budget = [SEARCH_NODES]
            for t in self.rule.candidates(self.scan, allowed).tolist():
                budget[0] = SEARCH_NODES
                if not self.rule.judge(self.inner, self.scan, t, budget):
                    refuse.append(t)
        for t in refuse:
            row[t >> 5] = np.int32(np.uint32(int(row[t >> 5]) & 0xFFFFFFFF
                                             & ~(1 << (t & 31))).view(np.int32))

    def consume_token(self, token: TokenId) -> bool:
        if self.error is not None:
            return False
        ok, scan, before = self._takes(int(token))
        if not ok:
            self.error = (f"uniqueItems: token {int(token)} would repeat an earlier item of "
                          f"its array, or leave it no way to differ")
            return False
        if not self.inner.consume_token(token):
            return False
        self.scan, self.before = scan, before
        return True

    def try_consume_tokens(self, tokens: list[TokenId]) -> int:
        for i, t in enumerate(tokens):
            if self.inner.validate_tokens([t]) != 1 or not self._takes(int(t))[0]:
                return i
            if not self.consume_token(t):
                return i
        return len(tokens)

    def deep_copy(self) -> UniqueCursor:
        return UniqueCursor(self.inner.deep_copy(), self.rule,
                            None if self.scan is None else self.scan.copy(),
                            self.before, self.error)

    def is_error(self) -> bool:
        return self.error is not None or bool(self.inner.is_error())

    def get_error(self) -> str:
        return self.error or str(self.inner.get_error())

    def stop_reason(self) -> str:
        return "InternalError" if self.error is not None else self.inner.stop_reason()

    def is_stopped(self) -> bool:
        return bool(self.inner.is_stopped())

    def is_accepting(self) -> bool:
        return bool(self.inner.is_accepting())

    def compute_ff_tokens(self) -> list[TokenId]:
        """The grammar's forced tokens, up to the first the rule must judge."""
        out: list[TokenId] = []
        probe = self.deep_copy()
        for t in self.inner.compute_ff_tokens():
            ok, scan, _ = probe._takes(int(t))
            if not ok or scan is None or scan.at_risk() or not probe.consume_token(t):
                break
            out.append(t)
        return out


def state(inner: GrammarState, rule: UniqueRule | None) -> GrammarState:
    """`inner` with the uniqueness rule, where the grammar has one."""
    return inner if rule is None else UniqueCursor(inner, rule)  # type: ignore[return-value]
