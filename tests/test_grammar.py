"""Constraint → llguidance grammar, on the byte-level tokenizer: table-driven pass/fail."""

from __future__ import annotations

import gc
import json

import pytest
from llguidance import LLTokenizer

from specdec.grammar import Constraint, GrammarCompiler, GrammarError, heap_in_use
from tests.adversarial import enum_schema, wide_object


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(LLTokenizer("byte"))


def accepts(compiler: GrammarCompiler, c: Constraint, text: str) -> bool:
    """True when the full text is a complete sentence of the grammar."""
    m = compiler.compile(c).matcher()
    toks = list(text.encode())
    return m.try_consume_tokens(toks) == len(toks) and m.is_accepting()


PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}

PYDANTIC_REF = {  # shape of Pydantic's model_json_schema() output
    "$defs": {"Item": {"properties": {"sku": {"title": "Sku", "type": "string"},
                                      "qty": {"maximum": 9, "minimum": 1, "title": "Qty",
                                              "type": "integer"}},
                       "required": ["sku", "qty"], "title": "Item", "type": "object"}},
    "properties": {"items": {"items": {"$ref": "#/$defs/Item"}, "maxItems": 2, "minItems": 1,
                             "title": "Items", "type": "array"},
                   "kind": {"enum": ["a", "b"], "title": "Kind", "type": "string"},
                   "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
                   "mode": {"const": "fast", "type": "string"}},
    "required": ["items", "kind", "mode"], "title": "Order", "type": "object",
}

CASES = [
    # (constraint, text, expected)
    (Constraint.json_schema(PERSON), '{"name": "Ann", "age": 3}', True),
    (Constraint.json_schema(json.dumps(PERSON)), '{"name": "Ann", "age": 3}', True),
    (Constraint.json_schema(PERSON), '{"name": "Ann", "age": -3}', False),
    (Constraint.json_schema(PERSON), '{"name": "Ann"}', False),
    (Constraint.json_schema(PERSON), '{"name": "Ann", "age": 3, "x": 1}', False),
    (Constraint.json_schema(PYDANTIC_REF),
     '{"items": [{"sku": "x", "qty": 2}], "kind": "b", "mode": "fast"}', True),
    (Constraint.json_schema(PYDANTIC_REF),
     '{"items": [{"sku": "x", "qty": 2}], "kind": "b", "note": null, "mode": "fast"}', True),
    (Constraint.json_schema(PYDANTIC_REF),
     '{"items": [], "kind": "b", "mode": "fast"}', False),  # minItems
    (Constraint.json_schema(PYDANTIC_REF),
     '{"items": [{"sku": "x", "qty": 10}], "kind": "b", "mode": "fast"}', False),  # maximum
    (Constraint.json_schema(PYDANTIC_REF),
     '{"items": [{"sku": "x", "qty": 1}], "kind": "c", "mode": "fast"}', False),  # enum
    (Constraint.json_object(), '{"a": [1, {"b": null}]}', True),
    (Constraint.json_object(), '[1, 2]', False),
    (Constraint.regex(r"\d{3}-[a-z]+"), "123-abc", True),
    (Constraint.regex(r"\d{3}-[a-z]+"), "12-abc", False),
    (Constraint.grammar('start: "yes" | "no"'), "no", True),
    (Constraint.grammar('root ::= "yes" | "no"'), "yes", True),  # GBNF
    (Constraint.grammar('root ::= "yes" | "no"'), "maybe", False),
    (Constraint.choice(["red", "gr\u00fcn", 'say "hi"']), "gr\u00fcn", True),
    (Constraint.choice(["red", "gr\u00fcn", 'say "hi"']), 'say "hi"', True),
    (Constraint.choice(["red", "green"]), "blue", False),
]


@pytest.mark.parametrize("constraint,text,expected", CASES)
def test_constraint_accepts_exactly_its_language(compiler, constraint, text, expected):
    assert accepts(compiler, constraint, text) is expected


