"""Exactness cells counted during the run, printed at the end (see conftest)."""

from __future__ import annotations

from collections import defaultdict

CELLS: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # name -> [identical, total]


def record(name: str, identical: bool) -> None:
    CELLS[name][1] += 1
    CELLS[name][0] += int(identical)
