"""The plain constrained decode loop: a pure step generator over token ids.

One target forward per token. Each step: the request's llguidance bitmask is filled on the
host while the device computes the forward pass (async eval), then applied on the device,
then the sampler picks, then the matcher consumes. The generator knows nothing of text,
stop strings or HTTP; `engine.py` wraps it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Literal

import llguidance.numpy as llnp
import mlx.core as mx
import mlx.nn as nn
from llguidance import LLMatcher
from mlx_lm.models.cache import make_prompt_cache

from .sampling import SamplingParams, apply_mask, pick, position_noise, unpack_bitmask

FinishReason = Literal["stop", "length"]
TokenId = int
PREFILL_CHUNK = 512


class GrammarStateError(RuntimeError):
    """The request's matcher entered an error state mid-generation; decoding stops (fail
    closed). An internal fault, not bad input: the grammar compiled and every token fed to it
    was allowed by its own mask.

    `str(e)` is one line; llguidance's full report (parser state, grammar) is in `detail`.

    Attributes:
        position: output tokens emitted before the failing one (None when not known).
        detail: llguidance's error text, multi-line.
    """

    def __init__(self, reason: str, *, position: int | None = None, detail: str = "") -> None:
        where = f" at output token {position}" if position is not None else ""
        first = detail.strip().splitlines()[0] if detail.strip() else ""
        super().__init__(f"{reason}{where}" + (f": {first}" if first else ""))
        self.position = position
        self.detail = detail


@dataclass
class StepTimings:
    """Accumulated host-side timings of one decode (seconds). Mutable accumulator.

    Attributes:
        prefill_s: prompt forward, until its logits were ready.
        mask_s: llguidance mask fill on the host (overlaps the device forward).
        wait_s: host blocked waiting for the device to produce the sampled token.
        steps: decode steps run.
    """

    prefill_s: float = 0.0
    mask_s: float = 0.0
    wait_s: float = 0.0
    steps: int = 0


def prefill(model: nn.Module, prompt: Sequence[TokenId], cache: list, chunk: int = PREFILL_CHUNK
            ) -> mx.array:
    """Run the prompt through the model in chunks; returns the last position's logits (V,)."""
    if not prompt:
        raise ValueError("prompt must contain at least one token")
    ids = mx.array(list(prompt), dtype=mx.int32)[None]  # (1, T)
    for start in range(0, ids.shape[1] - chunk, chunk):
        model(ids[:, start:start + chunk], cache=cache)
        mx.eval([c.state for c in cache])
    last = ((ids.shape[1] - 1) // chunk) * chunk
    return model(ids[:, last:], cache=cache)[0, -1]  # (V,)


class PromptKVCache:
    """LRU of prefilled prompts: (model, token ids) → KV state and last-position logits.

    Repeated prompts (a shared system prompt, retries, the same request plain and
    speculative) skip their prefill. A restored state is bit-identical to recomputing it, so
    outputs do not change. Not thread-safe: owned by the engine's decode thread.
    """

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, tuple[int, ...]], tuple[nn.Module, list, mx.array]]
        self._entries = OrderedDict()
        self.hits = 0

    def prefill(self, model: nn.Module, prompt: Sequence[TokenId], cache: list) -> mx.array:
        """Like `prefill`, restoring a stored state when this model saw this prompt."""
        key = (id(model), tuple(prompt))
        entry = self._entries.get(key)
        if entry is not None and entry[0] is model:
            self._entries.move_to_end(key)
            self.hits += 1
            for c, state in zip(cache, entry[1]):
                c.state = _copy_state(state)  # fresh objects: decoding never writes the store
            return entry[2]
        logits = prefill(model, prompt, cache)
        mx.eval(logits, [c.state for c in cache])
        if self.capacity > 0:
            self._entries[key] = (model, [_copy_state(c.state) for c in cache], logits)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return logits


def _copy_state(state: tuple) -> tuple:
    return tuple(mx.array(a) if isinstance(a, mx.array) else a for a in state)


def check_matcher(matcher: LLMatcher, position: int | None = None) -> None:
    """Raise GrammarStateError when the matcher has entered its error state.

    Args:
        position: output tokens emitted so far (reported in the error).
    """
    if matcher.is_error():
        raise GrammarStateError("grammar entered an error state", position=position,
                                detail=matcher.get_error())


def decode_steps(model: nn.Module, prompt: Sequence[TokenId], *, vocab_size: int,
                 eos_token_ids: Sequence[TokenId], max_tokens: int,
                 matcher: LLMatcher | None = None, params: SamplingParams = SamplingParams(),
                 timings: StepTimings | None = None, kv_store: PromptKVCache | None = None
                 ) -> Generator[TokenId, None, FinishReason]:
    """Yield generated token ids (EOS never yielded); return the finish reason.

    Args:
        model: mlx-lm model, `model(tokens (1, T), cache) -> (1, T, V)`.
        prompt: prompt token ids (non-empty).
        vocab_size: logits width V.
        eos_token_ids: ids that end the output.
        max_tokens: most tokens to generate (>= 1).
        matcher: the request's llguidance matcher (advanced in place), or None.
        params: sampling parameters; a seed is required when sampling.
        timings: accumulator for host timings.
        kv_store: where prefilled prompts are kept for reuse (None: always prefill).
    Returns:
        "stop" on EOS or when the grammar is complete, "length" when max_tokens ran out.
    Raises:
        GrammarStateError: the matcher errored; no token is emitted past that point.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: must be >= 1")
    if not params.greedy and params.seed is None:
        raise ValueError("sampling (temperature > 0) needs a seed")
    timings = timings if timings is not None else StepTimings()
    eos = set(eos_token_ids)
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    logits = (kv_store.prefill(model, prompt, cache) if kv_store is not None
              else prefill(model, prompt, cache))
    mx.eval(logits)
    timings.prefill_s += time.perf_counter() - t0
    bitmask = None
    if matcher is not None:
        check_matcher(matcher)
        # The matcher's tokenizer is built for the logits width (GrammarCompiler.for_model).
        bitmask = llnp.allocate_token_bitmask(1, vocab_size)
    for i in range(max_tokens):
        x = logits
        if matcher is not None and bitmask is not None:
            t0 = time.perf_counter()
            llnp.fill_next_token_bitmask(matcher, bitmask, 0)
            timings.mask_s += time.perf_counter() - t0
            check_matcher(matcher, i)
            x = apply_mask(logits, unpack_bitmask(mx.array(bitmask[0]), vocab_size))
        noise = None if params.greedy else mx.array(position_noise(params.seed or 0, i, vocab_size))
        tok = pick(x, params, noise)
        if i + 1 < max_tokens:
            # Queue the next forward before waiting, so the host's next mask fill overlaps it.
            next_logits = model(tok.reshape(1, 1), cache=cache)[0, -1]
            mx.async_eval(next_logits)
        t0 = time.perf_counter()
        t = int(tok.item())
        timings.wait_s += time.perf_counter() - t0
        timings.steps += 1
        if matcher is not None:
            matcher.consume_token(t)
            check_matcher(matcher, i)
        if t in eos:
            return "stop"
        yield t
        if matcher is not None and matcher.is_stopped():
            return "stop"  # only EOS could follow
        if i + 1 < max_tokens:
            logits = next_logits
    return "length"

