"""JSON Schema keywords the grammar compiler does not hold, rewritten exactly into ones it does.

llguidance compiles `anyOf`, `allOf`, `properties`, `required`, `type`, `enum`/`const`,
numeric and length bounds, `pattern` and `false` schemas, but not `dependentRequired`,
`dependentSchemas`, `if`/`then`/`else`, `not`, `propertyNames` or `unevaluated*`. Each of
those is rewritten here into an equivalent schema over what it does hold, before the schema
reaches the compiler:

- `dependentRequired: {a: [b, c]}`: `anyOf: [{properties: {a: false}}, {required: [a, b, c]}]`
  (a non-object satisfies both, as it satisfies the keyword);
- `dependentSchemas: {a: S}`: `anyOf: [{properties: {a: false}}, {required: [a], allOf: [S]}]`;
- `if: I, then: T, else: E`: `anyOf: [{allOf: [I, T]}, {allOf: [not I, E]}]`, `not I`
  computed by `negate`;
- `not: S`: `negate(S)`;
- `propertyNames`: a name it refuses among `properties` becomes `false`; the names of
  additional properties are held by `patternProperties` (a `pattern`, a length bound, an
  `enum`/`const`, or `false`);
- `unevaluatedProperties` / `unevaluatedItems` on a schema with no in-place applicator (no
  `allOf`/`anyOf`/`oneOf`/`if`/`dependentSchemas`/`$ref`): what is unevaluated there is what
  `additionalProperties` / `items` (after `prefixItems`) would see.

`negate` computes the complement of a schema over the decidable forms: `true`/`false`,
`type`, `const`/`enum` of scalars, `required`, numeric bounds, length and count bounds,
`properties`, `allOf`/`anyOf`/`not` of those. A keyword outside them (a `pattern`, `items`,
`$ref`, ...) cannot be negated: the keyword that needed it is left as written, so a strict
schema is refused naming it and a lenient one warns, as before.

Every rewrite is checked against `jsonschema` on generated instances
(tests/test_schema_rewrite.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from .errors import SchemaNotRewritable

# In-place applicators: keywords whose subschemas evaluate the same instance (and so can
# mark its properties or items evaluated).
_IN_PLACE = ("allOf", "anyOf", "oneOf", "if", "then", "else", "dependentSchemas", "$ref",
             "$dynamicRef")
_TYPES = ("null", "boolean", "object", "array", "number", "string")
# Annotations: no effect on validity, so ignored when negating.
_ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default",
                          "deprecated", "readOnly", "writeOnly", "$schema",
                          "contentMediaType", "contentEncoding", "x-guidance"})
_CHILD_MAPS = ("properties", "patternProperties", "$defs", "definitions",
               "dependentSchemas")
_CHILD_ONE = ("items", "additionalProperties", "contains", "propertyNames", "not", "if",
              "then", "else", "unevaluatedProperties", "unevaluatedItems",
              "additionalItems")
_CHILD_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")


Unsupported = SchemaNotRewritable  # a schema `negate` cannot complement exactly


# Any of the keywords held here, as a key or a string anywhere in a schema's JSON text: a
# schema without one (most) is handed on as it came, at the cost of one `json.dumps`.
_HELD = re.compile(r'"(?:dependentRequired|dependentSchemas|if|then|else|not|propertyNames'
                   r'|unevaluatedProperties|unevaluatedItems)"')


def rewrite(schema: Any, text: str | None = None) -> Any:
    """`schema` with every keyword this module holds rewritten (a new object where one was
    rewritten; the input is never changed). Keywords it cannot rewrite exactly stay as
    written. `text`: the schema's JSON text where the caller has it (read for the keywords
    instead of writing it again)."""
    if not isinstance(schema, dict):
        return schema
    try:
        if text is None or "\\" in text:  # (a key spelled with an escape: write it plainly)
            text = json.dumps(schema)
        if not _HELD.search(text):
            return schema
    except (TypeError, ValueError):  # not JSON as it stands: the walk below decides
        pass
    # a `then`/`else` with no `if` (and an `if` alone) has no effect and is dropped, unless
    # a `$ref` points into one of them
    pointed = {seg for ref in _refs(schema) for seg in ref.split("/")}
    return _rewrite(schema, keep_lone=bool(pointed & {"if", "then", "else"}))


def _refs(x: Any) -> list[str]:
    if isinstance(x, dict):
        out = [x["$ref"]] if isinstance(x.get("$ref"), str) else []
        return out + [r for v in x.values() for r in _refs(v)]
    if isinstance(x, list):
        return [r for v in x for r in _refs(v)]
    return []


def _rewrite(schema: Any, keep_lone: bool) -> Any:
    if isinstance(schema, bool) or not isinstance(schema, dict):
        return schema
    s = {k: _children(k, v, keep_lone) for k, v in schema.items()}
    extra: list[Any] = []
    _unevaluated(s)
    dr = s.pop("dependentRequired", None)
    if isinstance(dr, dict):
        for name, deps in dr.items():
            extra.append({"anyOf": [{"properties": {name: False}},
                                    {"required": _unique([name, *deps])}]})
    ds = s.get("dependentSchemas")
    if isinstance(ds, dict):
        s.pop("dependentSchemas")
        for name, sub in ds.items():
            extra.append({"anyOf": [{"properties": {name: False}},
                                    {"required": [name], "allOf": [sub]}]})
    if not keep_lone:
        if "if" in s and "then" not in s and "else" not in s:
            s.pop("if")
        if "if" not in s:
            s.pop("then", None)
            s.pop("else", None)
    if "if" in s:
        cond = s["if"]
        try:
            neg = negate(cond)
        except Unsupported:
            neg = None
        if neg is not None:
            then, other = s.pop("then", True), s.pop("else", True)
            s.pop("if")
            extra.append({"anyOf": [_all(cond, then), _all(neg, other)]})
    if "not" in s:
        try:
            extra.append(negate(s["not"]))
            s.pop("not")
        except Unsupported:
            pass
    if "propertyNames" in s:
        _property_names(s)
    if extra:
        s["allOf"] = [*s.get("allOf", []), *extra]
    return s


def _children(key: str, value: Any, keep_lone: bool) -> Any:
    if key in _CHILD_MAPS and isinstance(value, dict):
        return {k: _rewrite(v, keep_lone) for k, v in value.items()}
    if key in _CHILD_ONE:
        return ([_rewrite(v, keep_lone) for v in value] if isinstance(value, list)
                else _rewrite(value, keep_lone))
    if key in _CHILD_LISTS and isinstance(value, list):
        return [_rewrite(v, keep_lone) for v in value]
    return value


def _unique(names: list[Any]) -> list[Any]:
    return list(dict.fromkeys(names))


def _all(a: Any, b: Any) -> Any:
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    return {"allOf": [a, b]}


def _unevaluated(s: dict[str, Any]) -> None:
    """`unevaluatedProperties`/`unevaluatedItems` where no in-place applicator can evaluate
    anything: the same as `additionalProperties` / `items`."""
    if any(k in s for k in _IN_PLACE):
        return
    if "unevaluatedProperties" in s:
        u = s.pop("unevaluatedProperties")
        if "additionalProperties" not in s:  # else every property is evaluated already
            s["additionalProperties"] = u
    if "unevaluatedItems" in s and "contains" not in s:
        u = s.pop("unevaluatedItems")
        if "items" not in s:
            s["items"] = u


def _property_names(s: dict[str, Any]) -> None:
    """`propertyNames` as `false` for each refused name in `properties` and as the one name
    pattern of the additional properties, where the names it allows are a pattern."""
    pn = s["propertyNames"]
    if pn is True or pn == {}:
        s.pop("propertyNames")
        return
    names = _name_pattern(pn)
    if names is None:
        return
    if s.get("patternProperties"):
        return  # its names and these would have to be intersected: left as written
    addl = s.get("additionalProperties", True)
    s.pop("propertyNames")
    props = {k: (v if names and re.search(names, k) else False)
             for k, v in s.get("properties", {}).items()}
    if props:
        s["properties"] = props
    if addl is not False:
        s["additionalProperties"] = False
        if names:
            s["patternProperties"] = {names: addl}


def _name_pattern(pn: Any) -> str | None:
    """The names `pn` allows as a JSON Schema `pattern` (a search, as `patternProperties`
    keys are), "" for none, or None where they are not a pattern."""
    if pn is False:
        return ""
    if not isinstance(pn, dict):
        return None
    if pn.get("type", "string") not in ("string", ["string"]):
        return None
    keys = set(pn) - _ANNOTATIONS - {"type"}
    if keys == {"pattern"} and isinstance(pn["pattern"], str):
        return pn["pattern"]
    if keys and keys <= {"minLength", "maxLength"}:
        lo, hi = pn.get("minLength", 0), pn.get("maxLength")
        return f"^[\\s\\S]{{{lo},{'' if hi is None else hi}}}$"
    if keys in ({"enum"}, {"const"}):
        vals = pn["enum"] if "enum" in pn else [pn["const"]]
        words = [v for v in vals if isinstance(v, str)]
        return "^(?:" + "|".join(_escape(w) for w in words) + ")$" if words else ""
    return None


# -- the complement ---------------------------------------------------------------------
def negate(schema: Any) -> Any:
    """A schema valid exactly where `schema` is not.

    Raises:
        Unsupported: `schema` uses a keyword outside the decidable forms.
    """
    if schema is True or schema == {}:
        return False
    if schema is False:
        return True
    if not isinstance(schema, dict):
        raise Unsupported("not")
    parts = []
    for k, v in schema.items():
        if k in _ANNOTATIONS or k in ("then", "else"):  # (with `if`, negated there)
            continue
        if k in ("$id", "$anchor", "$dynamicAnchor", "$defs", "definitions"):
            raise Unsupported("not")  # what is defined there may be referred to elsewhere
        parts.append(_negate_keyword(k, v, schema))
    parts = [p for p in parts if p is not False]
    if not parts:
        return False
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


def _other_types(kept: set[str]) -> list[str]:
    return [t for t in _TYPES if t not in kept]


def _negate_keyword(k: str, v: Any, schema: dict[str, Any]) -> Any:
    """The instances that fail keyword `k: v` (of `schema`)."""
    if k == "type":
        types = {v} if isinstance(v, str) else set(v)
        if "integer" in types and "number" not in types:
            raise Unsupported("not")  # a number that is not an integer: no grammar holds it
        others = _other_types(types)
        return {"type": others} if others else False
    if k in ("const", "enum"):
        values = [v] if k == "const" else list(v)
        return _not_values(values)
    if k == "required":
        if not v:
            return False
        return {"anyOf": [{"type": "object", "properties": {name: False}} for name in v]} \
            if len(v) > 1 else {"type": "object", "properties": {v[0]: False}}
    if k in _BOUNDS:
        return _BOUNDS[k](v)
    if k == "properties":
        alts = []
        for name, sub in v.items():
            neg = negate(sub)
            if neg is not False:
                alts.append({"type": "object", "required": [name], "properties": {name: neg}})
        return False if not alts else alts[0] if len(alts) == 1 else {"anyOf": alts}
    if k == "allOf":
        negs = [n for n in (negate(x) for x in v) if n is not False]
        return False if not negs else negs[0] if len(negs) == 1 else {"anyOf": negs}
    if k == "anyOf":
        return {"allOf": [negate(x) for x in v]}
    if k == "not":
        return rewrite(v)
    if k == "if":
        # if/then/else is (I and T) or (not I and E): its complement, (I and not T) or
        # (not I and not E)
        then, other = schema.get("then", True), schema.get("else", True)
        return {"anyOf": [_all(v, negate(then)), _all(negate(v), negate(other))]}
    raise Unsupported("not")


def _not_values(values: list[Any]) -> Any:
    """Every JSON value but `values` (scalars only)."""
    kinds: dict[str, list[Any]] = {t: [] for t in _TYPES}
    for x in values:
        if x is None:
            kinds["null"].append(x)
        elif isinstance(x, bool):
            kinds["boolean"].append(x)
        elif isinstance(x, (int, float)):
            kinds["number"].append(x)
        elif isinstance(x, str):
            kinds["string"].append(x)
        else:
            raise Unsupported("not")  # an object or array value: not a decidable form
    alts: list[Any] = []
    free = [t for t in ("object", "array") if not kinds[t]]
    if not kinds["null"]:
        free.insert(0, "null")
    if not kinds["boolean"]:
        free.append("boolean")
    else:
        rest = [b for b in (False, True) if b not in kinds["boolean"]]
        if rest:
            alts.append({"const": rest[0]})
    if not kinds["number"]:
        free.append("number")
    else:
        points = sorted(set(kinds["number"]))
        alts.append({"type": "number", "exclusiveMaximum": points[0]})
        for lo, hi in zip(points, points[1:]):
            alts.append({"type": "number", "exclusiveMinimum": lo, "exclusiveMaximum": hi})
        alts.append({"type": "number", "exclusiveMinimum": points[-1]})
    if not kinds["string"]:
        free.append("string")
    else:
        alts.append({"type": "string", "pattern": "^" + not_strings(kinds["string"]) + "$"})
    if free:
        alts.insert(0, {"type": free})
    return alts[0] if len(alts) == 1 else {"anyOf": alts}


def not_strings(words: list[str]) -> str:
    """A regular expression (unanchored) matching every string but `words`: their trie,
    each node's complement spelled out (a leaf: any non-empty continuation)."""
    trie: dict[str, Any] = {}
    for w in set(words):
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = True

    def comp(node: dict[str, Any]) -> str:
        kids = sorted(c for c in node if c)
        alts = [] if node.get("") else [""]  # the prefix itself, unless it is a word
        if kids:
            alts.append("[^" + "".join(_class_char(c) for c in kids) + "][\\s\\S]*")
            alts += [_char(c) + "(?:" + comp(node[c]) + ")" for c in kids]
        else:
            alts.append("[\\s\\S]+")
        return "|".join(alts)

    return "(?:" + comp(trie) + ")"


