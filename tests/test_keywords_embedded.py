"""The keywords enforced by rewrite (specdec/schema_rewrite.py) and by the uniqueness rule
(specdec/unique.py) on the embedded model: for each, a strict schema and a prompt that
pushes the model to break it (leave out the dependent property, write the forbidden value,
the other country's postal code, a capitalised key, an extra property, repeat an item).
At temperature 0 and at two seeds at temperature 0.9 the answer validates against the
schema as written (`jsonschema`, not the rewrite), and the shipped
speculative defaults (distilled draft, lookup, gated drafting, token trees) emit plain
decoding's tokens (the other proposer cells are the tiny matrix's and the corpus's). Under
the uniqueness rule plain decoding is also the oracle's, which reads the rule from the
schema itself (oracle/unique.py), and every proposer cell of the tiny matrix's kinds (draft
model masked and unmasked, lookup, earlier answers, token trees, batching; half of them a
run, `tests.rotation`) emits plain's tokens."""

from __future__ import annotations

import json

import jsonschema
import pytest

from specdec.grammar import Constraint
from specdec.sampling import SamplingParams
from specdec.speculative import SpecConfig
from oracle import UniqueOracle, reference_decode, report
from tests import tally
from tests.exactness import Cell, plain, run_cells
from tests.rotation import half, runs

MAX_TOKENS = 48
MODES = {"greedy": SamplingParams(), "t0.9-seed1": SamplingParams(0.9, seed=1),
         "t0.9-seed2": SamplingParams(0.9, seed=2)}
CELLS = [Cell("distilled", SpecConfig(4, lookup=True, draft_min_prob=0.3, tree=4))]