def test_json_whitespace_is_bounded_by_default(compiler):
    # Free whitespace would let a model spin on spaces until max_tokens.
    c = Constraint.json_schema(PERSON)
    assert not accepts(compiler, c, '{ "name": "Ann", "age": 3}')
    assert not accepts(compiler, c, '{"name": "Ann",\n"age": 3}')


@pytest.mark.parametrize("constraint,needle", [
    (Constraint.json_schema('{"type": "object"'), "not valid JSON"),
    (Constraint.json_schema("[1, 2]"), "must be a JSON object"),
    (Constraint.json_schema({"type": "objec"}), "objec"),
    (Constraint.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
    (Constraint.json_schema({"type": "string", "format": "weird"}), "weird"),
    (Constraint.json_schema(False), "matches nothing"),
    (Constraint("json_object", {"type": "array"}), "json_object takes no schema"),
    (Constraint.regex("a(b"), "unclosed group"),
    (Constraint.regex(""), "non-empty"),
    (Constraint.grammar('start: "yes" | x'), "unknown name"),
    (Constraint.grammar("   "), "non-empty"),
    (Constraint.choice([]), "non-empty list"),
    (Constraint.choice(["a", ""]), "non-empty string"),
    (Constraint.choice(["a", 3]), "non-empty string"),  # type: ignore[list-item]
    (Constraint("xml", "<a/>"), "unknown constraint kind"),  # type: ignore[arg-type]
])
def test_bad_constraint_raises_grammar_error_naming_the_problem(compiler, constraint, needle):
    with pytest.raises(GrammarError) as info:
        compiler.compile(constraint)
    assert needle in str(info.value)


def test_lenient_schema_compiles_and_reports_what_it_skipped(compiler):
    c = Constraint.json_schema({"type": "array", "uniqueItems": True}, lenient=True)
    g = compiler.compile(c)
    assert any("uniqueItems" in w for w in g.warnings)


def test_compile_cache_is_keyed_by_grammar_text(compiler):
    compiler.clear()
    h0, m0 = compiler.hits, compiler.misses
    a = compiler.compile(Constraint.json_schema(PERSON))
    b = compiler.compile(Constraint.json_schema(json.dumps(PERSON)))  # same canonical text
    assert a is b and compiler.hits == h0 + 1 and compiler.misses == m0 + 1
    assert compiler.cached == 1 and compiler.cached_bytes == a.nbytes > 0


def test_compile_cache_is_bounded_in_bytes_least_recently_used_first():
    probe = GrammarCompiler(LLTokenizer("byte"))
    sizes = [probe.compile(Constraint.regex(f"x{i}")).nbytes for i in range(8)]
    # Room for about three: what is kept never exceeds the bound, and is the newest.
    compiler = GrammarCompiler(LLTokenizer("byte"), cache_bytes=3 * max(sizes))
    kept = []
    for i in range(8):
        g = compiler.compile(Constraint.regex(f"x{i}"))
        kept.append(g.text)
        if i == 2:  # a reuse makes x0 the most recently used
            assert compiler.compile(Constraint.regex("x0")).text == kept[0]
            kept.append(kept.pop(0))
        held = list(compiler._cache.values())
        assert compiler.cached_bytes == sum(h.nbytes for h in held) <= compiler.cache_bytes
        assert [h.text for h in held] == kept[-len(held):]
    assert compiler.hits == 1 and compiler.evictions == compiler.misses - compiler.cached >= 4


def test_a_grammar_larger_than_the_cache_is_used_not_kept():
    compiler = GrammarCompiler(LLTokenizer("byte"), cache_bytes=1 << 20)
    small = compiler.compile(Constraint.regex("x"))
    big = compiler.compile(Constraint.json_schema(enum_schema(5000)))
    assert big.nbytes > 1 << 20 and big.matcher().consume_token(ord("{"))
    assert list(compiler._cache.values()) == [small] and compiler.evictions == 0
    assert GrammarCompiler(LLTokenizer("byte"), cache_bytes=0).compile(
        Constraint.regex("x")).matcher().consume_token(ord("x"))


@pytest.mark.skipif(heap_in_use() is None, reason="the C heap is not measurable here")
def test_cached_grammar_sizes_sum_to_what_clearing_the_cache_frees():
    """The sizes are measured: a schema's grammar grows with it, a counted regex's lexer
    states (built by the first mask) are counted, and emptying the cache hands back what
    the sizes say (the heap read before and after, in a fresh process: no garbage of other
    tests collected meanwhile, this thread alone allocating)."""
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-c", "from tests.test_grammar import "
                           "_cached_sizes_and_what_clearing_frees as f; f()"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _cached_sizes_and_what_clearing_frees() -> None:
    compiler = GrammarCompiler(LLTokenizer("byte"), cache_bytes=1 << 30)
    small = compiler.compile(Constraint.json_schema(enum_schema(50))).nbytes
    large = compiler.compile(Constraint.json_schema(enum_schema(5000))).nbytes
    assert large > 10 * small
    assert compiler.compile(Constraint.regex("a{3000}")).nbytes > 500_000
    compiler.compile(Constraint.json_schema(wide_object(300)))
    held = compiler.cached_bytes
    gc.collect()
    before = heap_in_use()
    compiler.clear()
    gc.collect()
    freed = before - heap_in_use()
    assert 0.9 * freed <= held <= 1.1 * freed, (held, freed)


def test_matchers_from_one_grammar_are_independent(compiler):
    g = compiler.compile(Constraint.choice(["ab", "cd"]))
    m1, m2 = g.matcher(), g.matcher()
    assert m1.consume_token(ord("a"))
    assert m2.validate_tokens([ord("c")]) == 1
    assert m1.validate_tokens([ord("c")]) == 0


MARKUP_NOTE = {  # tokenizer kind -> text a JSON string holds: its markers, `_`, non-ASCII
    "seed-oss": "<seed:think> a_b </seed:think>",
    "gemma4": "<|channel>thought x_y <channel|> é",
    "harmony": "<|channel|>analysis<|message|> and <|end|>_",
    "chatml": "<think>\n_</think>",
}


@pytest.mark.parametrize("kind", list(MARKUP_NOTE))
def test_forced_text_is_tokenized_as_text_even_where_it_spells_a_special_token(tmp_path, kind):
    """Where the grammar forces bytes (a const, a key) llguidance tokenizes them and allows
    that token: bytes spelling an added token (`<think>`), or a byte piece the tokenizer
    registers as added (`<0x5F>` for `_`), must come out as text tokens the matcher consumes.
    Every path the masks allow, with random picks, decodes to the document."""
    import random

    import numpy as np
    import llguidance.numpy as llnp
    from transformers import AutoTokenizer

    from tests.families import TOKENIZERS, make_tokenizer

    make_tokenizer(TOKENIZERS[kind], tmp_path, think=kind == "chatml")
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    eos = hf.convert_tokens_to_ids(TOKENIZERS[kind].eos)
    gc = GrammarCompiler.for_hf_tokenizer(hf, n_vocab=len(hf) + 5, eos_token_ids=[eos])
    note = MARKUP_NOTE[kind]
    schema = {"type": "object", "properties": {"a_key": {"const": note},
                                               "pick": {"enum": ["x_1", note]}},
              "required": ["a_key", "pick"], "additionalProperties": False}
    grammar = gc.compile(Constraint.json_schema(schema))
    n = gc.tokenizer.vocab_size
    for seed in range(6):
        rng, m, out = random.Random(seed), grammar.matcher(), []
        while not m.is_stopped():
            mask = llnp.allocate_token_bitmask(1, n)
            llnp.fill_next_token_bitmask(m, mask, 0)
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:n])
            assert len(allowed) and not m.is_error(), (seed, out, m.get_error())
            pick = int(rng.choice(allowed))
            assert m.consume_token(pick), (seed, out, pick, m.get_error())
            out.append(pick)
            assert len(out) < 400
        doc = json.loads(hf.decode([t for t in out if t != eos], skip_special_tokens=False))
        assert doc["a_key"] == note and doc["pick"] in ("x_1", note), doc