_META = set("\\.^$|?*+()[]{}/")


def _char(c: str) -> str:
    return "\\" + c if c in _META else c


def _escape(word: str) -> str:
    return "".join(map(_char, word))


def _class_char(c: str) -> str:
    return "\\" + c if c in "\\]^-[" else c


def _bound(kind: str, op: str, value: Any) -> Any:
    return {"type": kind, op: value}


def _length_below(kind: str, key: str, n: Any) -> Any:
    """Instances of `kind` whose count (`key` is its max keyword) is below n."""
    if not isinstance(n, int) or n <= 0:
        return False
    return {"type": kind, key: n - 1}


_BOUNDS = {
    "minimum": lambda v: _bound("number", "exclusiveMaximum", v),
    "maximum": lambda v: _bound("number", "exclusiveMinimum", v),
    "exclusiveMinimum": lambda v: _bound("number", "maximum", v),
    "exclusiveMaximum": lambda v: _bound("number", "minimum", v),
    "minLength": lambda v: _length_below("string", "maxLength", v),
    "maxLength": lambda v: {"type": "string", "minLength": v + 1},
    "minItems": lambda v: _length_below("array", "maxItems", v),
    "maxItems": lambda v: {"type": "array", "minItems": v + 1},
    "minProperties": lambda v: _length_below("object", "maxProperties", v),
    "maxProperties": lambda v: {"type": "object", "minProperties": v + 1},
}
