"""The keywords enforced by rewrite (specdec/schema_rewrite.py) on the embedded model: for each,
a strict schema and a prompt that pushes the model to break it (leave out the dependent
property, write the forbidden value, the other country's postal code, a capitalised key,
an extra property). At temperature 0 and at two seeds at temperature 0.9 the answer
validates against the schema as written (`jsonschema`, not the rewrite), and the shipped
speculative defaults (distilled draft, lookup, gated drafting, token trees) emit plain
decoding's tokens (the other proposer cells are the tiny matrix's and the corpus's)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from specdec.grammar import Constraint
from specdec.sampling import SamplingParams
from specdec.speculative import SpecConfig
from tests.exactness import Cell, plain, run_cells

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
