"""Comparing a fast path's token stream with the oracle's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .reference import OracleResult


@dataclass(frozen=True)
class Divergence:
    """Where two streams first differ, and how close the oracle's decision was there.

    Attributes:
        index: first differing position (a length difference counts at the shorter length).
        expected: the oracle's token there (None past its end).
        got: the fast path's token there (None past its end).
        margin: the oracle's top-2 score margin at `index` (None when unknown).
    """

    index: int
    expected: int | None
    got: int | None
    margin: float | None


def first_divergence(expected: Sequence[int], got: Sequence[int]) -> int | None:
    """Index of the first position where the streams differ, or None when identical."""
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return i
    if len(expected) != len(got):
        return min(len(expected), len(got))
    return None


def report(oracle: OracleResult, got: Sequence[int]) -> Divergence | None:
    """The divergence of `got` from the oracle's output, with the oracle's margin there."""
    i = first_divergence(oracle.tokens, got)
    if i is None:
        return None
    exp = oracle.tokens[i] if i < len(oracle.tokens) else None
    g = got[i] if i < len(got) else None
    margin = oracle.steps[i].margin if i < len(oracle.steps) else None
    return Divergence(i, exp, g, margin)
