"""The keyword rewrites (specdec/schema_rewrite.py) against `jsonschema`: a rewritten schema
accepts exactly the instances the original accepts, and `negate(S)` exactly those `S`
refuses, on instances generated from the schemas (hypothesis-jsonschema) and on arbitrary
JSON values. The compiled grammars' side (that llguidance holds what the rewrite writes) is
the JSON-Schema-Test-Suite ratchet's (tests/test_jsonschema_suite.py)."""

from __future__ import annotations

import json
import re
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from specdec.grammar import Constraint, to_grammar
from specdec.errors import GrammarError
from specdec.schema_rewrite import Unsupported, negate, not_strings, rewrite

NAMES = ["a", "b", "c", "ab", "x-1"]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 3),
                    st.sampled_from([0.5, 1.0, -2.5]), st.sampled_from(["", "a", "ab", "b"]))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.sampled_from(NAMES), inner, max_size=3)), max_leaves=8)


def valid(schema, x) -> bool:
    return Draft202012Validator(schema).is_valid(x)


def witnesses(*schemas) -> st.SearchStrategy:
    """Instances at the schemas' edges: their constants, each bound and its neighbours,
    strings, arrays and objects of each length a bound names, objects holding the names
    they name (with those values)."""
    consts: list = [None, True, False, "", "zz"]
    lengths: set[int] = {0, 1, 2}
    names = set(NAMES)

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("const",):
                    consts.append(v)
                elif k == "enum" and isinstance(v, list):
                    consts.extend(v)
                elif k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                    consts.extend([v - 1, v - 0.5, v, v + 0.5, v + 1])
                elif k.startswith(("min", "max")) and isinstance(v, int):
                    lengths.update({max(v - 1, 0), v, v + 1})
                elif k in ("properties", "dependentRequired", "dependentSchemas"):
                    names.update(v)
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    for sch in schemas:
        walk(sch)
    scalars = st.sampled_from([c for c in consts if not isinstance(c, (dict, list))])
    strings = st.builds(lambda n, c: (c * n)[:n], st.sampled_from(sorted(lengths)),
                        st.sampled_from(["a", "ab", "é"]))
    leaf = st.one_of(scalars, strings)
    return st.one_of(
        leaf,
        st.lists(leaf, max_size=max(lengths) + 1),
        st.dictionaries(st.sampled_from(sorted(names)), st.one_of(leaf, st.lists(leaf, max_size=2)),
                        max_size=max(lengths) + 1))


def generated(schema) -> st.SearchStrategy:
    """hypothesis-jsonschema's instances of `schema`, where it can generate them."""
    from hypothesis_jsonschema import from_schema

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            strategy = from_schema(schema)
            strategy.validate()
            return strategy
        except Exception:  # a schema it cannot generate from: the other sources remain
            return st.nothing()


# -- schemas of the decidable forms -------------------------------------------------------
TYPES = ["null", "boolean", "object", "array", "number", "string"]
LEAVES = st.one_of(
    st.builds(lambda t: {"type": t}, st.sampled_from(TYPES + ["integer"])),
    st.builds(lambda ts: {"type": ts}, st.lists(st.sampled_from(TYPES), min_size=1,
                                                max_size=3, unique=True)),
    st.builds(lambda v: {"const": v}, SCALARS),
    st.builds(lambda vs: {"enum": vs}, st.lists(SCALARS, min_size=1, max_size=4)),
    st.builds(lambda ns: {"required": ns}, st.lists(st.sampled_from(NAMES), min_size=1,
                                                    max_size=2, unique=True)),
    st.builds(lambda k, v: {k: v}, st.sampled_from(["minimum", "maximum", "exclusiveMinimum",
                                                    "exclusiveMaximum"]),
              st.sampled_from([-1, 0, 1, 2.5])),
    st.builds(lambda k, v: {k: v}, st.sampled_from(["minLength", "maxLength", "minItems",
                                                    "maxItems", "minProperties",
                                                    "maxProperties"]), st.integers(0, 2)),
    st.just(True), st.just(False), st.just({}),
)
DECIDABLE = st.recursive(LEAVES, lambda inner: st.one_of(
    st.builds(lambda n, s: {"properties": {n: s}}, st.sampled_from(NAMES), inner),
    st.builds(lambda xs: {"allOf": xs}, st.lists(inner, min_size=1, max_size=2)),
    st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=1, max_size=2)),
    st.builds(lambda s: {"not": s}, inner),
    st.builds(lambda a, b: {**a, **b} if isinstance(a, dict) and isinstance(b, dict) else a,
              inner, inner),
    st.builds(lambda i, t, e: {"if": i, "then": t, "else": e}, inner, inner, inner),
), max_leaves=5)

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


