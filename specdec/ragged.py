"""One forward pass over many requests' rows (ragged batching), batch-invariant by construction.

Each request contributes its own run of tokens (its verify rows: the last token plus its
proposals, or one token when decoding plainly, or a prefill chunk) and its own KV cache. The
weight matmuls (q/k/v/o projections, MLP, head) run once over all rows concatenated.

Attention: a request's cache is a slot of its model's `Slab` (one keys and one values array
per layer for all requests, `make_cache`). Short segments (decode and verify rows) take
RoPE and write their new keys/values over their real rows, each row at its own position (one
scatter per layer), and attend in one masked call per group of similar-length segments over
those requests' slots, rows padded to the group's longest segment; the mask gives padded and
foreign positions finfo.min scores and so zero weight. Long segments (prefill chunks), and
caches that are not slab slots, take RoPE, the cache update and attention per request with
exactly the shapes they would have alone.

Batch invariance: a matmul computes each output row from that row alone on the reference
BLAS, its reductions run in a fixed order over the reduced axis and zero-weighted positions
add exact zeros, so a request's logits do not depend on its neighbours or on the padding
(tests/test_batching.py compares them bitwise with mlx-lm's own forward alone).

Supported: mlx-lm's llama-family `Model` classes (llama, mistral, qwen2 and others with the
same block layout), also inside a wrapper that maps ids and logits (a pruned-vocabulary
draft). `supports(model)` says whether a model can be batched this way; others run one
request per forward with mlx-lm's own caches.
"""

from __future__ import annotations

import heapq
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import (KVCache, QuantizedKVCache, RotatingKVCache,
                                  make_prompt_cache)


def _inner(model: nn.Module) -> Any:
    return getattr(model, "model", None)


def _base(model: nn.Module) -> nn.Module:
    """The mlx-lm model inside a wrapper that maps ids and logits around it (a pruned-vocabulary
    draft: `ragged_inner`, `map_ids`, `map_logits`), else the model itself."""
    return getattr(model, "ragged_inner", None) or model


def supports(model: nn.Module) -> bool:
    """Whether `model` has the llama block layout `forward` batches over."""
    model = _base(model)
    inner = _inner(model)
    layers = getattr(inner, "layers", None)
    if inner is None or not layers or not hasattr(inner, "embed_tokens"):
        return False
    if getattr(inner, "sliding_window", None) or getattr(getattr(model, "args", None),
                                                          "sliding_window", None):
        return False
    for layer in layers:
        a, m = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if a is None or m is None or not all(hasattr(a, n) for n in (
                "q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads")):
            return False
        if not all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return False
        if type(layer).__call__ is not _LLAMA_BLOCK or type(a).__call__ is not _LLAMA_ATTN:
            return False
    return True


