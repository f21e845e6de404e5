"""The real-world schema corpus (tests/corpus/): schemas in the shapes people send — GeoJSON,
package manifests, CI workflows, Kubernetes objects, OpenAPI fragments, forms and invoices,
with `oneOf`/`anyOf`/`$ref`/`definitions`, optional keys and open `additionalProperties` —
each decoded plainly and by proposer cells on the embedded model, compiled leniently as the
server does for a non-strict `json_schema`.

A quarter of the schemas run each session (the others under the next three seeds), under
the shipped defaults, half of those with one rotating cell more (`SPECDEC_FULL_MATRIX=1`:
every schema): which schemas run, the mode and the
extra cell are a function of the corpus seed (`SPECDEC_CORPUS_SEED`, default: the day
number, printed in the summary), so every (schema, cell, mode) triple is covered over runs
and any failure is reproducible from its seed.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest

from specdec.grammar import Constraint
from specdec.speculative import SpecConfig
from tests import tally
from tests.exactness import MODES, Cell, plain, run_cells
from tests.rotation import FULL

CORPUS = sorted((Path(__file__).parent / "corpus").glob("*.json"))
MAX_TOKENS = 24
SEED = int(os.environ.get("SPECDEC_CORPUS_SEED") or datetime.date.today().toordinal())
DEFAULTS = Cell("distilled", SpecConfig(4, lookup=True, draft_min_prob=0.3, tree=4))  # as shipped
CELLS = [
    DEFAULTS,
    Cell("distilled", SpecConfig(8, draft_masking=False, lookup=True)),
    Cell("distilled", SpecConfig(2, draft_min_prob=0.3)),
    Cell("distilled", SpecConfig(4, forced_drafting=False, lookup=True)),
    Cell("self", SpecConfig(2, draft_masking=False, lookup=True)),
    Cell("none", SpecConfig(8)),
    Cell("none", SpecConfig(4, lookup=True)),
]


SHARE = 4  # one schema in SHARE runs under a seed


def cells_for(i: int) -> tuple[str, list[Cell]] | None:
    """The mode and cells schema i runs this session, where it runs ((i + seed) % SHARE == 0;
    None: it runs under a later seed): the shipped defaults, plus, where n % 4 < 2 (n = (i +
    seed) // SHARE), one rotating cell. Over consecutive seeds every schema meets every
    (cell, mode): n with n % 4 in {0, 1} takes every residue n % 14 (both parities), and
    r = n % 14 picks the mode (r % 2) and the cell (r // 2)."""
    if (i + SEED) % SHARE and not FULL:
        return None
    n = (i + SEED) // SHARE
    r = n % (2 * len(CELLS))
    mode = sorted(MODES)[r % 2]
    extra = CELLS[r // 2] if n % 4 < 2 else DEFAULTS
    return mode, [DEFAULTS] + ([extra] if extra is not DEFAULTS else [])


def test_corpus_is_real_world_sized():
    assert len(CORPUS) >= 30
    tally.NOTES.append(f"corpus seed {SEED} (SPECDEC_CORPUS_SEED): {len(CORPUS)} schemas")


@pytest.mark.parametrize("i", range(len(CORPUS)), ids=[p.stem for p in CORPUS])
def test_corpus_schema_proposer_cells_equal_plain(engines, i):
    path = CORPUS[i]
    schema = json.loads(path.read_text())
    this = cells_for(i)
    if this is None:
        pytest.skip(f"decoded under another corpus seed (corpus seed {SEED})")
    mode, cells = this
    e = engines["none"]
    ids = e.chat_prompt([{"role": "user", "content": f"One example {schema.get('title', path.stem)}"
                                                     " as JSON."}], constrained=True)
    c = Constraint.json_schema(schema, lenient=True)
    # The budget: MAX_TOKENS, or two above the schema's minimum where that is more (the
    # budget rule then steers the document closed: budget cells on real-world schemas).
    closing = e.prepare(ids, constraint=c, max_tokens=1024).closing
    budget = MAX_TOKENS if closing is None else max(MAX_TOKENS, closing.minimum + 2)
    bad = run_cells(engines, ids, c, MODES[mode], budget, cells,
                    "embedded: real-world corpus, proposer cells vs plain")
    assert not bad, f"{path.name} ({mode}, corpus seed {SEED}):\n" + "\n".join(bad)
    want = plain(e, ids, c, MODES[mode], budget)
    assert want.tokens, "plain decoding emitted nothing"
    if want.finish_reason == "stop" or closing is not None:
        json.loads(want.text)  # a finished (or closed in time) document parses