SHORT = {"type": "string", "maxLength": 12}
CASES = {
    "dependentRequired": (
        "Write a JSON object for a customer named Ann who pays with credit card 1234. "
        "Leave out the billing address.",
        {"type": "object", "additionalProperties": False, "required": ["name", "credit_card"],
         "properties": {"name": SHORT, "credit_card": {"type": "string", "pattern": "^[0-9]{4}$"},
                        "billing_address": SHORT},
         "dependentRequired": {"credit_card": ["billing_address"]}}),
    "dependentSchemas": (
        "Write a JSON object for a customer named Bo who pays with credit card 9876. "
        "Do not include a cvv.",
        {"type": "object", "additionalProperties": False, "required": ["name"],
         "properties": {"name": SHORT, "credit_card": {"type": "string", "pattern": "^[0-9]{4}$"},
                        "cvv": {"type": "string", "pattern": "^[0-9]{3}$"}},
         "dependentSchemas": {"credit_card": {"required": ["cvv"]}}}),
    "if/then/else": (
        "Give a JSON address in the country US with the postal code K1A 0B1.",
        {"type": "object", "additionalProperties": False, "required": ["country", "postal_code"],
         "properties": {"country": {"enum": ["US", "CA"]}, "postal_code": {"type": "string"}},
         "if": {"properties": {"country": {"const": "US"}}},
         "then": {"properties": {"postal_code": {"pattern": "^[0-9]{5}$"}}},
         "else": {"properties": {"postal_code": {
             "pattern": "^[A-Z][0-9][A-Z] [0-9][A-Z][0-9]$"}}}}),
    "not": (
        "Reply with a JSON object whose color is red.",
        {"type": "object", "additionalProperties": False, "required": ["color"],
         "properties": {"color": {"type": "string", "maxLength": 10,
                                  "not": {"enum": ["red", "Red", "RED"]}}}}),
    "propertyNames": (
        'Give a JSON object counting fruit with the keys "Apple", "Banana" and "Cherry", '
        "capitalised exactly so.",
        {"type": "object", "propertyNames": {"pattern": "^[a-z_]+$"}, "maxProperties": 3,
         "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 99}}),
    "unevaluatedProperties": (
        "Give a book as a JSON object with its title, author and year.",
        {"type": "object", "required": ["title"], "unevaluatedProperties": False,
         "properties": {"title": {"type": "string", "maxLength": 24}}}),
}
UNIQUE = {
    "uniqueItems (strings)": (
        "Write a JSON object whose tags are apple, apple, apple and apple.",
        {"type": "object", "additionalProperties": False, "required": ["tags"],
         "properties": {"tags": {"type": "array", "uniqueItems": True, "minItems": 3,
                                 "maxItems": 4, "items": {"type": "string", "maxLength": 12}}}}),
    "uniqueItems (enum)": (
        "List the color red three times in JSON.",
        {"type": "object", "additionalProperties": False, "required": ["colors"],
         "properties": {"colors": {"type": "array", "uniqueItems": True, "minItems": 3,
                                   "items": {"enum": ["red", "green", "blue"]}}}}),
    "uniqueItems (integers)": (
        "Give the number 7 four times as a JSON list of integers.",
        {"type": "array", "uniqueItems": True, "minItems": 4, "maxItems": 4,
         "items": {"type": "integer", "minimum": 0, "maximum": 20}}),
}
CASES.update(UNIQUE)
# the tiny matrix's proposer kinds, under the uniqueness rule
UNIQUE_CELLS = [Cell("distilled", SpecConfig(4, draft_masking=True)),
                Cell("distilled", SpecConfig(4, draft_masking=False)),
                Cell("self", SpecConfig(2, draft_masking=True, tree=3)),
                Cell("none", SpecConfig(4, lookup=True, suffix=True))]


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_rewritten_keyword_holds_against_a_prompt_to_break_it(engines, name, mode):
    prompt, schema = CASES[name]
    e = engines["none"]
    ids = e.chat_prompt([{"role": "user", "content": prompt}], constrained=True)
    c = Constraint.json_schema(schema)  # strict: enforced or refused
    got = plain(e, ids, c, MODES[mode], MAX_TOKENS)
    doc = json.loads(got.text)  # ended by the model or closed in time by the budget
    jsonschema.Draft202012Validator(schema).validate(doc)
    bad = run_cells(engines, ids, c, MODES[mode], MAX_TOKENS, CELLS,
                    "embedded: rewritten keywords, speculative vs plain")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name", sorted(CASES))
def test_at_its_minimum_budget_the_answer_still_validates(engines, name):
    # The budget rule closes the rewritten grammar as any other: the fewest tokens that can
    # finish a valid document (the dependent property, the other country's code included),
    # and at exactly that many the greedy answer parses and validates.
    prompt, schema = CASES[name]
    e = engines["none"]
    ids = e.chat_prompt([{"role": "user", "content": prompt}], constrained=True)
    c = Constraint.json_schema(schema)
    closing = e.prepare(ids, constraint=c, max_tokens=1024).closing
    assert closing is not None and closing.minimum > 0
    got = plain(e, ids, c, MODES["greedy"], closing.minimum)
    assert len(got.tokens) <= closing.minimum
    jsonschema.Draft202012Validator(schema).validate(json.loads(got.text))


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(UNIQUE))
def test_under_the_uniqueness_rule_plain_is_the_oracle_and_every_cell_is_plain(
        engines, embedded, name, mode):
    if mode != "greedy" and not runs(name, mode):
        pytest.skip("a seeded mode of this case runs under every other seed (tests.rotation)")
    prompt, schema = UNIQUE[name]
    e = engines["none"]
    ids = e.chat_prompt([{"role": "user", "content": prompt}], constrained=True)
    c = Constraint.json_schema(schema)
    p = MODES[mode]
    got = plain(e, ids, c, p, MAX_TOKENS)
    vocab = e.compiler.vocab()
    rule = UniqueOracle(schema, lambda t: vocab.bytes[t] if t < vocab.n else b"",
                        embedded.vocab_size, set(embedded.eos_token_ids))
    want = reference_decode(embedded.model, ids, vocab_size=embedded.vocab_size,
                            eos_token_ids=embedded.eos_token_ids, max_tokens=MAX_TOKENS,
                            matcher=e.compiler.compile(c).matcher(), temperature=p.temperature,
                            top_k=p.top_k, top_p=p.top_p, seed=p.seed or 0, unique=rule)
    div = report(want, got.tokens)
    same = div is None and got.finish_reason == want.finish_reason
    tally.record("embedded: uniqueItems, plain vs oracle", same)
    assert same, f"{name} {mode}: diverged from the oracle at {div} ({got.text!r})"
    # half the cells a run, the other half under the next seed (`tests.rotation`)
    bad = run_cells(engines, ids, c, p, MAX_TOKENS, half(UNIQUE_CELLS, name, mode),
                    "embedded: uniqueItems, speculative vs plain")
    assert not bad, "\n".join(bad)


def test_under_the_uniqueness_rule_a_batch_decodes_as_each_alone(engines):
    # Every unique case, plain and speculative (distilled draft, masked), submitted at once:
    # the inline scheduler decodes them together in rounds; each equals its plain decode.
    from specdec.events import Finished

    e = engines["distilled"]
    streams, wants = [], []
    for name in sorted(UNIQUE):
        prompt, schema = UNIQUE[name]
        ids = e.chat_prompt([{"role": "user", "content": prompt}], constrained=True)
        c = Constraint.json_schema(schema)
        want = plain(engines["none"], ids, c, MODES["greedy"], MAX_TOKENS)
        for spec in (None, SpecConfig(4, draft_masking=True)):
            streams.append(e.submit(e.prepare(ids, constraint=c, max_tokens=MAX_TOKENS,
                                              spec=spec)))
            wants.append((name, want))
    for stream, (name, want) in zip(streams, wants):
        got = next(ev for ev in stream if isinstance(ev, Finished))
        same = (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason)
        tally.record("embedded: uniqueItems, batched vs plain", same)
        assert same, f"{name}: {got.text!r} != {want.text!r}"