def forward(model: nn.Module, segments: Sequence[tuple[Sequence[int], list]],
            rows: Sequence[int] | None = None, mapped: bool = True) -> list[mx.array | None]:
    """Logits for every request's rows, in one pass.

    Args:
        model: any mlx-lm model; batched when `supports(model)`, else one call per segment.
        segments: (token ids (non-empty), that request's per-layer KV caches), one per request;
            each cache is advanced by its tokens, as `model(tokens, cache)` would.
        rows: how many trailing rows of each segment need logits (default: all); 0 (a
            prefill chunk) skips the head for that segment.
        mapped: False: a pruned-vocabulary draft's own logits (`raw`), not target-width.
    Returns:
        one (rows_i, V) logits array per segment (None where rows_i is 0).
    """
    rows = [len(t) for t, _ in segments] if rows is None else list(rows)
    base = _base(model)
    if base is not model and supports(base):
        out = forward(base, [(model.map_ids(t), c) for t, c in segments], rows)
        return [x if x is None or not mapped else model.map_logits(x) for x in out]
    if not supports(model):
        out: list[mx.array | None] = []
        call = model if mapped else getattr(model, "raw", model)
        for (toks, cache), r in zip(segments, rows):
            logits = call(mx.array([list(toks)], dtype=mx.int32), cache=cache)[0]
            out.append(logits[len(toks) - r:] if r else None)
            if not r:
                mx.eval([c.state for c in cache])
        return out
    inner = _inner(model)
    lens = [len(t) for t, _ in segments]
    ids = mx.array([t for toks, _ in segments for t in toks], dtype=mx.int32)[None]  # (1, N)
    h = inner.embed_tokens(ids)  # (1, N, D)
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    slab = _slab_segments(segments)
    if slab is not None:
        h = _attend_slab(inner, h, segments, slab)
    for li, layer in enumerate(inner.layers if slab is None else ()):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)  # (1, N, *)
        outs = []
        for i, (_, cache) in enumerate(segments):
            s, e = bounds[i], bounds[i + 1]
            c = cache[li]
            qi = q[:, s:e].reshape(1, e - s, a.n_heads, -1).transpose(0, 2, 1, 3)
            ki = k[:, s:e].reshape(1, e - s, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
            vi = v[:, s:e].reshape(1, e - s, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
            qi = a.rope(qi, offset=c.offset)
            ki = a.rope(ki, offset=c.offset)
            ki, vi = c.update_and_fetch(ki, vi)
            mask = create_attention_mask(x[:, s:e], c)
            o = scaled_dot_product_attention(qi, ki, vi, cache=c, scale=a.scale, mask=mask)
            outs.append(o.transpose(0, 2, 1, 3).reshape(1, e - s, -1))
        h = h + a.o_proj(mx.concatenate(outs, axis=1) if len(outs) > 1 else outs[0])
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    # The head only over the rows asked for (a prefill chunk needs none).
    keep = [j for i, r in enumerate(rows) for j in range(bounds[i + 1] - r, bounds[i + 1])]
    if not keep:
        mx.eval([c.state for _, cache in segments for c in cache])
        return [None] * len(segments)
    h = inner.norm(h[:, mx.array(keep)] if len(keep) < bounds[-1] else h)
    if getattr(model, "args", None) is not None and model.args.tie_word_embeddings:
        logits = inner.embed_tokens.as_linear(h)[0]  # (sum rows, V)
    else:
        logits = model.lm_head(h)[0]
    out, at = [], 0
    for r in rows:
        out.append(logits[at:at + r] if r else None)
        at += r
    return out


class Slab:
    """KV storage shared by the requests of one model: per layer, keys and values of shape
    (slots, kv_heads, capacity, head_dim); a request owns one slot (`SlotCache` per layer).

    One array per layer lets `forward` update and attend over every request's cache with a
    constant number of operations per layer, however many requests share the round. Slots are
    taken lowest first, so active requests sit in a dense range; capacity grows in steps of
    256 positions to the longest request's need. All memory is released when the last slot
    is freed. Not for concurrent decoding threads on one model (one decode thread owns it).
    """

    STEP = 256

    def __init__(self, n_layers: int) -> None:
        self.n_layers = n_layers
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        self.cap = 0
        self._n = 0  # slot ids handed out so far (ids < _n are live or in _free)
        self._free: list[int] = []
        self._live = 0
        self._lock = threading.RLock()

    def alloc(self) -> _Slot:
        with self._lock:
            if self._free:
                i = heapq.heappop(self._free)
            else:
                i, self._n = self._n, self._n + 1
            self._live += 1
            return _Slot(self, i)

    def _release(self, i: int) -> None:
        with self._lock:
            self._live -= 1
            if self._live == 0:  # nobody left: give the memory back
                self.keys, self.values, self.cap, self._n, self._free = [], [], 0, 0, []
            else:
                heapq.heappush(self._free, i)

    @property
    def slots(self) -> int:
        """Slots the arrays hold now (>= the live slots)."""
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)

    def ensure(self, cap: int, kv_heads: int, k_dim: int, v_dim: int, dtype: mx.Dtype) -> None:
        """Make every slot handed out hold at least `cap` positions."""
        with self._lock:
            need_s = max(self._n, 1)
            if not self.keys:
                c = -(-cap // self.STEP) * self.STEP
                self.keys = [mx.zeros((need_s, kv_heads, c, k_dim), dtype)
                             for _ in range(self.n_layers)]
                self.values = [mx.zeros((need_s, kv_heads, c, v_dim), dtype)
                               for _ in range(self.n_layers)]
                self.cap = c
                return
            s = self.slots
            if need_s <= s and cap <= self.cap:
                return  # (no eval: a caller's pending writes stay queued with its forward)
            if need_s > s:  # more requests than slots: double
                add = max(need_s - s, s)
                self.keys = [mx.concatenate([k, mx.zeros((add, *k.shape[1:]), k.dtype)])
                             for k in self.keys]
                self.values = [mx.concatenate([v, mx.zeros((add, *v.shape[1:]), v.dtype)])
                               for v in self.values]
            if cap > self.cap:
                add = -(-(cap - self.cap) // self.STEP) * self.STEP
                self.keys = [mx.concatenate(
                    [k, mx.zeros((k.shape[0], k.shape[1], add, k.shape[3]), k.dtype)], axis=2)
                    for k in self.keys]
                self.values = [mx.concatenate(
                    [v, mx.zeros((v.shape[0], v.shape[1], add, v.shape[3]), v.dtype)], axis=2)
                    for v in self.values]
                self.cap += add
            mx.eval(self.keys, self.values)


class _Slot:
    """A request's slot in a `Slab`; freed when the last of its layer caches goes."""

    def __init__(self, slab: Slab, i: int) -> None:
        self.slab, self.i = slab, i
        weakref.finalize(self, slab._release, i)


class SlotCache(KVCache):
    """One layer of a request's KV cache, stored in its `Slab` slot. Behaves as mlx-lm's
    `KVCache` for `model(tokens, cache=...)` (prefill, the per-request path) and lets
    `forward` batch attention over all requests of a slab."""

    def __init__(self, slot: _Slot, layer: int) -> None:  # noqa: D107 (no KVCache buffers)
        self.slot, self.layer, self.offset = slot, layer, 0

    @property
    def keys(self) -> mx.array | None:  # type: ignore[override]
        s = self.slot.slab
        return s.keys[self.layer][self.slot.i:self.slot.i + 1, :, :self.offset] \
            if s.keys and self.offset else None

    @property
    def values(self) -> mx.array | None:  # type: ignore[override]
        s = self.slot.slab
        return s.values[self.layer][self.slot.i:self.slot.i + 1, :, :self.offset] \
            if s.values and self.offset else None

    def _write(self, keys: mx.array, values: mx.array, at: int) -> None:
        s, n = self.slot.slab, keys.shape[2]
        s.ensure(at + n, keys.shape[1], keys.shape[3], values.shape[3], keys.dtype)
        s.keys[self.layer][self.slot.i, :, at:at + n] = keys[0]
        s.values[self.layer][self.slot.i, :, at:at + n] = values[0]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._write(keys, values, self.offset)
        self.offset += keys.shape[2]
        return self.keys, self.values

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values

    @property
    def state(self) -> tuple:
        return self.keys, self.values, self.offset

    @state.setter
    def state(self, v: tuple) -> None:
        keys, values, offset = v
        self.offset = 0
        if offset:
            self._write(keys[..., :offset, :], values[..., :offset, :], 0)
        self.offset = offset

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        k, v = self.keys, self.values
        return 0 if k is None else k.nbytes + v.nbytes


_SLABS: dict[int, tuple[weakref.ref, Slab]] = {}  # id(model) -> (model, its slab)


def make_cache(model: nn.Module) -> list:
    """A request's per-layer caches: slots of the model's `Slab` when `forward` batches the
    model, else mlx-lm's own caches."""
    if not supports(model):
        return make_prompt_cache(model)
    model = _base(model)
    slab = slab_of(model)
    if slab is None:
        slab = Slab(len(_inner(model).layers))
        key = id(model)
        _SLABS[key] = (weakref.ref(model, lambda _: _SLABS.pop(key, None)), slab)
    slot = slab.alloc()
    return [SlotCache(slot, i) for i in range(slab.n_layers)]


def untrimmable(cache: list, horizon: int) -> str | None:
    """Why rejected proposals could not be trimmed from `cache` exactly within `horizon`
    positions, or None when they can: plain KV caches trim exactly (an offset moves back);
    a sliding-window cache only until its window wraps (then rejected keys stay in the ring);
    recurrent state (mlx-lm's `ArraysCache`, Mamba-style layers) and chunked caches not at
    all."""
    for c in cache:
        if isinstance(c, (SlotCache, QuantizedKVCache)) or type(c) is KVCache:
            continue
        if isinstance(c, RotatingKVCache):
            if horizon < c.max_size:
                continue
            return (f"sliding-window cache (window {c.max_size}) would wrap within "
                    f"{horizon} positions")
        return f"{type(c).__name__} (recurrent or chunked state) cannot be trimmed"
    return None


def slab_of(model: nn.Module) -> Slab | None:
    """The model's slab, when one was made (for metrics and tests)."""
    model = _base(model)
    entry = _SLABS.get(id(model))
    return entry[1] if entry is not None and entry[0]() is model else None


# Segments up to this many tokens attend in one batched call per layer (decode and verify
# rows); longer ones (prefill chunks) attend per request, where padding would cost more than
# the per-request operations.
BATCH_ATTENTION_MAX_T = 32


def _slab_segments(segments: Sequence[tuple[Sequence[int], list]]) -> Slab | None:
    """The slab every segment's cache lives in, when they share one and are short enough
    (and there are several: one request alone takes the per-request path, mlx-lm's own
    shapes, with no padding or gather to pay for)."""
    if len(segments) < 2:
        return None
    first = segments[0][1]
    if not first or not isinstance(first[0], SlotCache):
        return None
    slab = first[0].slot.slab
    seen: set[int] = set()
    for toks, cache in segments:
        if (len(toks) > BATCH_ATTENTION_MAX_T or not cache or not isinstance(cache[0], SlotCache)
                or cache[0].slot.slab is not slab or cache[0].slot.i in seen):
            return None
        seen.add(cache[0].slot.i)
    return slab


# A group of segments attending in one call costs about this many extra score elements (its
# own gathers, mask and attention operations per layer) beyond the elements it computes.
GROUP_OVERHEAD = 4096


def _groups(lens: Sequence[int], ends: Sequence[int], n_heads: int) -> list[list[int]]:
    """Split segments into groups that attend in one call each: rows are padded to the
    group's longest segment and keys to its furthest end, and every padded score costs an
    exp in the softmax, so one long segment (a run of forced tokens) should not widen all
    the others. Groups are runs of segments sorted by length; the split minimizes score
    elements plus `GROUP_OVERHEAD` per group (exact, by dynamic programming)."""
    order = sorted(range(len(lens)), key=lambda i: (lens[i], i))
    n = len(order)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        span = 0
        for i in range(j, 0, -1):  # group order[i-1:j]
            span = max(span, ends[order[i - 1]])
            c = best[i - 1] + n_heads * (j - i + 1) * lens[order[j - 1]] * span + GROUP_OVERHEAD
            if c < best[j]:
                best[j], cut[j] = c, i - 1
    groups, j = [], n
    while j > 0:
        groups.append(sorted(order[cut[j]:j], key=lambda i: i))
        j = cut[j]
    return groups[::-1]


def _attend_slab(inner: nn.Module, h: mx.array, segments, slab: Slab) -> mx.array:
    """Every layer over all segments: RoPE and the keys/values write over the real rows
    (each row at its own position), attention in one masked call per group of segments of
    similar length (`_groups`) over the group's slots. A group's rows are padded to its
    longest segment (a padded row repeats the segment's last row) and its keys to its
    furthest end; masking (finfo.min scores, zero weights) keeps each request's result
    equal to its attention alone on the reference BLAS (`tests/test_batching.py`)."""
    lens = [len(t) for t, _ in segments]
    slots = [c[0].slot.i for _, c in segments]
    offs = [c[0].offset for _, c in segments]
    ends = [o + n for o, n in zip(offs, lens)]
    a0 = inner.layers[0].self_attn
    n_heads, kv_heads = a0.n_heads, a0.n_kv_heads
    k_dim = a0.k_proj.weight.shape[0] // kv_heads
    v_dim = a0.v_proj.weight.shape[0] // kv_heads
    slab.ensure(max(ends), kv_heads, k_dim, v_dim, h.dtype)
    cap = slab.cap
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    n_rows = starts[-1]
    pos = mx.array([o + t for o, n in zip(offs, lens) for t in range(n)])  # (rows,)
    writes = mx.array([(s * kv_heads + hh) * cap + o + t for s, o, n in zip(slots, offs, lens)
                       for t in range(n) for hh in range(kv_heads)])  # row-major (row, head)
    plans, where, at = [], [0] * len(lens), 0  # where[i]: segment i's first output row
    for g in _groups(lens, ends, n_heads):
        tm, span = max(lens[i] for i in g), max(ends[i] for i in g)
        gs = [slots[i] for i in g]
        lo = min(gs)
        kv_at = slice(lo, lo + len(g)) if gs == list(range(lo, lo + len(g))) else mx.array(gs)
        q_rows = mx.array([starts[i] + min(t, lens[i] - 1) for i in g for t in range(tm)])
        qpos = np.array([[offs[i] + min(t, lens[i] - 1) for t in range(tm)] for i in g])
        mask = mx.array((np.arange(span)[None, None, :] <= qpos[:, :, None])[:, None])
        for j, i in enumerate(g):
            where[i] = at + j * tm
        plans.append((len(g), tm, span, kv_at, q_rows, mask))
        at += len(g) * tm
    back = None if len(plans) == 1 and at == n_rows else \
        mx.array([where[i] + t for i, n in enumerate(lens) for t in range(n)])
    for li, layer in enumerate(inner.layers):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q, k, v = a.q_proj(x)[0], a.k_proj(x)[0], a.v_proj(x)[0]  # (rows, *)
        q = a.rope(q.reshape(n_rows, n_heads, 1, k_dim), offset=pos)
        k = a.rope(k.reshape(n_rows, kv_heads, 1, k_dim), offset=pos)
        kf = slab.keys[li].reshape(-1, k_dim)
        vf = slab.values[li].reshape(-1, v_dim)
        kf[writes] = k.reshape(-1, k_dim)
        vf[writes] = v.reshape(-1, v_dim)
        slab.keys[li] = kf.reshape(-1, kv_heads, cap, k_dim)
        slab.values[li] = vf.reshape(-1, kv_heads, cap, v_dim)
        outs = []
        for nb, tm, span, kv_at, q_rows, mask in plans:
            qg = q[q_rows].reshape(nb, tm, n_heads, k_dim).transpose(0, 2, 1, 3)
            keys, values = slab.keys[li][kv_at, :, :span], slab.values[li][kv_at, :, :span]
            o = mx.fast.scaled_dot_product_attention(qg, keys, values, scale=a.scale,
                                                     mask=mask)
            outs.append(o.transpose(0, 2, 1, 3).reshape(nb * tm, -1))
        o = mx.concatenate(outs) if len(outs) > 1 else outs[0]
        h = h + a.o_proj((o if back is None else o[back])[None])
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    for (toks, cache) in segments:
        for c in cache:
            c.offset += len(toks)
    return h


from mlx_lm.models import llama as _llama  # noqa: E402

_LLAMA_BLOCK = _llama.TransformerBlock.__call__
_LLAMA_ATTN = _llama.Attention.__call__
