"""Tiny random llamas with the real tokenizer's vocabulary: fast stand-ins for target/draft."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import llama

TOKENIZER_VOCAB = 49152
WIDTH = TOKENIZER_VOCAB + 13  # logits wider than the tokenizer, not a multiple of 32
EOS = (0, 2)


def tiny_llama(seed: int, width: int = WIDTH, head_scale: float = 30):
    """A 2-layer random llama; an untied, scaled head gives clear, seed-specific winners (a
    smaller `head_scale`: the same ranking as the seed's, with less sure probabilities)."""
    mx.random.seed(seed)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=width, num_key_value_heads=2, tie_word_embeddings=False)
    model = llama.Model(args)
    model.update({"lm_head": {"weight": model.lm_head.weight * head_scale}})
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


def rounds(models, prompt, *, max_tokens, eos_token_ids=EOS, params=None, matcher=None,
           spec=None, timings=None, kv_store=None, suffixes=None, suffix_key=None,
           closing=None):
    """One request decoded alone through the core (`core.new_state`, `prefill`, then
    `run_round` until it ends): yields its tokens (EOS never yielded), returns the finish
    reason; raises the request's GrammarStateError. `timings` collects its counters.
    `closing`: the budget rule's closing order (`budget.ClosingOrder`): the request closes
    its document in time (its minimum measured here)."""
    from specdec.budget import Closing, need
    from specdec.core import new_state, prefill, run_round
    from specdec.prepare import Request
    from specdec.sampling import SamplingParams
    from specdec.speculative import SpecStats

    stats = SpecStats()
    minimum = None if closing is None or matcher is None else need(matcher, closing)
    req = Request(tuple(prompt), sampling=params or SamplingParams(), max_tokens=max_tokens,
                  spec=spec, closing=None if minimum is None else Closing(closing, minimum))
    s = new_state(models, req, eos_token_ids, matcher=matcher, stats=stats,
                  suffixes=suffixes, suffix_key=suffix_key)
    try:
        prefill(models, s, kv_store)
        while True:
            run_round(models, [s])
            yield from s.new_tokens
            if s.error is not None:
                raise s.error
            if s.finish is not None:
                return s.finish
    finally:
        s.release()
        if timings is not None:
            for name in ("prefill_s", "mask_s", "wait_s", "steps"):
                setattr(timings, name, getattr(stats, name))
            if isinstance(timings, SpecStats):
                timings.__dict__.update(stats.__dict__)


def plain_steps(model, prompt, *, vocab_size=WIDTH, **kw):
    """`rounds` with no proposer (plain decoding) on one model."""
    from specdec.core import Models

    return rounds(Models(model, vocab_size), prompt, **kw)


def spec_steps(target, draft, prompt, *, vocab_size=WIDTH, draft_vocab_size=WIDTH,
               spec=None, stats=None, **kw):
    """`rounds` with speculation (`spec`, default SpecConfig()) over target and draft."""
    from specdec.core import Models
    from specdec.speculative import SpecConfig

    return rounds(Models(target, vocab_size, draft, draft_vocab_size), prompt,
                  spec=spec or SpecConfig(), timings=stats, **kw)
