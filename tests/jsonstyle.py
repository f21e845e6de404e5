"""A JSON value written the way the server's grammars write it (tests only).

The server compiles JSON schemas compactly (`specdec.grammar.JSON_DEFAULTS`): no free
whitespace, ", " between items and ": " after keys, and an object's declared properties in
the schema's `properties` order, then any other keys. So serialising an instance means
walking it together with its schema: `$ref`s resolved, `allOf` merged, and for `anyOf` /
`oneOf` the first branch the value validates against, which decides its keys' order.

Strings are UTF-8 with control characters and DEL escaped (llguidance allows `\\u` escapes
only below U+0080); a number under `minimum`/`maximum` bounds is written without an exponent
(llguidance's range grammars have none: `5e-324` is written `0.000…5`).
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import jsonschema

from specdec.grammar import JSON_DEFAULTS

BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
ITEM_SEP = JSON_DEFAULTS["item_separator"]
KEY_SEP = JSON_DEFAULTS["key_separator"]


class Writer:
    """Serialises instances of one root schema."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self._defs = {k: root[k] for k in ("$defs", "definitions") if k in root}
        # No `$schema`: draft 7 where the schema uses its tuple form of `items`, else 2020-12.
        default = (jsonschema.Draft7Validator if _tuple_items(root)
                   else jsonschema.Draft202012Validator)
        self._cls = jsonschema.validators.validator_for(root, default=default)

    def dumps(self, value: Any) -> str:
        return self._write(value, self.root)

    def _resolve(self, schema: Any) -> Any:
        seen = 0
        while isinstance(schema, dict) and "$ref" in schema and seen < 64:
            ref = schema["$ref"]
            if not ref.startswith("#"):
                raise ValueError(f"only local $refs are supported here: {ref}")
            target: Any = self.root
            for part in filter(None, ref[1:].split("/")):
                target = target[part.replace("~1", "/").replace("~0", "~")]
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            schema = {**target, **rest} if rest else target
            seen += 1
        return schema

    def _valid(self, value: Any, schema: Any) -> bool:
        if isinstance(schema, dict):
            schema = {**self._defs, **schema}
        return self._cls(schema).is_valid(value)

    def _branch(self, value: Any, schema: Any) -> Any:
        """`schema` with `$ref`, `allOf` and the matching `anyOf`/`oneOf` branch folded in:
        what decides how `value` is written."""
        schema = self._resolve(schema)
        if not isinstance(schema, dict):
            return {}
        merged = {k: v for k, v in schema.items() if k not in ("allOf", "anyOf", "oneOf")}
        parts = [self._branch(value, s) for s in schema.get("allOf", [])]
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = schema[key]
                pick = next((s for s in options if self._valid(value, s)), options[0])
                parts.append(self._branch(value, pick))
        for p in parts:  # properties in order: the schema's own first, then each part's
            props = dict(merged.get("properties", {}))
            for name, sub in p.get("properties", {}).items():
                props.setdefault(name, sub)
            merged = {**p, **merged, "properties": props} if props else {**p, **merged}
        return merged

    def _write(self, value: Any, schema: Any) -> str:
        if isinstance(value, dict):
            s = self._branch(value, schema)
            props = s.get("properties", {})
            order = [k for k in props if k in value] + [k for k in value if k not in props]
            extra = s.get("additionalProperties", {})
            items = []
            for k in order:
                sub = props.get(k, extra if isinstance(extra, dict) else {})
                items.append(_scalar(k) + KEY_SEP + self._write(value[k],
                                                                                       sub))
            return "{" + ITEM_SEP.join(items) + "}"
        if isinstance(value, list):
            s = self._branch(value, schema)
            prefix = s.get("prefixItems")
            items = s.get("items", {})
            if isinstance(items, list):  # draft 4-7 tuple form
                prefix, items = items, s.get("additionalItems", {})
            prefix = prefix or []
            return "[" + ITEM_SEP.join(
                self._write(v, prefix[i] if i < len(prefix) else items)
                for i, v in enumerate(value)) + "]"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            s = self._branch(value, schema)
            if any(k in s for k in BOUNDS):
                return _positional(value)
        return _scalar(value)


def _positional(x: int | float) -> str:
    """A bounded number as the grammar writes it: no exponent, no negative zero."""
    if x == 0:
        return "0" if isinstance(x, int) else "0.0"
    return str(x) if isinstance(x, int) else format(Decimal(repr(x)), "f")


def _tuple_items(schema: Any) -> bool:
    if isinstance(schema, dict):
        return isinstance(schema.get("items"), list) or any(
            _tuple_items(v) for v in schema.values())
    return isinstance(schema, list) and any(_tuple_items(v) for v in schema)


def _scalar(value: Any) -> str:
    # Non-ASCII raw (UTF-8), control characters and DEL escaped.
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
