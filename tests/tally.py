"""Exactness cells counted during the run, printed at the end (see conftest). Under
pytest-xdist each worker exports its counts and the controller merges them."""

from __future__ import annotations

import json
from collections import defaultdict

from specdec.speculative import SpecStats
from specdec.types import ProposalSource

CELLS: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # name -> [identical, total]


def record(name: str, identical: bool) -> None:
    CELLS[name][1] += 1
    CELLS[name][0] += int(identical)


CUTS: dict[str, int] = {"draft masking on": 0, "draft masking off": 0}


def record_cuts(draft_masking: bool, cuts: int) -> None:
    CUTS["draft masking on" if draft_masking else "draft masking off"] += cuts


SOURCES: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # name -> [accepted, proposed]


def record_sources(name: str, stats: SpecStats) -> None:
    """Count proposals by source (lookup, earlier answers, draft model) so the summary shows
    they ran."""
    counts = stats.source_counts()  # `SpecStats`' record, under its wire names
    for src, proposed in counts.items():
        # (grammar-forced tokens are left out: no proposer to show running)
        if proposed and not src.endswith("_accepted") and src != ProposalSource.FORCED:
            SOURCES[f"{name}, {src}"][0] += counts[src + "_accepted"]
            SOURCES[f"{name}, {src}"][1] += proposed


NOTES: list[str] = []  # lines for the summary (e.g. the corpus seed)


def export() -> str:
    """This process's counts, as JSON (a worker's share of the summary)."""
    return json.dumps({"cells": CELLS, "cuts": CUTS, "sources": SOURCES, "notes": NOTES})


def merge(data: str) -> None:
    """Add a worker's exported counts to this process's."""
    d = json.loads(data)
    for name, (same, total) in d["cells"].items():
        CELLS[name][0] += same
        CELLS[name][1] += total
    for name, cuts in d["cuts"].items():
        CUTS[name] = CUTS.get(name, 0) + cuts
    for name, (acc, prop) in d["sources"].items():
        SOURCES[name][0] += acc
        SOURCES[name][1] += prop
    NOTES.extend(n for n in d["notes"] if n not in NOTES)
