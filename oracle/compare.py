"""Comparing a fast path's token stream with the oracle's."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
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


# Per-value tolerance, after the row's common offset (below) is taken out. The scaled logits
# are bitwise the oracle's (same float32 logits, same float32 division), so a float32 server's
# value differs from the oracle's float64 one by its last rounding: half an ulp, <= 3.8e-6
# for values above -64 (7.6e-6 above -128), and ties may only be reordered where two values
# lie that close.
SHAPE_TOL = 1e-5
UNIT_ROUNDOFF = 2.0 ** -24  # float32


@dataclass(frozen=True)
class ServedLogprob:
    """One output token's logprobs as a server reported them, in `key` space (a token's
    text on the wire, where two ids can share one): the token, its logprob, the top list."""

    token: Hashable
    logprob: float
    top: tuple[tuple[Hashable, float], ...]


@dataclass(frozen=True)
class LogprobComparison:
    """How a server's logprobs compare with the oracle's.

    Attributes:
        tokens: positions compared.
        entries: values compared (the chosen tokens' and every listed alternative's).
        max_abs: the largest |served - oracle| of any value.
        max_offset: the largest |offset| of a row: served - oracle at its most likely token,
            the error of the server's normaliser (log-sum-exp), common to the whole row.
        max_shape: the largest |served - oracle - offset| of any value.
        near_ties: listed positions holding another token than the oracle's, whose value
            ties with the oracle's there within SHAPE_TOL (an order either side may give).
        problems: every disagreement, described; empty when the logprobs are equal.
    """

    tokens: int
    entries: int
    max_abs: float
    max_offset: float
    max_shape: float
    near_ties: int
    problems: tuple[str, ...]


def compare_logprobs(oracle: OracleResult, served: Sequence[ServedLogprob],
                     key: Callable[[int], Hashable] = lambda t: t) -> LogprobComparison:
    """Compare a server's logprobs with the oracle's (`reference_decode(..., logprobs=n)`).

    Per position: the chosen token must be the oracle's; each value (the chosen token's and
    every listed one's) must equal the oracle's up to the row's offset within SHAPE_TOL; the
    offset (the error of the server's normaliser, common to the row) must lie within a
    float32 sum's bound over the allowed tokens, n * 2**-24 (each addition rounds by at most
    half an ulp of the running sum); the list must have the oracle's length, and at each
    place the oracle's token or one tied with it (a near-tie, counted).

    Args:
        oracle: the oracle's result, decoded with logprobs.
        served: the server's logprobs, one per output token, in `key` space.
        key: an oracle id's key (e.g. its text, as the wire names tokens).
    """
    problems: list[str] = []
    entries = near = 0
    max_abs = max_offset = max_shape = 0.0
    if len(served) != len(oracle.tokens):  # an EOS is a step, not an output token
        problems.append(f"{len(served)} logprobs for {len(oracle.tokens)} oracle tokens")
    for i, (got, step) in enumerate(zip(served, oracle.steps)):
        assert step.logprob is not None, "decode the oracle with logprobs"
        if got.token != key(step.token):
            problems.append(f"token {i}: {got.token!r}, the oracle's is {key(step.token)!r}")
            continue
        # The row's offset, read at its most likely token (listed or not, the same offset).
        offset = (got.top[0][1] - step.top[0][1] if got.top and step.top
                  else got.logprob - step.logprob)
        max_offset = max(max_offset, abs(offset))
        bound = step.allowed * UNIT_ROUNDOFF + SHAPE_TOL
        if abs(offset) > bound:
            problems.append(f"token {i}: logprobs off by {offset:.3g} (more than {bound:.3g} "
                            f"over {step.allowed} allowed tokens)")
        entries += 1
        max_abs = max(max_abs, abs(got.logprob - step.logprob))
        max_shape = max(max_shape, abs(got.logprob - offset - step.logprob))
        if abs(got.logprob - offset - step.logprob) > SHAPE_TOL:
            problems.append(f"token {i}: logprob {got.logprob!r}, the oracle's "
                            f"{step.logprob!r} (offset {offset:.3g})")
        if len(got.top) != len(step.top):
            problems.append(f"token {i}: {len(got.top)} alternatives, the oracle has "
                            f"{len(step.top)}")
        pool = list(step.top + step.near_cut)  # the oracle's entries not yet matched
        for j, ((k, v), (oid, ov)) in enumerate(zip(got.top, step.top)):
            entries += 1
            max_abs = max(max_abs, abs(v - ov))
            match = next((e for e in pool if key(e[0]) == k
                          and abs(v - offset - e[1]) <= SHAPE_TOL
                          and abs(e[1] - ov) <= SHAPE_TOL), None)
            if match is None:
                problems.append(f"token {i}, alternative {j}: {k!r} at {v!r}, the oracle's is "
                                f"{key(oid)!r} at {ov!r} (offset {offset:.3g})")
                continue
            pool.remove(match)
            max_shape = max(max_shape, abs(v - offset - match[1]))
            near += match[0] != oid
    return LogprobComparison(min(len(served), len(oracle.tokens)), entries, max_abs,
                             max_offset, max_shape, near, tuple(problems))
