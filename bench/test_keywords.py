"""What the JSON Schema keyword work costs (specdec/schema_rewrite.py, specdec/unique.py).

Schemas without those keywords (the real-world corpus's, tests/corpus, each that compiles
strictly and names none of them) must cost what they cost before: their schema-to-grammar
conversion through the rewrite and the uniqueness mark against llguidance's conversion
alone (the same grammar text, checked), and their mask fills through the state a request
decodes with against the bare matcher, arms interleaved, one walk of tokens replayed
through both. Schemas with `uniqueItems` pay for the rule beside the grammar: their fills
with the rule against the same grammar without it, on the same walks.

The walks are the grammar's own (seeded picks among the allowed tokens, leaning to short
and closing tokens so they finish): no model runs here.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import numpy as np
from llguidance import LLMatcher

from bench import results
from specdec.grammar import JSON_DEFAULTS, GrammarCompiler, _json_grammar, schema_dict
from specdec.request import Constraint
from specdec.unique import _allowed

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "corpus"
KEYWORDS = re.compile(r'"(?:dependentRequired|dependentSchemas|if|then|else|not|propertyNames'
                      r'|unevaluatedProperties|unevaluatedItems|uniqueItems|contains)"')
WALK = 96  # tokens per walk at most
SETS = {
    "tags": {"type": "object", "additionalProperties": False, "required": ["tags"],
             "properties": {"tags": {"type": "array", "uniqueItems": True, "minItems": 3,
                                     "maxItems": 6,
                                     "items": {"type": "string", "maxLength": 12}}}},
    "enum": {"type": "array", "uniqueItems": True, "minItems": 3,
             "items": {"enum": ["red", "green", "blue", "cyan"]}},
    "integers": {"type": "array", "uniqueItems": True, "minItems": 4, "maxItems": 6,
                 "items": {"type": "integer", "minimum": 0, "maximum": 99}},
}


def _walk(state, vocab, seed: int) -> list[int]:
    """A seeded walk through `state`'s masks (advancing it)."""
    rng = random.Random(seed)
    out: list[int] = []
    for _ in range(WALK):
        ids = np.flatnonzero(_allowed(state, vocab.n))
        if ids.size == 0 or state.is_stopped():
            break
        short = [int(t) for t in ids if 0 < len(vocab.bytes[int(t)]) <= 3]
        closing = [int(t) for t in ids if any(c in vocab.bytes[int(t)] for c in b'"]},')]
        pool = closing if closing and rng.random() < 0.4 else short or ids.tolist()
        t = int(rng.choice(pool))
        if not vocab.bytes[t] or not state.consume_token(t):
            break
        out.append(t)
    return out


