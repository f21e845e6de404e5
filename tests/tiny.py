"""Tiny random llamas with the real tokenizer's vocabulary: fast stand-ins for target/draft."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import llama

TOKENIZER_VOCAB = 49152
WIDTH = TOKENIZER_VOCAB + 13  # logits wider than the tokenizer, not a multiple of 32
EOS = (0, 2)


def tiny_llama(seed: int, width: int = WIDTH):
    """A 2-layer random llama; an untied, scaled head gives clear, seed-specific winners."""
    mx.random.seed(seed)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=width, num_key_value_heads=2, tie_word_embeddings=False)
    model = llama.Model(args)
    model.update({"lm_head": {"weight": model.lm_head.weight * 30}})
    mx.eval(model.parameters())
    return model


def drain(gen):
    """Run a step generator to the end: (tokens, finish reason)."""
    out = []
    while True:
        try:
            out.append(next(gen))
        except StopIteration as end:
            return out, end.value