@SETTINGS
@given(st.data(), DECIDABLE)
def test_negate_is_the_complement_on_the_decidable_forms(data, schema):
    try:
        neg = negate(schema)
    except Unsupported:
        assert "integer" in json.dumps(schema)  # the one form left out: a non-integer number
        return
    x = data.draw(st.one_of(JSON, witnesses(schema)))
    assert valid(neg, x) != valid(schema, x), (schema, neg, x)


@SETTINGS
@given(st.data(), DECIDABLE)
def test_not_and_if_then_else_rewrite_to_the_same_instances(data, schema):
    for s in ({"not": schema}, {"if": schema, "then": {"required": ["a"]},
                                "else": {"type": "string", "maxLength": 1}}):
        r = rewrite(s)
        x = data.draw(st.one_of(JSON, witnesses(s)))
        assert valid(r, x) == valid(s, x), (s, r, x)


KEYWORD_SCHEMAS = {
    "dependentRequired": {"type": "object", "properties": {n: {} for n in NAMES},
                          "dependentRequired": {"a": ["b", "c"], "ab": ["a"]}},
    "dependentSchemas": {"type": "object", "dependentSchemas": {
        "a": {"required": ["b"], "properties": {"b": {"type": "integer", "minimum": 1}}},
        "c": False}},
    "propertyNames pattern": {"type": "object", "propertyNames": {"pattern": "^[a-b]+$"},
                              "properties": {"a": {"type": "string"}, "c": {}}},
    "propertyNames length": {"type": "object", "propertyNames": {"maxLength": 1},
                             "additionalProperties": {"type": "integer"}},
    "propertyNames enum": {"propertyNames": {"enum": ["a", "x-1"]}},
    "propertyNames false": {"propertyNames": False},
    "propertyNames with patternProperties": {
        "propertyNames": {"maxLength": 1}, "additionalProperties": False,
        "patternProperties": {"^x": {"type": "integer"}}},
    "unevaluatedProperties": {"type": "object", "properties": {"a": {}},
                              "patternProperties": {"^x": {"type": "integer"}},
                              "unevaluatedProperties": {"type": "string"}},
    "unevaluatedItems": {"type": "array", "prefixItems": [{"type": "integer"}],
                         "unevaluatedItems": {"type": "string"}},
    "if/then/else nested": {"type": "object", "properties": {"a": {
        "if": {"type": "string"}, "then": {"maxLength": 2},
        "else": {"type": "integer", "minimum": 2}}}},
    "not enum": {"not": {"enum": ["a", "ab", 1, None, True]}},
}


# each keyword's instances: arbitrary, at its edges, and generated from its rewrite
SOURCES = {name: st.one_of(JSON, witnesses(s), generated(rewrite(s)))
           for name, s in KEYWORD_SCHEMAS.items()}


@pytest.mark.parametrize("name", sorted(KEYWORD_SCHEMAS))
@SETTINGS
@given(data=st.data())
def test_each_rewritten_keyword_accepts_what_the_original_accepts(name, data):
    s = KEYWORD_SCHEMAS[name]
    r = rewrite(s)
    held = {"dependentRequired", "dependentSchemas", "if", "not", "propertyNames",
            "unevaluatedProperties", "unevaluatedItems"}
    left = held & set(re.findall(r'"([A-Za-z$]+)":', json.dumps(r)))
    # all rewritten, but names over patternProperties (two patterns to intersect)
    assert left == ({"propertyNames"} if "patternProperties" in name else set()), r
    x = data.draw(SOURCES[name])
    assert valid(r, x) == valid(s, x), (r, x)


@pytest.mark.parametrize("words", [["x"], ["", "x", "xy"], ["a]b", "^", "-", "\\", "é€"],
                                   ["same", "same"]])
def test_not_strings_matches_every_string_but_the_words(words):
    rx = re.compile(not_strings(words))
    probes = {w + t for w in words + ["", "q"] for t in ("", "a", "x", "]", "\n")}
    for p in probes | set(words):
        assert bool(rx.fullmatch(p)) == (p not in words), p


def test_a_keyword_outside_the_decidable_forms_stays_and_strict_refuses_it(compiler):
    # `not` of a pattern and an `if` on `items` cannot be complemented exactly: the keyword
    # stays as written, so a strict schema is a 400 naming it and a lenient one warns.
    for s, word in (({"not": {"pattern": "^a"}}, "not"),
                    ({"if": {"items": {"type": "string"}}, "then": {"minItems": 1}}, "if")):
        assert word in rewrite(s)
        with pytest.raises(GrammarError, match=word):
            compiler.compile(Constraint.json_schema(s))
        got = compiler.compile(Constraint.json_schema(s, lenient=True))
        assert any(word in w for w in got.warnings)


def test_the_users_schema_is_not_changed():
    s = {"type": "object", "dependentRequired": {"a": ["b"]}, "not": {"required": ["c"]}}
    before = json.dumps(s, sort_keys=True)
    to_grammar(Constraint.json_schema(s))
    assert json.dumps(s, sort_keys=True) == before
