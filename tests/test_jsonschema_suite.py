"""The JSON-Schema-Test-Suite ratchet: every draft 2020-12 case through the json_schema
constraint's grammar, strict and lenient, against the committed outcomes
(tests/jsonschema_suite/expected.txt; `tests.schema_suite` says how a case is decided).

Any change fails, better or worse, so that what the server enforces moves only on purpose:
`SPECDEC_UPDATE_RATCHET=1` rewrites the file (review its diff). Whatever the file says,
strict mode never accepts an invalid instance (a schema is enforced or refused, never
silently weakened), and lenient mode accepts one only with a warning naming a keyword it
did not enforce.
"""

from __future__ import annotations

import os
import re
import pytest
from jsonschema_specifications import REGISTRY

from specdec.grammar import GrammarCompiler
from tests import schema_suite
from tests.schema_suite import EXPECTED, Result

# Draft 2020-12's keywords: the properties of its vocabularies' meta-schemas.
KEYWORDS = frozenset(k for uri in REGISTRY if "/draft/2020-12/meta/" in uri
                     for k in REGISTRY.contents(uri).get("properties", {}))


@pytest.fixture(scope="module")
def results(embedded) -> list[Result]:
    """Outcomes over the embedded model's tokenizer, as its server compiles them."""
    compiler = GrammarCompiler.for_hf_tokenizer(embedded.tokenizer,
                                                n_vocab=embedded.vocab_size,
                                                eos_token_ids=list(embedded.eos_token_ids))
    return schema_suite.run(compiler)


def named(warning: str) -> set[str]:
    """The keywords a warning names: quoted (`Unimplemented keys: ["not"]`,
    `keyword "format"`) or as its first word (`oneOf not fully supported`)."""
    quoted = set(re.findall(r'["`]([^"`]+)["`]', warning))
    return (quoted | {warning.split(" ", 1)[0]}) & KEYWORDS


def test_outcomes_are_the_committed_ones(results):
    text = schema_suite.render(results)
    if os.environ.get("SPECDEC_UPDATE_RATCHET") == "1":
        EXPECTED.write_text(text, encoding="utf-8")
    expected = schema_suite.parse(EXPECTED.read_text(encoding="utf-8"))
    now = schema_suite.parse(text)
    changed = [f"{key} {mode}: {expected.get((key, mode), 'absent')} -> "
               f"{now.get((key, mode), 'absent')}"
               for key, mode in sorted(expected.keys() | now.keys())
               if expected.get((key, mode)) != now.get((key, mode))]
    hint = (f"rerun with SPECDEC_UPDATE_RATCHET=1 to rewrite {EXPECTED.name} on purpose "
            "(and review its diff)")
    assert not changed, (f"{len(changed)} outcomes changed (expected -> now); {hint}:\n"
                         + "\n".join(changed[:100]))
    assert EXPECTED.read_text(encoding="utf-8") == text, f"the file is out of date; {hint}"


def test_strict_accepts_no_invalid_instance(results):
    wrong = [r.case.key for r in results if r.mode == "strict" and r.outcome == "false_positive"]
    assert not wrong, f"strict mode weakened these schemas silently: {wrong}"
    assert all(not r.warnings for r in results if r.mode == "strict")


def test_lenient_accepts_an_invalid_instance_only_with_a_warning_naming_the_keyword(results):
    lenient = [r for r in results if r.mode == "lenient"]
    assert sum(r.outcome == "false_positive" for r in lenient) > 0  # the check below ran
    unwarned = [r.case.key for r in lenient if r.outcome == "false_positive"
                and not set().union(*map(named, r.warnings))]
    assert not unwarned, f"accepted invalid instances with no warning naming a keyword: {unwarned}"
    vague = {w for r in lenient for w in r.warnings if not named(w)}
    assert not vague, f"warnings that name no keyword: {vague}"
