"""Proposer cells against plain decoding on the embedded model: the shared runner of the
real-world corpus (test_corpus.py) and the GeoJSON regression (test_geojson_exactness.py).

A cell is one proposer combination: which draft (the shipped distilled draft, the target as
its own draft, or none: grammar-forced tokens and prompt lookup only) and a SpecConfig. On
the reference BLAS (this suite's configuration) every cell must emit exactly plain
decoding's tokens and finish reason, and never raise a grammar error.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.errors import GrammarStateError
from specdec.engine import Engine
from specdec.events import Finished as GenerationResult
from specdec.grammar import Constraint
from specdec.sampling import SamplingParams
from specdec.speculative import SpecConfig
from tests import tally

MODES = {"greedy": SamplingParams(), "seeded": SamplingParams(0.8, top_k=40, seed=11)}


@dataclass(frozen=True)
class Cell:
    """One proposer combination. `draft`: "distilled", "self" or "none"."""

    draft: str
    spec: SpecConfig

    @property
    def name(self) -> str:
        s = self.spec
        src = {"distilled": "distilled draft", "self": "self draft",
               "none": "no draft"}[self.draft]
        bits = [src, f"k{s.k}", "masked" if s.draft_masking else "unmasked",
                "forced" if s.forced_drafting else "no-forced",
                "lookup" if s.lookup else "no-lookup",
                f"gated {s.draft_min_prob:g}" if s.draft_min_prob else "ungated"]
        return " ".join(bits)


def make_engines(target, distilled) -> dict[str, Engine]:
    """One engine per draft kind, sharing the compiler and the prompt-KV store (the same
    target: a prompt prefilled for one cell is reused by the next)."""
    engines = {"distilled": Engine(target, distilled), "self": Engine(target, target),
               "none": Engine(target, None)}
    first = engines["distilled"]
    for e in engines.values():
        e.compiler, e.kv_store = first.compiler, first.kv_store
    return engines


# key -> (the target, kept alive so that its id is never reused by another model, result)
_PLAIN: dict[tuple, tuple[object, GenerationResult]] = {}


def plain(engine: Engine, ids: list[int], constraint: Constraint, sampling: SamplingParams,
          max_tokens: int) -> GenerationResult:
    """Plain decoding of a request, memoised for the session (tests compare several fast
    paths with the same plain run)."""
    key = (id(engine.target), tuple(ids), repr(constraint), sampling, max_tokens)
    if key not in _PLAIN:
        _PLAIN[key] = (engine.target, engine.generate(engine.prepare(
            ids, constraint=constraint, sampling=sampling, max_tokens=max_tokens, spec=None)))
    return _PLAIN[key][1]


def cells_vs(engines: dict[str, Engine], cells: list[Cell], want: GenerationResult,
             label: str, tag: str, ids: list[int], **prepare) -> tuple[list[str], list]:
    """Decode one request (`Engine.prepare(ids, spec=cell.spec, **prepare)`) by each cell and
    compare tokens and finish with `want`, counted under `label`: (a line per cell that
    differs, prefixed with `tag`; each cell's result)."""
    bad, results = [], []
    for cell in cells:
        eng = engines[cell.draft]
        got = eng.generate(eng.prepare(ids, spec=cell.spec, **prepare))
        same = (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason)
        tally.record(label, same)
        if not same:
            bad.append(f"{tag} {cell.name}: {got.tokens} != {want.tokens}")
        results.append(got)
    return bad, results


def run_cells(engines: dict[str, Engine], ids: list[int], constraint: Constraint,
              sampling: SamplingParams, max_tokens: int, cells: list[Cell], label: str
              ) -> list[str]:
    """Decode plainly, then each cell; return a description of every cell that differs,
    cuts with masking on, or raises a grammar error (counted in the summary under `label`)."""
    want = plain(engines["none"], ids, constraint, sampling, max_tokens)
    bad = []
    for cell in cells:
        e = engines[cell.draft]
        try:
            got = e.generate(e.prepare(ids, constraint=constraint, sampling=sampling,
                                       max_tokens=max_tokens, spec=cell.spec))
        except GrammarStateError as err:
            tally.record(f"{label}: grammar errors (0 expected)", False)
            bad.append(f"{cell.name}: grammar error {err}")
            continue
        same = (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason)
        tally.record(label, same)
        tally.record_cuts(cell.spec.draft_masking, got.stats.counters.grammar_cuts)
        tally.record_sources(label, got.stats.counters)
        if not same:
            n = next((i for i, (a, b) in enumerate(zip(got.tokens, want.tokens)) if a != b),
                     min(len(got.tokens), len(want.tokens)))
            bad.append(f"{cell.name}: differs from plain at output token {n} "
                       f"(plain {want.text!r}, got {got.text!r})")
        elif cell.spec.draft_masking and got.stats.counters.grammar_cuts:
            bad.append(f"{cell.name}: {got.stats.counters.grammar_cuts} grammar cuts with "
                       "masking on")
    return bad

