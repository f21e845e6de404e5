"""One forward pass over many requests' rows (ragged batching), batch-invariant by construction.

Each request contributes its own run of tokens (its verify rows: the last token plus its
proposals, or one token when decoding plainly, or a prefill chunk) and its own KV cache. The
weight matmuls (q/k/v/o projections, MLP, head) run once over all rows concatenated.

Storage (`make_cache`): a request's cache is a slot of its model's `Slab` (one keys and one
values array per layer for all requests) while it fits in `SLOT_POSITIONS` positions; a
request that may need more (its horizon says so, or it grows past the limit) has storage of
its own, freed when it leaves. A slab's capacity follows its longest live slot and shrinks
when that one leaves, so one long request never sizes every slot.

Attention: short segments (decode and verify rows) in the shared slab take RoPE and write
their new keys/values over their real rows, each row at its own position (one scatter per
layer), and attend in one masked call per group of similar-length segments over those
requests' slots, rows padded to the group's longest segment; the mask gives padded and
foreign positions finfo.min scores and so zero weight. Long segments (prefill chunks), and
caches of their own, take RoPE, the cache update and attention per request with exactly the
shapes they would have alone, in the same pass.

Batch invariance: a matmul computes each output row from that row alone on the reference
BLAS, its reductions run in a fixed order over the reduced axis and zero-weighted positions
add exact zeros, so a request's logits do not depend on its neighbours, on the padding, or on
where its neighbours' caches live (tests/test_batching.py and tests/test_kv_memory.py compare
them bitwise with mlx-lm's own forward alone).

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
from dataclasses import dataclass
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
            rows: Sequence[int] | None = None, mapped: bool = True,
            trees: Sequence[Sequence[int] | None] | None = None) -> list[mx.array | None]:
    """Logits for every request's rows, in one pass.

    Args:
        model: any mlx-lm model; batched when `supports(model)`, else one call per segment.
        segments: (token ids (non-empty), that request's per-layer KV caches), one per request;
            each cache is advanced by its tokens, as `model(tokens, cache)` would.
        rows: how many trailing rows of each segment need logits (default: all); 0 (a
            prefill chunk) skips the head for that segment.
        mapped: False: a pruned-vocabulary draft's own logits (`raw`), not target-width.
        trees: per segment, None (its rows are a sequence: row t at position offset + t,
            attending to every row before it) or a token tree: the parent row of each row
            (-1 for row 0; a parent before its child). Row t then sits at position offset +
            its depth and attends to the cache and its own ancestors only, so its logits are
            those of its branch decoded as a sequence; its keys and values are stored at
            offset + t all the same (`keep_rows` moves an accepted branch together).
            Only for models `supports` batches.
    Returns:
        one (rows_i, V) logits array per segment (None where rows_i is 0).
    """
    rows = [len(t) for t, _ in segments] if rows is None else list(rows)
    trees = list(trees) if trees is not None and any(t is not None for t in trees) else None
    base = _base(model)
    if base is not model and supports(base):
        out = forward(base, [(model.map_ids(t), c) for t, c in segments], rows, trees=trees)
        return [x if x is None or not mapped else model.map_logits(x) for x in out]
    if trees is not None and not supports(model):
        raise ValueError(f"{type(model).__name__}: token trees need the batched layout")
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
    _reserve(segments, _kv_dims(inner, h.dtype))  # no storage changes shape during the pass
    batched = _batched(segments)
    plan = _plan(inner, segments, batched, trees) if batched else None
    # Alone, a tree's rows take RoPE at their depths and attend under its mask (`_visible`).
    alone_tree: dict[int, tuple[mx.array, mx.array]] = {}
    for i in set(range(len(segments))) - set(batched):
        if trees is not None and trees[i] is not None:
            off = segments[i][1][0].offset
            alone_tree[i] = (mx.array((off + depths(trees[i])).astype(np.int32)),
                             mx.array(_visible(off, lens[i], trees[i], lens[i],
                                               off + lens[i]))[None, None])
    alone = sorted(set(range(len(segments))) - set(batched))
    # Attention output rows: the batched call's (padded, `plan.where`), then each alone
    # segment's; `back` puts the real rows in segment order for o_proj.
    order = [0] * bounds[-1]
    at = plan.n_out if plan is not None else 0
    for j, i in enumerate(batched):
        for t in range(lens[i]):
            order[bounds[i] + t] = plan.where[j] + t
    for i in alone:
        for t in range(lens[i]):
            order[bounds[i] + t] = at + t
        at += lens[i]
    back = None if order == list(range(bounds[-1])) and at == bounds[-1] else mx.array(order)
    for li, layer in enumerate(inner.layers):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)  # (1, N, *)
        outs = [] if plan is None else [_attend_batched(a, li, q[0], k[0], v[0], plan)]
        for i in alone:
            s, e = bounds[i], bounds[i + 1]
            c = segments[i][1][li]
            vi = v[:, s:e].reshape(1, e - s, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
            if i in alone_tree:
                pos, mask = alone_tree[i]
                qi = a.rope(q[0, s:e].reshape(e - s, a.n_heads, 1, -1), offset=pos)
                ki = a.rope(k[0, s:e].reshape(e - s, a.n_kv_heads, 1, -1), offset=pos)
                qi = qi.reshape(1, e - s, a.n_heads, -1).transpose(0, 2, 1, 3)
                ki = ki.reshape(1, e - s, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
                ki, vi = c.update_and_fetch(ki, vi)
            else:
                qi = q[:, s:e].reshape(1, e - s, a.n_heads, -1).transpose(0, 2, 1, 3)
                ki = k[:, s:e].reshape(1, e - s, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
                qi = a.rope(qi, offset=c.offset)
                ki = a.rope(ki, offset=c.offset)
                ki, vi = c.update_and_fetch(ki, vi)
                mask = create_attention_mask(x[:, s:e], c)
            o = scaled_dot_product_attention(qi, ki, vi, cache=c, scale=a.scale, mask=mask)
            outs.append(o.transpose(0, 2, 1, 3).reshape(e - s, -1))
        o = mx.concatenate(outs) if len(outs) > 1 else outs[0]  # (rows out, n_heads * v_dim)
        h = h + a.o_proj((o if back is None else o[back])[None])
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    for i in batched:
        for c in segments[i][1]:
            c.offset += lens[i]
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


# Positions a slot of a model's shared slab may hold. A request whose horizon is longer
# gets storage of its own (so does one that grows past it), so the slab, sized by its longest
# live slot, holds at most slots x this many positions (8 slots of the embedded model, 46 KB
# a position: 755 MB). A request that long does most of its attention work on its own keys
# anyway, so attending alone (a few more calls per layer) costs it little.
SLOT_POSITIONS = 2048

Dims = tuple[int, int, int, mx.Dtype]  # (kv_heads, k_dim, v_dim, dtype) of a model's KV


def _round(n: int, step: int) -> int:
    return -(-n // step) * step


class Slab:
    """KV storage for the requests of one model: per layer, keys and values of shape
    (slots, kv_heads, capacity, head_dim); a request owns one slot (`SlotCache` per layer).

    One array per layer lets `forward` update and attend over every request's cache with a
    constant number of operations per layer, however many requests share the round. Slots are
    taken lowest first, so active requests sit in a dense range. Each slot's need is the most
    positions it has held; capacity grows in steps of 256 positions to the longest live
    need and shrinks back (`fit`, before each `forward` pass) once that is at most half of
    it; slots double when all are taken and halve once the upper half is free. All memory is
    released when the last slot is freed.

    A model's shared slab takes slots of up to `max_positions` positions (None: no limit).
    Storage of a request's own (`own`, made by `spawn`) is a slab of one slot that takes an
    eighth more than it needs each time it grows (bounded copying while a long prompt is
    prefilled), never past its `horizon` when one is known, and is freed with its request.

    Not for concurrent decoding threads on one model (one decode thread owns it); slots may
    be freed from any thread (their caches' finalizers).
    """

    STEP = 256

    def __init__(self, n_layers: int, max_positions: int | None = None, *, own: bool = False,
                 horizon: int | None = None) -> None:
        self.n_layers = n_layers
        self.max_positions, self.own, self.horizon = max_positions, own, horizon
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        self.cap = 0
        self._n = 0  # slot ids handed out so far (ids < _n are live or in _free)
        self._free: list[int] = []
        self._need: dict[int, int] = {}  # live slot id -> most positions it has held
        self._spawned: weakref.WeakSet[Slab] = weakref.WeakSet()
        self._lock = threading.RLock()

    def alloc(self) -> _Slot:
        with self._lock:
            if self._free:
                i = heapq.heappop(self._free)
            else:
                i, self._n = self._n, self._n + 1
            self._need[i] = 0
            return _Slot(self, i)

    def spawn(self, horizon: int | None = None) -> Slab:
        """Storage of its own for one request of this slab's model (counted in `kv_nbytes`)."""
        own = Slab(self.n_layers, own=True, horizon=horizon)
        self._spawned.add(own)
        return own

    def _release(self, i: int) -> None:
        with self._lock:
            del self._need[i]
            if not self._need:  # nobody left: give the memory back
                self.keys, self.values, self.cap, self._n, self._free = [], [], 0, 0, []
            else:
                heapq.heappush(self._free, i)

    def _note(self, i: int, end: int) -> None:
        with self._lock:
            self._need[i] = max(self._need[i], end)

    @property
    def slots(self) -> int:
        """Slots the arrays hold now (>= the live slots)."""
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def live(self) -> int:
        """Slots held by requests now."""
        return len(self._need)

    @property
    def need(self) -> int:
        """The longest live slot's need: the most positions it has held."""
        with self._lock:
            return max(self._need.values(), default=0)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)

    def ensure(self, cap: int, kv_heads: int, k_dim: int, v_dim: int, dtype: mx.Dtype) -> None:
        """Make every slot handed out hold at least `cap` positions (grows, never shrinks)."""
        with self._lock:
            need_s = max(self._n, 1)
            if not self.keys:
                c = self._grown(cap)
                self.keys = [mx.zeros((need_s, kv_heads, c, k_dim), dtype)
                             for _ in range(self.n_layers)]
                self.values = [mx.zeros((need_s, kv_heads, c, v_dim), dtype)
                               for _ in range(self.n_layers)]
                self.cap = c
                return
            s = self.slots
            if need_s <= s and cap <= self.cap:
                return  # (no eval: a caller's pending writes stay queued with its forward)
            self._resize(s if need_s <= s else max(need_s, 2 * s),  # more requests: double
                         self._grown(cap) if cap > self.cap else self.cap)

    def fit(self) -> None:
        """Give back what the live slots no longer need: capacity down to the longest live
        need (rounded up to a step) once that is at most half of it, slots down to the
        highest live one once the upper half is free. What stays is copied into new arrays
        (a slice would keep the old ones alive); `forward` calls this before its pass, so
        a slab never changes shape during one."""
        with self._lock:
            if not self.keys or not self._need:
                return
            cap = _round(max(max(self._need.values()), 1), self.STEP)
            top = max(self._need) + 1
            cap = cap if 2 * cap <= self.cap else self.cap
            slots = top if 2 * top <= self.slots else self.slots
            if (slots, cap) == (self.slots, self.cap):
                return
            self._resize(slots, cap)
            self._free = [i for i in self._free if i < slots]
            heapq.heapify(self._free)
            self._n = min(self._n, slots)

    def _grown(self, cap: int) -> int:
        if not self.own:
            return _round(cap, self.STEP)
        c = _round(cap + cap // 8, self.STEP)  # one request: an eighth more, up to its horizon
        if self.horizon is not None:
            c = min(c, max(_round(cap, self.STEP), _round(self.horizon, self.STEP)))
        return c

    def _resize(self, slots: int, cap: int) -> None:
        def resized(a: mx.array) -> mx.array:
            b = a[:slots, :, :cap]
            if b.shape[0] == a.shape[0] and b.shape[2] == a.shape[2]:
                b = a
            elif b.shape[0] < a.shape[0] or b.shape[2] < a.shape[2]:
                b = mx.contiguous(b)  # its own buffer: the old one is freed
            if b.shape[0] < slots:
                b = mx.concatenate([b, mx.zeros((slots - b.shape[0], *b.shape[1:]), b.dtype)])
            if b.shape[2] < cap:
                b = mx.concatenate([b, mx.zeros((b.shape[0], b.shape[1], cap - b.shape[2],
                                                 b.shape[3]), b.dtype)], axis=2)
            return b

        self.keys = [resized(k) for k in self.keys]
        self.values = [resized(v) for v in self.values]
        self.cap = cap
        mx.eval(self.keys, self.values)


class _Slot:
    """A request's slot in a `Slab`; freed when the last of its layer caches goes."""

    def __init__(self, slab: Slab, i: int) -> None:
        self.slab, self.i = slab, i
        self._fin = weakref.finalize(self, slab._release, i)

    def note(self, end: int) -> None:
        """Record that the slot holds `end` positions; past its slab's limit it moves to
        storage of its own first."""
        limit = self.slab.max_positions
        if limit is not None and end > limit:
            self._move_own()
        self.slab._note(self.i, end)

    def reserve(self, end: int, dims: Dims) -> None:
        """`note`, then make the slot's slab hold `end` positions."""
        self.note(end)
        self.slab.ensure(end, *dims)

    def _move_own(self) -> None:
        old, i = self.slab, self.i
        own = old.spawn()
        with old._lock:
            n = old._need[i]
            if old.keys and n:
                c = _round(n, Slab.STEP)  # <= old.cap, a multiple of the step
                own.keys = [mx.contiguous(k[i:i + 1, :, :c]) for k in old.keys]
                own.values = [mx.contiguous(v[i:i + 1, :, :c]) for v in old.values]
                own.cap = c
                mx.eval(own.keys, own.values)
        own._n, own._need = 1, {0: n}
        self._fin.detach()
        self.slab, self.i = own, 0
        self._fin = weakref.finalize(self, own._release, 0)
        old._release(i)


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
        n = keys.shape[2]
        self.slot.reserve(at + n, (keys.shape[1], keys.shape[3], values.shape[3], keys.dtype))
        s = self.slot.slab  # (after reserve: the slot may have moved to storage of its own)
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


def make_cache(model: nn.Module, horizon: int | None = None) -> list:
    """A request's per-layer caches: when `forward` batches the model, a slot of the model's
    shared `Slab` or, for a request that may need more than a slot holds, storage of its
    own; else mlx-lm's own caches.

    Args:
        model: any mlx-lm model (or a pruned-vocabulary draft wrapping one).
        horizon: the most positions the request can ever hold (prompt + max_tokens + its
            proposals); above the slab's `max_positions` (`SLOT_POSITIONS`) the request gets
            storage of its own. None: unknown (a slot, moved to storage of its own should it
            grow past the limit).
    Returns:
        one cache per layer, for `forward` or `model(tokens, cache=...)`.
    """
    if not supports(model):
        return make_prompt_cache(model)
    model = _base(model)
    slab = slab_of(model)
    if slab is None:
        slab = Slab(len(_inner(model).layers), SLOT_POSITIONS)
        key = id(model)
        _SLABS[key] = (weakref.ref(model, lambda _: _SLABS.pop(key, None)), slab)
    own = horizon is not None and slab.max_positions is not None and horizon > slab.max_positions
    slot = (slab.spawn(horizon) if own else slab).alloc()
    return [SlotCache(slot, i) for i in range(slab.n_layers)]


def kv_bytes_per_position(model: nn.Module) -> int:
    """Bytes one position of a request's KV cache takes: every layer's keys and values
    (layers x kv_heads x (k_dim + v_dim) x the activation dtype's size), what one token of a
    KV budget costs. Exact for models `forward` batches; for others an estimate from
    `model.args` (an upper bound where some layers keep no or windowed KV).

    Raises:
        TypeError: a model whose attention layout is not known here.
    """
    base = _base(model)
    inner = _inner(base)
    if supports(base):
        kv_heads, k_dim, v_dim, dtype = _kv_dims(inner, _act_dtype(inner))
        return len(inner.layers) * kv_heads * (k_dim + v_dim) * dtype.size
    args = getattr(base, "args", None)
    try:
        heads = args.num_attention_heads
        kv_heads = getattr(args, "num_key_value_heads", None) or heads
        head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
        layers = args.num_hidden_layers
        dtype = _act_dtype(inner)
    except AttributeError as e:
        raise TypeError(f"{type(base).__name__}: KV layout unknown ({e})") from None
    return layers * kv_heads * 2 * head_dim * dtype.size


def kv_nbytes(model: nn.Module) -> int:
    """Bytes of KV storage `model`'s requests hold now: its shared slab and the storage of
    their own (0 before the first request, or for a model `forward` does not batch)."""
    slab = slab_of(model)
    return 0 if slab is None else slab.nbytes + sum(s.nbytes for s in list(slab._spawned))


def _act_dtype(inner: nn.Module) -> mx.Dtype:
    emb = inner.embed_tokens  # a quantized embedding computes in its scales' dtype
    return getattr(emb, "scales", emb.weight).dtype


def _kv_dims(inner: nn.Module, dtype: mx.Dtype) -> Dims:
    a = inner.layers[0].self_attn
    kv = a.n_kv_heads
    return kv, a.k_proj.weight.shape[0] // kv, a.v_proj.weight.shape[0] // kv, dtype


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


def exact_prefix(cache: list) -> bool:
    """Whether every layer of `cache` holds plain per-position keys and values, so a state
    cut back to its first n positions is exactly the state of those n tokens (a stored
    prompt's shared prefix, `PromptKVCache.restore_prefix`)."""
    return all(isinstance(c, (SlotCache, QuantizedKVCache)) or type(c) is KVCache
               for c in cache)


_LOCKS: dict[int, threading.Lock] = {}  # id(base model) -> the lock of its forwards
_LOCKS_GUARD = threading.Lock()


def model_lock(model: nn.Module) -> threading.Lock:
    """The lock a round over `model` holds (`scheduler.Scheduler.pump`): the model's slab is
    shared by every engine over it (a server's and a library user's, or a test's), so one
    thread at a time runs its forwards. Uncontended where one engine serves the model."""
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(id(_base(model)), threading.Lock())


def model_locks(*models: nn.Module | None) -> list[threading.Lock]:
    """The locks of a round over these models (`model_lock`): one per model underneath them
    (a draft that wraps its target's shares its lock), in one order for every caller."""
    bases = {id(_base(m)): m for m in models if m is not None}
    return [model_lock(bases[k]) for k in sorted(bases)]


def slab_of(model: nn.Module) -> Slab | None:
    """The model's slab, when one was made (for metrics and tests)."""
    model = _base(model)
    entry = _SLABS.get(id(model))
    return entry[1] if entry is not None and entry[0]() is model else None


# Segments up to this many tokens attend in one batched call per layer (decode and verify
# rows); longer ones (prefill chunks) attend per request, where padding would cost more than
# the per-request operations.
BATCH_ATTENTION_MAX_T = 32


def _reserve(segments: Sequence[tuple[Sequence[int], list]], dims: Dims) -> None:
    """Room for every segment's new positions before the pass, so that no slab changes shape
    during it: a slot that would outgrow its slab's limit moves to storage of its own, and
    each slab in the pass gives back what its live slots no longer need (`Slab.fit`), then
    grows to what this pass needs."""
    ends: dict[int, tuple[Slab, int]] = {}
    for toks, cache in segments:
        c = cache[0] if cache else None
        if isinstance(c, SlotCache):
            c.slot.note(c.offset + len(toks))
            slab = c.slot.slab
            end = max(ends.get(id(slab), (slab, 0))[1], c.offset + len(toks))
            ends[id(slab)] = (slab, end)
    for slab, end in ends.values():
        slab.fit()
        slab.ensure(end, *dims)


def _batched(segments: Sequence[tuple[Sequence[int], list]]) -> list[int]:
    """Indices of the segments that attend in one batched call: the short ones whose caches
    are slots of one shared slab (one segment per slot). [] when fewer than two: one request
    alone takes the per-request path, mlx-lm's own shapes, with no padding or gather to pay
    for. The others (long segments, storage of their own) attend per request."""
    slab, out, seen = None, [], set()
    for i, (toks, cache) in enumerate(segments):
        c = cache[0] if cache else None
        if not isinstance(c, SlotCache) or c.slot.slab.own or len(toks) > BATCH_ATTENTION_MAX_T:
            continue
        slab = slab or c.slot.slab
        if c.slot.slab is slab and c.slot.i not in seen:
            seen.add(c.slot.i)
            out.append(i)
    return out if len(out) > 1 else []


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


@dataclass
class _Plan:
    """The batched segments' attention, laid out once for every layer (`_plan`)."""

    slab: Slab
    rows: mx.array | None  # their rows among all the pass's rows (None: every row, in order)
    pos: mx.array  # (rows,) each row's position
    writes: mx.array  # flat (slot, head, position) index of each row's keys/values
    groups: list[tuple[int, int, int, Any, mx.array, mx.array]]
    where: list[int]  # each segment's first output row
    n_out: int  # output rows, padding included
    n_rows: int
    n_heads: int
    kv_heads: int
    k_dim: int
    v_dim: int


def depths(tree: Sequence[int]) -> np.ndarray:
    """Each row's depth in a token tree (parents, -1 for the root row)."""
    d = np.zeros(len(tree), dtype=np.int32)
    for r, p in enumerate(tree):
        if p >= r:
            raise ValueError(f"token tree: row {r}'s parent {p} does not come before it")
        d[r] = 0 if p < 0 else d[p] + 1
    return d


def _visible(off: int, n: int, tree: Sequence[int] | None, tm: int, span: int) -> np.ndarray:
    """(tm, span) bool: the cache positions each of a segment's rows attends to (rows past its
    n repeat its last): a sequence's rows see every position up to their own; a tree's see
    the cache before the segment and their own ancestors' positions (and their own)."""
    t = np.minimum(np.arange(tm), n - 1)
    if tree is None:
        return np.arange(span)[None, :] <= (off + t)[:, None]
    vis = np.zeros((tm, span), dtype=bool)
    vis[:, :off] = True
    for j, r in enumerate(t):
        while r >= 0:
            vis[j, off + r] = True
            r = tree[r]
    return vis


def keep_rows(cache: list, start: int, keep: Sequence[int]) -> None:
    """After a token tree's forward: the keys and values of the kept rows (a branch, rows by
    index from `start`, ascending) moved to start, start + 1, ... (the branch as a sequence
    holds them; their RoPE positions are already those). Trim the rest afterwards."""
    k0 = next((k for k, r in enumerate(keep) if r != k), None)
    if k0 is None:
        return
    src = mx.array([start + r for r in keep[k0:]])
    for c in cache:
        if not isinstance(c, SlotCache):
            raise TypeError(f"{type(c).__name__}: token trees need slab caches")
        slab, i = c.slot.slab, c.slot.i
        keys = slab.keys[c.layer][i:i + 1, :, src]
        values = slab.values[c.layer][i:i + 1, :, src]
        c._write(keys, values, start + k0)


def _plan(inner: nn.Module, segments, batched: Sequence[int],
          trees: Sequence[Sequence[int] | None] | None = None) -> _Plan:
    """Rows, positions, writes and attention groups (`_groups`) of the batched segments. A
    group's rows are padded to its longest segment (a padded row repeats the segment's last
    row) and its keys to its furthest end; masking (finfo.min scores, zero weights) keeps
    each request's result equal to its attention alone on the reference BLAS."""
    first = [0]
    for toks, _ in segments:
        first.append(first[-1] + len(toks))
    segs = [segments[i] for i in batched]
    tree_of = [None if trees is None else trees[i] for i in batched]
    slab = segs[0][1][0].slot.slab
    lens = [len(t) for t, _ in segs]
    slots = [c[0].slot.i for _, c in segs]
    offs = [c[0].offset for _, c in segs]
    ends = [o + n for o, n in zip(offs, lens)]
    a0 = inner.layers[0].self_attn
    n_heads, kv_heads = a0.n_heads, a0.n_kv_heads
    _, k_dim, v_dim, _ = _kv_dims(inner, mx.float32)
    cap = slab.cap
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    rows = None if list(batched) == list(range(len(segments))) else \
        mx.array([first[i] + t for i in batched for t in range(len(segments[i][0]))])
    pos = mx.array(np.concatenate([o + (np.arange(n) if tr is None else depths(tr))
                                   for o, n, tr in zip(offs, lens, tree_of)]
                                  ).astype(np.int32))  # (rows,) each row's position
    writes = mx.array([(s * kv_heads + hh) * cap + o + t for s, o, n in zip(slots, offs, lens)
                       for t in range(n) for hh in range(kv_heads)])  # row-major (row, head)
    groups, where, at = [], [0] * len(lens), 0  # where[j]: segment j's first output row
    for g in _groups(lens, ends, n_heads):
        tm, span = max(lens[i] for i in g), max(ends[i] for i in g)
        gs = [slots[i] for i in g]
        lo = min(gs)
        kv_at = slice(lo, lo + len(g)) if gs == list(range(lo, lo + len(g))) else mx.array(gs)
        q_rows = mx.array([starts[i] + min(t, lens[i] - 1) for i in g for t in range(tm)])
        mask = mx.array(np.stack([_visible(offs[i], lens[i], tree_of[i], tm, span)
                                  for i in g])[:, None])
        for j, i in enumerate(g):
            where[i] = at + j * tm
        groups.append((len(g), tm, span, kv_at, q_rows, mask))
        at += len(g) * tm
    return _Plan(slab, rows, pos, writes, groups, where, at, starts[-1], n_heads, kv_heads,
                 k_dim, v_dim)


def _attend_batched(a: nn.Module, li: int, q: mx.array, k: mx.array, v: mx.array,
                    p: _Plan) -> mx.array:
    """Layer `li`'s attention for the batched segments: RoPE and the keys/values write over
    their real rows (each row at its own position), then one masked call per group over the
    group's slots. q, k, v: (N, *) projections of every row of the pass. Returns
    (p.n_out, n_heads * v_dim), padded rows included."""
    if p.rows is not None:
        q, k, v = q[p.rows], k[p.rows], v[p.rows]
    q = a.rope(q.reshape(p.n_rows, p.n_heads, 1, p.k_dim), offset=p.pos)
    k = a.rope(k.reshape(p.n_rows, p.kv_heads, 1, p.k_dim), offset=p.pos)
    slab, cap = p.slab, p.slab.cap
    kf = slab.keys[li].reshape(-1, p.k_dim)
    vf = slab.values[li].reshape(-1, p.v_dim)
    kf[p.writes] = k.reshape(-1, p.k_dim)
    vf[p.writes] = v.reshape(-1, p.v_dim)
    slab.keys[li] = kf.reshape(-1, p.kv_heads, cap, p.k_dim)
    slab.values[li] = vf.reshape(-1, p.kv_heads, cap, p.v_dim)
    outs = []
    for nb, tm, span, kv_at, q_rows, mask in p.groups:
        qg = q[q_rows].reshape(nb, tm, p.n_heads, p.k_dim).transpose(0, 2, 1, 3)
        keys, values = slab.keys[li][kv_at, :, :span], slab.values[li][kv_at, :, :span]
        o = mx.fast.scaled_dot_product_attention(qg, keys, values, scale=a.scale, mask=mask)
        outs.append(o.transpose(0, 2, 1, 3).reshape(nb * tm, -1))
    return mx.concatenate(outs) if len(outs) > 1 else outs[0]


from mlx_lm.models import llama as _llama  # noqa: E402

_LLAMA_BLOCK = _llama.TransformerBlock.__call__
_LLAMA_ATTN = _llama.Attention.__call__
