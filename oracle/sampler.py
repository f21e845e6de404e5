"""numpy re-implementation of the documented decision rule (see specdec.sampling's docstring).

Written separately on purpose: if both sides shared this code a bug in it would pass the gate.
"""

from __future__ import annotations

import numpy as np

M64 = 0xFFFFFFFFFFFFFFFF


def _mix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def gumbel(seed: int, position: int, n: int) -> np.ndarray:
    """Gumbel noise of output position `position` (n,) float32, per the documented definition."""
    key = _mix64(_mix64(seed) ^ position) % (1 << 32)
    # uint64 holding 32-bit values: wrap by masking instead of relying on uint32 overflow.
    h = (np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B9)) & np.uint64(0xFFFFFFFF)
    h = h ^ np.uint64(key)
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x7FEB352D)) & np.uint64(0xFFFFFFFF)
    h = h ^ (h >> np.uint64(15))
    h = (h * np.uint64(0x846CA68B)) & np.uint64(0xFFFFFFFF)
    h = h ^ (h >> np.uint64(16))
    mant = (h >> np.uint64(9)).astype(np.float32)
    u = (mant + np.float32(0.5)) * np.float32(1.0 / 8388608.0)
    return -np.log(-np.log(u))


def unpack_mask(bitmask: np.ndarray, n: int) -> np.ndarray:
    """llguidance packed int32 words → bool (n,), little-endian bit order; ids past the words
    are banned."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), bitorder="little")
    out = np.zeros(n, dtype=bool)
    m = min(n, bits.size)
    out[:m] = bits[:m].astype(bool)
    return out


def decision_scores(logits: np.ndarray, *, temperature: float, top_k: int, top_p: float,
                    noise: np.ndarray | None) -> np.ndarray:
    """Scores whose argmax is the pick: masked logits (greedy), or filtered scaled logits plus
    Gumbel noise (sampling). logits (n,) float32 with -inf where banned."""
    if temperature == 0.0:
        return logits
    x = logits / np.float32(temperature)
    if 0 < top_k < x.size:
        kth = np.partition(x, x.size - top_k)[x.size - top_k]
        x = np.where(x >= kth, x, np.float32(-np.inf)).astype(np.float32)
    if top_p < 1.0:
        order = np.sort(x)[::-1]
        e = np.exp(order - order[0])
        probs = (e / e.sum(dtype=np.float32)).astype(np.float32)
        above = np.cumsum(probs, dtype=np.float32) - probs
        keep = max(int(np.count_nonzero(above < np.float32(top_p))), 1)
        x = np.where(x >= order[keep - 1], x, np.float32(-np.inf)).astype(np.float32)
    assert noise is not None
    return (x + noise).astype(np.float32)


def log_probs(logits: np.ndarray, *, temperature: float) -> np.ndarray:
    """The documented logprobs of a position: log_softmax(logits / T), T the temperature (1
    when greedy), before top-k/top-p. logits (n,) float32, biased, -inf where banned.

    Returns float64 (n,), -inf where banned. The division is float32 (the decision rule's
    own scaled logits, bit for bit); the softmax is float64, so the values are the exact
    ones up to float64 rounding and a server's float32 error shows as it is.
    """
    t = np.float32(temperature) if temperature > 0 else np.float32(1.0)
    x = (logits / t).astype(np.float64)
    m = x[np.isfinite(x)].max()
    return x - (m + np.log(np.exp(x - m).sum()))


def top_logprobs(lp: np.ndarray, n: int, near: float = 0.0
                 ) -> tuple[tuple[tuple[int, float], ...], tuple[tuple[int, float], ...]]:
    """The n most likely allowed tokens of logprobs lp (n,) as (id, logprob), value
    descending then id ascending; and after them every further allowed token within `near`
    of the n-th (a near-tie at the cut: a float32 top-n may list it instead).

    Returns (top, near_cut); fewer than n in `top` when fewer tokens are allowed.
    """
    ok = np.flatnonzero(np.isfinite(lp))
    k = min(n, ok.size)
    if k == 0:
        return (), ()
    kth = np.partition(lp[ok], ok.size - k)[ok.size - k]
    sel = ok[lp[ok] >= kth - near]
    sel = sel[np.lexsort((sel, -lp[sel]))]
    pairs = tuple((int(i), float(lp[i])) for i in sel)
    return pairs[:k], pairs[k:]
