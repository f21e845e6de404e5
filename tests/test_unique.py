"""`uniqueItems`: the rule beside the grammar (specdec/unique.py) over the embedded model's
tokenizer, against `jsonschema` and against the oracle's own reading (oracle/unique.py).

- Where the rule follows an array it is marked for it, and what it does not follow stays
  as written (strict: a 400 naming `uniqueItems`); an item domain too small for `minItems`
  is refused.
- Walks through the grammar's masks, pushed towards repeating (short tokens, the earlier
  items' own spellings, closing tokens), never repeat an item and never reach an empty
  mask, and at every step the rule's decision on a sample of the grammar's allowed tokens
  (every one the rule refuses among them) is the oracle's.
- Items compare as JSON values: `1.0` after `1`, a string at its `maxLength` spelling an
  earlier item, the last value of an `enum` already used.
"""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from oracle import UniqueOracle
from specdec.errors import GrammarError
from specdec.grammar import GrammarCompiler
from specdec.request import Constraint
from specdec.unique import MARK, UniqueCursor, _allowed, mark

TAGS = {"type": "array", "uniqueItems": True, "items": {"type": "string", "maxLength": 3},
        "minItems": 2, "maxItems": 6}
SCHEMAS = {
    "enum at its size": {"type": "array", "uniqueItems": True, "minItems": 3,
                         "items": {"enum": ["red", "green", "blue"]}},
    "pattern of two": {"type": "array", "uniqueItems": True, "minItems": 2, "maxItems": 2,
                       "items": {"type": "string", "pattern": "^[ab]$"}},
    "short strings": TAGS,
    "integer range": {"type": "array", "uniqueItems": True, "minItems": 4,
                      "items": {"type": "integer", "minimum": 0, "maximum": 3}},
    "integers to twelve": {"type": "array", "uniqueItems": True, "minItems": 3,
                           "maxItems": 5,
                           "items": {"type": "integer", "minimum": 0, "maximum": 12}},
    "booleans and null": {"type": "array", "uniqueItems": True, "minItems": 3,
                          "items": {"type": ["boolean", "null"]}},
    "numbers": {"type": "array", "uniqueItems": True, "minItems": 3, "maxItems": 4,
                "items": {"type": "number", "minimum": 0, "maximum": 2}},
    "pydantic set field": {
        "type": "object", "additionalProperties": False, "required": ["tags", "pick"],
        "$defs": {"Tags": TAGS},
        "properties": {"tags": {"$ref": "#/$defs/Tags"},
                       "pick": {"anyOf": [{"type": "array", "uniqueItems": True,
                                           "maxItems": 3, "items": {"enum": ["x", "y"]}},
                                          {"type": "null"}]}}},
    "list of objects with sets": {
        "type": "array", "minItems": 2, "maxItems": 2,
        "items": {"type": "object", "additionalProperties": False, "required": ["s"],
                  "properties": {"s": {"type": "array", "uniqueItems": True, "minItems": 2,
                                       "maxItems": 2, "items": {"enum": [1, 2, 3]}}}}},
}


@pytest.fixture(scope="module")
def compiler(embedded) -> GrammarCompiler:
    return GrammarCompiler.for_hf_tokenizer(embedded.tokenizer, n_vocab=embedded.vocab_size,
                                            eos_token_ids=list(embedded.eos_token_ids))


def marks(schema) -> int:
    return json.dumps(mark(schema)).count(MARK)


