"""Masking and sampling as pure array functions (MLX), plus the coupled randomness.

Coupled randomness: the noise for output position `i` is `position_noise(seed, i, V)`, a
float32 Gumbel vector that depends on nothing else. A seeded pick is

    argmax(filter(logits / temperature) + position_noise(seed, i, V))

(the Gumbel-max trick), so any decoder that computes the same logits at position `i` picks
the same token — plain and speculative decoding give identical output for one seed. The noise
is defined by numpy code (below) and moved to the device as data, so every backend sees the
same bits. `oracle/` re-implements the same definition independently.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .errors import RequestError, SamplingError  # noqa: F401
from .request import SamplingParams

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64_scalar(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """The Gumbel noise of output position `position`: float32 array (vocab,).

    Definition (all uint32 arithmetic wraps; float ops are float32, numpy's `log`):
        base = splitmix64(splitmix64(seed) ^ position) mod 2**32
        x_v = (v * 0x9E3779B9) ^ base, then x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15;
              x *= 0x846CA68B; x ^= x >> 16
        u_v = ((x_v >> 9) + 0.5) * 2**-23          (exact in float32; max 1 - 2**-24 < 1)
        g_v = -log(-log(u_v))
    ~0.4 ms for 49k tokens, computed on the host while the device runs the forward pass.
    """
    base = _splitmix64_scalar(_splitmix64_scalar(seed) ^ position) & 0xFFFFFFFF
    x = np.arange(vocab, dtype=np.uint32) * np.uint32(0x9E3779B9)
    x ^= np.uint32(base)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    # 23 bits: with 24, (2**24 - 0.5) rounds up to 2**24 in float32, u hits 1 and g = inf.
    u = ((x >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-23)
    return -np.log(-np.log(u))


def bias_vector(params: SamplingParams, vocab: int) -> mx.array | None:
    """The request's logit bias as a dense float32 (vocab,) vector, or None without one."""
    if not params.logit_bias:
        return None
    b = np.zeros(vocab, dtype=np.float32)
    for tok, v in params.logit_bias:
        if tok < vocab:
            b[tok] += np.float32(v)
    return mx.array(b)


def unpack_bitmask(bitmask: mx.array, vocab: int) -> mx.array:
    """llguidance's packed mask (..., W) int32 → allowed (..., vocab) bool; ids past 32*W are
    banned."""
    shifts = mx.arange(32, dtype=mx.int32)
    bits = mx.right_shift(bitmask[..., None], shifts) & 1  # (..., W, 32)
    allowed = bits.reshape(*bitmask.shape[:-1], -1) != 0  # (..., 32 W)
    width = allowed.shape[-1]
    if width >= vocab:
        return allowed[..., :vocab]
    pad = mx.zeros((*bitmask.shape[:-1], vocab - width), dtype=mx.bool_)
    return mx.concatenate([allowed, pad], axis=-1)


def apply_mask(logits: mx.array, allowed: mx.array) -> mx.array:
    """Banned logits → -inf. logits (..., V), allowed (..., V) bool (broadcasts)."""
    return mx.where(allowed, logits, mx.array(-np.inf, dtype=logits.dtype))


def filter_top_k(x: mx.array, k: int) -> mx.array:
    """Keep logits >= the k-th largest of their row (boundary ties all kept). x (..., V)."""
    if k <= 0 or k >= x.shape[-1]:
        return x
    kth = mx.min(mx.topk(x, k, axis=-1), axis=-1, keepdims=True)  # (..., 1)
    return mx.where(x >= kth, x, mx.array(-np.inf, dtype=x.dtype))


def filter_top_p(x: mx.array, p: float) -> mx.array:
    """Keep each row's smallest set of highest logits whose probability mass reaches p.

    x (..., V). Probabilities are float32 softmax; only a token whose cumulative mass lands
    within rounding of `p` can depend on the backend's exp.
    """
    if p >= 1.0:
        return x
    sorted_x = -mx.sort(-x, axis=-1)  # (..., V) descending
    probs = mx.softmax(sorted_x, axis=-1)
    before = mx.cumsum(probs, axis=-1) - probs  # mass strictly above each entry
    keep = mx.maximum(mx.sum(before < p, axis=-1, keepdims=True), 1)  # (..., 1)
    threshold = mx.take_along_axis(sorted_x, keep - 1, axis=-1)
    return mx.where(x >= threshold, x, mx.array(-np.inf, dtype=x.dtype))


def pick(logits: mx.array, params: SamplingParams, noise: mx.array | None) -> mx.array:
    """Choose a token per row from (already masked) logits (..., V) float32 → (...) uint32.

    Greedy: argmax (first index on ties). Sampling: Gumbel-max over the temperature-scaled,
    top-k/top-p filtered logits with each row's position noise (..., V).
    """
    return mx.argmax(pick_scores(logits, params, noise), axis=-1)


def pick_scores(logits: mx.array, params: SamplingParams, noise: mx.array | None) -> mx.array:
    """What `pick` takes the argmax of: the logits (greedy), or the temperature-scaled,
    filtered logits plus the position noise (sampling); its order ranks a row's candidates
    (a token tree's alternatives, `speculative.Proposer`)."""
    if params.greedy:
        return logits
    assert noise is not None, "sampling needs the position's noise"
    x = logits / mx.array(params.temperature, dtype=mx.float32)
    x = filter_top_k(x, params.top_k)
    x = filter_top_p(x, params.top_p)
    return x + noise
