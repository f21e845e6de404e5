"""Exactness cells counted during the run, printed at the end (see conftest)."""

from __future__ import annotations

from collections import defaultdict

CELLS: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # name -> [identical, total]


def record(name: str, identical: bool) -> None:
    CELLS[name][1] += 1
    CELLS[name][0] += int(identical)


CUTS: dict[str, int] = {"draft masking on": 0, "draft masking off": 0}


def record_cuts(draft_masking: bool, cuts: int) -> None:
    CUTS["draft masking on" if draft_masking else "draft masking off"] += cuts


SOURCES: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # name -> [accepted, proposed]


def record_sources(name: str, stats) -> None:
    """Count proposals by source (lookup, draft model) so the summary shows they ran."""
    for src in ("looked_up", "drafted"):
        if getattr(stats, src):
            SOURCES[f"{name}, {src}"][0] += getattr(stats, src + "_accepted")
            SOURCES[f"{name}, {src}"][1] += getattr(stats, src)


NOTES: list[str] = []  # lines for the summary (e.g. the corpus seed)