def test_the_rule_marks_what_it_follows():
    assert marks(SCHEMAS["pydantic set field"]) == 2  # through $ref, and an Optional
    assert marks(SCHEMAS["list of objects with sets"]) == 1
    # uniqueItems false is no constraint
    assert "uniqueItems" not in json.dumps(mark({"type": "array", "uniqueItems": False}))
    for left in (
        {"type": "array", "uniqueItems": True},  # items of any kind
        {"type": "array", "uniqueItems": True, "items": {"type": "object"}},
        {"type": "array", "uniqueItems": True, "prefixItems": [{"type": "string"}]},
        # two branches an array could take
        {"anyOf": [{"type": "array", "uniqueItems": True, "items": {"type": "string"}},
                   {"type": "array", "maxItems": 1}]},
        # under keywords the rule does not follow
        {"not": {"type": "array", "uniqueItems": True, "items": {"type": "string"}}},
        {"type": "array", "contains": {"type": "array", "uniqueItems": True,
                                       "items": {"type": "string"}}},
    ):
        assert marks(left) == 0, left
        assert "uniqueItems" in json.dumps(mark(left))


def test_a_node_also_reached_where_the_rule_does_not_follow_stays_as_written():
    defs = {"S": {"type": "array", "uniqueItems": True, "items": {"type": "string"}}}
    schema = {"$defs": defs, "type": "object",
              "properties": {"a": {"$ref": "#/$defs/S"},
                             "b": {"anyOf": [{"$ref": "#/$defs/S"}, {"type": "array"}]}}}
    assert marks(schema) == 0


def test_what_the_rule_cannot_follow_is_refused_naming_the_keyword(compiler):
    for schema in ({"type": "array", "uniqueItems": True},
                   {"type": "array", "uniqueItems": True, "items": {"type": "object"}}):
        with pytest.raises(GrammarError, match="uniqueItems"):
            compiler.compile(Constraint.json_schema(schema))
        g = compiler.compile(Constraint.json_schema(schema, lenient=True))
        assert any("uniqueItems" in w for w in g.warnings) and g.unique is None


@pytest.mark.parametrize("items,size", [({"enum": ["a", "b"]}, 2), ({"const": 1}, 1),
                                        ({"type": "boolean"}, 2), ({"type": "null"}, 1),
                                        ({"enum": [1, 1.0, True]}, 2),
                                        ({"type": "integer", "minimum": 1, "maximum": 3}, 3)])
def test_a_domain_smaller_than_min_items_is_refused(compiler, items, size):
    schema = {"type": "array", "uniqueItems": True, "items": items, "minItems": size + 1}
    with pytest.raises(GrammarError, match=f"only {size} distinct values"):
        compiler.compile(Constraint.json_schema(schema))
    schema["minItems"] = size
    assert compiler.compile(Constraint.json_schema(schema)).unique is not None


def _pushed(rng: random.Random, ids: np.ndarray, vocab, text: bytes) -> int:
    """A token among `ids`, pushed towards repeating: often a one- or two-byte token,
    often one that spells a piece of the answer so far, often one that closes something."""
    pieces = [vocab.bytes[int(t)] for t in ids]
    r = rng.random()
    if r < 0.3:
        pick = [t for t, b in zip(ids, pieces) if b and b in text]
    elif r < 0.55:
        pick = [t for t, b in zip(ids, pieces) if 0 < len(b) <= 2]
    elif r < 0.8:
        pick = [t for t, b in zip(ids, pieces) if any(c in b for c in b'",]}')]
    else:
        pick = []
    return int(rng.choice(pick or list(ids)))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_walks_never_repeat_never_dead_end_and_agree_with_the_oracle(compiler, name):
    schema = SCHEMAS[name]
    g = compiler.compile(Constraint.json_schema(schema))
    assert g.unique is not None
    vocab = compiler.vocab()
    eos = {compiler.tokenizer.eos_token}
    n = vocab.n
    finished = refused_seen = 0
    for seed in range(6):
        rng = random.Random(seed)
        state = g.state()
        assert isinstance(state, UniqueCursor)
        oracle = UniqueOracle(schema, lambda t: vocab.bytes[t], n, eos)
        text = b""
        for _ in range(120):
            grammar_only = _allowed(state.inner, n)
            ruled = _allowed(state, n)
            ids = np.flatnonzero(ruled)
            assert ids.size, f"{name} seed {seed}: the rule left no token after {text!r}"
            assert not (ruled & ~grammar_only).any()
            refused = np.flatnonzero(grammar_only & ~ruled).tolist()
            refused_seen += len(refused)
            allowed = np.flatnonzero(grammar_only).tolist()
            sample = rng.sample(refused, min(8, len(refused))) + \
                rng.sample(allowed, min(8, len(allowed)))
            for t in sample:
                assert oracle.refuses(state.inner, t) == (not ruled[t]), \
                    (name, seed, text, vocab.bytes[t], bool(ruled[t]))
            t = _pushed(rng, ids, vocab, text)
            if t in eos:
                break
            assert state.consume_token(t), state.get_error()
            oracle.took(t)
            text += vocab.bytes[t]
            if state.is_stopped():
                break
        if state.is_accepting():
            finished += 1
            jsonschema.Draft202012Validator(schema).validate(json.loads(text))
    assert finished >= 3, f"{name}: only {finished} of 6 walks finished"
    assert refused_seen, f"{name}: the walks never met the rule"