def _fills(make_a, make_b, tokens: list[int], n_vocab: int) -> tuple[list[float], list[float]]:
    """Each token's mask fill by two states advanced in lockstep (which fills first
    alternates), as (a's times, b's times)."""
    row = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
    warm = make_a()  # (the lexer states a walk needs, built once, before either is timed)
    for t in tokens:
        warm.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        warm.consume_token(t)
    states, out = (make_a(), make_b()), ([], [])
    for i, t in enumerate(tokens):
        for j in ((0, 1) if i % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            states[j].unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            out[j].append(time.perf_counter() - t0)
        for m in states:
            m.consume_token(t)
    return out


def _ratio(a: list[float], b: list[float], q: float) -> float:
    return float(np.percentile(a, q) / np.percentile(b, q))


def test_keyword_costs(benchmark, engine):
    compiler: GrammarCompiler = engine.compiler
    vocab = compiler.vocab()
    plain_schemas = []
    for path in sorted(CORPUS.glob("*.json")):
        text = path.read_text(encoding="utf-8")
        if KEYWORDS.search(text):
            continue
        try:
            compiler.compile(Constraint.json_schema(json.loads(text)))
        except Exception:  # refused strictly: not a schema the row is about
            continue
        plain_schemas.append(json.dumps(json.loads(text)))
    plain_schemas = results.prompts(plain_schemas, smoke=3)
    opts = tuple(JSON_DEFAULTS.items())
    reps = results.size(20, 50, 2)

    # schema -> grammar text: through the rewrite and the mark vs llguidance alone
    ours: list[float] = []
    alone: list[float] = []
    for _ in range(reps):
        for text in plain_schemas:
            t0 = time.perf_counter()
            a = _json_grammar.__wrapped__("json_schema", text, False, opts)
            t1 = time.perf_counter()
            b = LLMatcher.grammar_from_json_schema(schema_dict(text), defaults=dict(opts))
            t2 = time.perf_counter()
            assert a == b, "a schema without the keywords must reach the compiler as it came"
            ours.append(t1 - t0)
            alone.append(t2 - t1)
    results.add("keywords_to_grammar_over_llguidance_p50", _ratio(ours, alone, 50), "x",
                f"schema -> grammar text, {len(plain_schemas)} corpus schemas without the "
                f"keywords, rewrite + mark + llguidance over llguidance alone, interleaved")

    # the whole compile a request that misses the cache waits for: text, grammar, first mask
    ours, alone = [], []
    for _ in range(results.size(3, 5, 1)):
        for text in plain_schemas:
            c = Constraint.json_schema(json.loads(text))
            t0 = time.perf_counter()
            compiler._compile(c, _json_grammar.__wrapped__("json_schema", text, False, opts))
            t1 = time.perf_counter()
            compiler._compile(c, LLMatcher.grammar_from_json_schema(schema_dict(text),
                                                                    defaults=dict(opts)))
            t2 = time.perf_counter()
            ours.append(t1 - t0)
            alone.append(t2 - t1)
    results.add("keywords_compile_over_llguidance_p50", _ratio(ours, alone, 50), "x",
                "the same schemas' whole compile (grammar text, compiler, first mask)")
    results.add("keywords_compile_ms_p50", float(np.percentile(ours, 50)) * 1e3, "ms",
                "that compile, through the keyword path")

    # mask fills: the request's state vs the bare matcher, same walks
    state_f: list[float] = []
    bare_f: list[float] = []
    for i, text in enumerate(plain_schemas):
        g = compiler.compile(Constraint.json_schema(json.loads(text)))
        # no rule: a request decodes with the bare matcher itself (no wrapper), so these
        # two arms run the same code and their ratio is the measurement's noise
        assert g.unique is None and type(g.state()) is type(g.matcher())
        tokens = _walk(g.matcher(), vocab, i)
        for _ in range(results.size(3, 5, 1)):
            a, b = _fills(g.state, g.matcher, tokens, vocab.n)
            state_f += a
            bare_f += b
    results.add("keywords_mask_fill_over_bare_p50", _ratio(state_f, bare_f, 50), "x",
                f"{len(state_f)} fills replaying grammar walks, schemas without the keywords")
    results.add("keywords_mask_fill_over_bare_p99", _ratio(state_f, bare_f, 99), "x",
                "same fills")

    # with uniqueItems: the rule beside the grammar vs the grammar alone, same walks
    rule_f: list[float] = []
    alone_f: list[float] = []
    for name, schema in results.prompts(list(SETS.items()), smoke=1):
        g = compiler.compile(Constraint.json_schema(schema))
        assert g.unique is not None
        for seed in range(results.size(3, 6, 1)):
            tokens = _walk(g.state(), vocab, seed)
            for _ in range(results.size(2, 3, 1)):
                a, b = _fills(g.state, g.matcher, tokens, vocab.n)
                rule_f += a
                alone_f += b
    us = np.array(rule_f) * 1e6
    results.add("unique_mask_fill_us_p50", float(np.percentile(us, 50)), "us",
                f"{us.size} fills with the uniqueItems rule, grammar walks of set schemas")
    results.add("unique_mask_fill_us_p99", float(np.percentile(us, 99)), "us", "same fills")
    results.add("unique_mask_fill_over_grammar_p50", _ratio(rule_f, alone_f, 50), "x",
                "the same walks' fills without the rule (the grammar alone)")
    results.add("unique_mask_fill_over_grammar_p99", _ratio(rule_f, alone_f, 99), "x",
                "same fills")

    g = compiler.compile(Constraint.json_schema(SETS["tags"]))
    benchmark.pedantic(lambda: _fills(g.state, g.matcher, [], vocab.n), rounds=3, iterations=1)
