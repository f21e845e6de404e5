"""One forward pass over many requests' rows (ragged batching), batch-invariant by construction.

Each request contributes its own run of tokens (its verify rows: the last token plus its
proposals, or one token when decoding plainly, or a prefill chunk) and its own KV cache. The
weight matmuls (q/k/v/o projections, MLP, head) run once over all rows concatenated; RoPE,
the cache update and attention run per request over its own cache, with exactly the shapes it
would have alone. A matmul computes each output row from that row alone on the reference BLAS,
so a request's logits do not depend on its neighbours (tests/test_ragged.py measures it).

Supported: mlx-lm's llama-family `Model` classes (llama, mistral, qwen2 and others with the
same block layout). `supports(model)` says whether a model can be batched this way; others run
one request per forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention


def _inner(model: nn.Module) -> Any:
    return getattr(model, "model", None)


def supports(model: nn.Module) -> bool:
    """Whether `model` has the llama block layout `forward` batches over."""
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
            rows: Sequence[int] | None = None) -> list[mx.array | None]:
    """Logits for every request's rows, in one pass.

    Args:
        model: any mlx-lm model; batched when `supports(model)`, else one call per segment.
        segments: (token ids (non-empty), that request's per-layer KV caches), one per request;
            each cache is advanced by its tokens, as `model(tokens, cache)` would.
        rows: how many trailing rows of each segment need logits (default: all); 0 (a
            prefill chunk) skips the head for that segment.
    Returns:
        one (rows_i, V) logits array per segment (None where rows_i is 0).
    """
    rows = [len(t) for t, _ in segments] if rows is None else list(rows)
    if not supports(model):
        out: list[mx.array | None] = []
        for (toks, cache), r in zip(segments, rows):
            logits = model(mx.array([list(toks)], dtype=mx.int32), cache=cache)[0]
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
    for li, layer in enumerate(inner.layers):
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


from mlx_lm.models import llama as _llama  # noqa: E402

_LLAMA_BLOCK = _llama.TransformerBlock.__call__
_LLAMA_ATTN = _llama.Attention.__call__