def _feed(compiler, schema, text: str):
    g = compiler.compile(Constraint.json_schema(schema))
    state = g.state()
    for b in text.encode():
        ids = compiler.vocab().ids[bytes([b])]
        assert state.consume_token(ids[0]), (text, state.get_error())
    return state, _allowed(state, compiler.vocab().n)


def _ok(compiler, allowed, piece: str) -> bool:
    return any(allowed[t] for t in compiler.vocab().ids[piece.encode()])


def test_items_compare_as_json_values(compiler):
    numbers = {"type": "array", "uniqueItems": True, "items": {"type": "number"}}
    _, a = _feed(compiler, numbers, "[1, 1.0")
    assert not _ok(compiler, a, "]") and not _ok(compiler, a, ",")  # 1.0 == 1
    assert _ok(compiler, a, "5")  # 1.05 differs
    _, a = _feed(compiler, numbers, "[10, 1")
    assert _ok(compiler, a, "]")  # 1 != 10


def test_a_string_that_could_only_repeat_is_stopped_before_it_gets_there(compiler):
    short = {"type": "array", "uniqueItems": True,
             "items": {"type": "string", "maxLength": 2}}
    _, a = _feed(compiler, short, '["ab", "a')
    assert not _ok(compiler, a, "b")  # "ab" at its maxLength could only close as a repeat
    assert _ok(compiler, a, "c") and _ok(compiler, a, '"')
    ints = {"type": "array", "uniqueItems": True,
            "items": {"type": "integer", "minimum": 0, "maximum": 12}}
    _, a = _feed(compiler, ints, "[1, ")
    assert _ok(compiler, a, "1")  # 10, 11, 12 remain
    _, a = _feed(compiler, ints, "[1, 10, 11, 12, ")
    assert not _ok(compiler, a, "1")
    colors = SCHEMAS["enum at its size"]
    state, a = _feed(compiler, colors, '["red", "blue", ')
    assert _ok(compiler, a, '"') or _ok(compiler, a, '"g')
    assert not state.deep_copy().consume_token(compiler.vocab().ids[b'"red'][0]) \
        if b'"red' in compiler.vocab().ids else True


def test_each_array_knows_its_own_item_domain(compiler):
    # Two sets in one object, items of different kinds: the second array's domain is its
    # own (a cache keyed by a short-lived tuple's id once gave it the first one's, and the
    # rule let the enum repeat "S", a dead end the model then met).
    schema = {"type": "object", "required": ["tags", "sizes"], "additionalProperties": False,
              "properties": {"tags": {"type": "array", "uniqueItems": True,
                                      "items": {"type": "string", "maxLength": 12}},
                             "sizes": {"type": "array", "uniqueItems": True,
                                       "items": {"enum": ["S", "M", "L"]}}}}
    for _ in range(3):  # (new arrays, new tuples: ids get reused)
        _, a = _feed(compiler, schema, '{"tags": ["x", "y"], "sizes": ["S", "')
        assert not _ok(compiler, a, "S") and _ok(compiler, a, "M")
