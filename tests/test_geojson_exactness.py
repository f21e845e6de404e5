"""The GeoJSON regression (shared/repro): a public draft-04 `geometry` schema (`oneOf` over
seven geometry types, `definitions`, open `additionalProperties`) on which the shipped
defaults (distilled draft + prompt lookup) once raised a grammar error after `{"name`,
because the request's matcher was advanced and rolled back by llguidance (see
test_llguidance_rollback.py). Every proposer combination must emit plain decoding's output,
from the engine, the CLI and the server.

Read from ../shared/repro, as the issue that filed it asks (CI has ../shared too); a checkout
elsewhere uses the identical copy in tests/corpus/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.grammar import Constraint
from specdec.speculative import SpecConfig
from tests import tally
from tests.exactness import MODES, Cell, plain, run_cells
from tests.rotation import SEED, half
from tests.serverproc import serve_app

REPRO = Path(__file__).resolve().parents[2] / "shared" / "repro"
# The filed reproduction when the checkout sits beside ../shared (as in CI); else the same
# file as the corpus carries it, so a checkout elsewhere still runs the regression.
FILED = REPRO / "geojson-geometry.schema.json"
SCHEMA = FILED if FILED.is_file() else Path(__file__).parent / "corpus" / "geojson-geometry.json"
PROMPT = "Produce one realistic example JSON document for this Github_medium schema."
MAX_TOKENS = {"greedy": 256, "seeded": 48}  # greedy: the repro's own limit (a 64-token document)

# Every proposer kind, masking on/off, gated/ungated, k 2/4/8 across the modes; the target
# as its own draft (the costliest proposer: a second target forward per step) on the seeded,
# shorter document only. The corpus's schemas rotate through the other combinations (the
# distilled draft unmasked at k8 among them). A run decodes half of each mode's cells, the
# other half under the next corpus seed (`tests.rotation`); the shipped defaults run every
# time in the CLI and server tests below.
CELLS = {
    "greedy": [
        Cell("distilled", SpecConfig(4, lookup=True, draft_min_prob=0.3, tree=4)),  # shipped
        Cell("distilled", SpecConfig(2, forced_drafting=False, lookup=True)),
        Cell("none", SpecConfig(8)),                  # grammar-forced tokens only
        Cell("none", SpecConfig(2, lookup=True)),     # forced + lookup
    ],
    "seeded": [
        Cell("distilled", SpecConfig(4, lookup=True, draft_min_prob=0.3)),
        Cell("self", SpecConfig(8, draft_masking=False, draft_min_prob=0.3)),
        Cell("self", SpecConfig(2, lookup=True)),
        Cell("none", SpecConfig(4, lookup=True)),
    ],
}


def prompt_ids(engines) -> list[int]:
    return engines["none"].chat_prompt([{"role": "user", "content": PROMPT}], constrained=True)


def plain_text(engines, schema: str, strict: bool) -> tuple[str, str]:
    """Plain greedy decoding in this process (the reference BLAS), memoised."""
    c = Constraint.json_schema(schema, lenient=not strict)
    r = plain(engines["none"], prompt_ids(engines), c, MODES["greedy"], MAX_TOKENS["greedy"])
    return r.text, r.finish_reason


@pytest.fixture(scope="module")
def schema() -> str:
    tally.NOTES.append(f"GeoJSON regression schema: {SCHEMA}")
    return SCHEMA.read_text()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_geojson_every_proposer_combination_equals_plain(engines, schema, mode):
    c = Constraint.json_schema(schema, lenient=True)
    cells = half(CELLS[mode], "geojson", mode)
    bad = run_cells(engines, prompt_ids(engines), c, MODES[mode], MAX_TOKENS[mode], cells,
                    "embedded: GeoJSON repro, every proposer vs plain")
    assert not bad, f"corpus seed {SEED}:\n" + "\n".join(bad)


def test_geojson_cli_defaults_print_the_plain_output(engines, schema):
    env = dict(os.environ, SPECDEC_BLAS="reference")
    env.pop("SPECDEC_BLAS_REEXEC", None)
    out = subprocess.run([sys.executable, "-m", "specdec", "generate", "--json-schema",
                          str(SCHEMA), "--lenient", "--prompt", PROMPT, "--max-tokens", "256"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == plain_text(engines, schema, strict=False)[0] + "\n"


def test_geojson_server_defaults_answer_the_plain_output(engines, served_models, schema):
    # The app `specdec serve` serves, with its default flags, in this process (the reference
    # BLAS, where speculative output is promised equal to plain); strict (lenient and strict
    # both answered 500 before the fix: the engine cells and the CLI run lenient).
    s = serve_app(models=served_models)
    try:
        r = s.client().chat.completions.create(
            model="default", messages=[{"role": "user", "content": PROMPT}],
            temperature=0, max_tokens=256, response_format={
                "type": "json_schema",
                "json_schema": {"name": "geometry", "strict": True,
                                "schema": json.loads(schema)}})
        got = r.choices[0].message.content, r.choices[0].finish_reason
        assert got == plain_text(engines, schema, strict=True)
        json.loads(got[0] or "")
    finally:
        s.stop()
