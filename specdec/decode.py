"""What every decode path shares: prompt prefill, the prompt-state store, host timings. The
decode itself is the round-based core (`core.py`); plain decoding is a round with no
proposer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import mlx.nn as nn
from mlx.utils import tree_map


from .types import TokenId

PREFILL_CHUNK = 512


@dataclass
class StepTimings:
    """Accumulated host-side timings of one decode (seconds). Mutable accumulator.

    Attributes:
        prefill_s: prompt forward, until its logits were ready.
        mask_s: the request's grammar work on the host, all of it: llguidance mask fills
            (drafting, verifying, and the next position's mask filled between rounds) and
            the work around them (copies, look-ahead consumes, the budget rule's walks and
            closing search, forced tokens, consuming the output: `GrammarClock`).
        mask_max_s: the slowest one fill since the scheduler last looked (`core`'s budget).
        wait_s: host blocked waiting for the device to produce the sampled token.
        steps: decode steps run.
        prompt_cached: prompt positions restored from the prompt store, not computed (what
            the APIs report as cached tokens).
        draft_cached: of those, the positions the draft's cache restored too (the rest the
            draft computed at once).
    """

    prefill_s: float = 0.0
    mask_s: float = 0.0
    mask_max_s: float = 0.0
    round_mask_s: float = 0.0  # grammar work in the current round (`config.MaskBudget`)
    wait_s: float = 0.0
    steps: int = 0
    prompt_cached: int = 0
    draft_cached: int = 0


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


PREFIX_MIN = 16  # the least shared prefix a longer stored prompt is cut back to and loaded


class PromptKVCache:
    """LRU of prefilled prompts: (model, token ids) → KV state and last-position logits.

    Repeated prompts (retries, the same request plain and speculative) skip their prefill;
    prompts that share a prefix with a stored one (a system prompt, a conversation's earlier
    turns) skip that much of it (`restore_prefix`). A restored state is bit-identical to
    recomputing it, so outputs do not change. Not thread-safe: owned by the engine's decode thread.

    Bounded in entries (`capacity`; a speculative request stores two: target and draft) and
    in bytes (`max_bytes`, the stored arrays); least recently used entries go first.

    Partitioned by scope (`GenerateRequest.cache_scope`): a state stored in one scope is
    never restored, found or dropped from another; "" is the default scope.
    """

    def __init__(self, capacity: int = 64, max_bytes: int = 1 << 30) -> None:
        self.capacity, self.max_bytes = capacity, max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple[tuple[int, str], tuple[int, ...]],
                                   tuple[nn.Module, list, mx.array | None]]
        self._entries = OrderedDict()
        self.hits = 0

    def prefill(self, model: nn.Module, prompt: Sequence[TokenId], cache: list,
                scope: str = "") -> mx.array:
        """Like `prefill`, restoring a stored state when this model saw this prompt."""
        key = ((id(model), scope), tuple(prompt))
        entry = self._entries.get(key)
        if entry is not None and entry[0] is model and entry[2] is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            for c, state in zip(cache, entry[1]):
                c.state = _copy_state(state)  # fresh objects: decoding never writes the store
            return entry[2]
        # The last position's row alone: a view would keep the chunk's (T, V) logits alive.
        logits = mx.array(np.array(prefill(model, prompt, cache)))
        mx.eval([c.state for c in cache])
        self._put(key, model, cache, logits)
        return logits

    def has(self, model: nn.Module, prompt: Sequence[TokenId], scope: str = "") -> bool:
        """Whether a state for (model, prompt) is stored in `scope`."""
        entry = self._entries.get(((id(model), scope), tuple(prompt)))
        return entry is not None and entry[0] is model

    def restore_prefix(self, model: nn.Module, prompt: Sequence[TokenId], cache: list,
                       trims: bool, least: int = PREFIX_MIN, scope: str = "") -> int:
        """Load the stored state of `model` that shares the longest prefix with `prompt` into
        `cache`, cut to that prefix; returns its length in positions (0: nothing loaded).

        A stored prompt that is `prompt` or a prefix of it loads whole (any cache). One that
        goes on past the shared part (a conversation's earlier turn with its own last
        message, another user message after the same system prompt) loads only where
        `trims` (every cache holds plain per-position keys and values: `ragged.exact_prefix`)
        and the shared part is at least `least` tokens. Positions are computed alike
        whatever the chunking on the batch-invariant BLAS, so what follows is unchanged."""
        p = tuple(prompt)
        best, key = 0, None
        for k, (m, _, _) in self._entries.items():
            if k[0] != (id(model), scope) or m is not model:
                continue
            n = _shared(p, k[1])
            if n < len(k[1]) and (not trims or n < least):
                continue
            if n > best:
                best, key = n, k
        if key is None:
            return 0
        self._entries.move_to_end(key)
        self.hits += 1
        states = self._entries[key][1]
        for c, state in zip(cache, states):
            if best == len(key[1]):  # the stored prompt whole (recurrent state too)
                c.state = _copy_state(state)
                continue
            c.state = _copy_state(_cut(state, best))
            if c.offset > best:  # a cache that kept the whole state: drop what is not shared
                c.trim(c.offset - best)
        return best

    def clear(self) -> None:
        """Forget every stored state."""
        self._entries.clear()
        self.nbytes = 0

    def drop(self, model: nn.Module, prompt: Sequence[TokenId], scope: str = "") -> None:
        """Forget the state of (model, prompt) in `scope`, where one is stored."""
        old = self._entries.pop(((id(model), scope), tuple(prompt)), None)
        if old is not None:
            self.nbytes -= _entry_bytes(old)

    def store(self, model: nn.Module, prompt: Sequence[TokenId], cache: list,
              scope: str = "") -> None:
        """Keep a copy of `cache` (which holds exactly `prompt`) for later requests of
        `scope`."""
        self._put(((id(model), scope), tuple(prompt)), model, cache, None)

    def _put(self, key: tuple[tuple[int, str], tuple[int, ...]], model: nn.Module, cache: list,
             logits: mx.array | None) -> None:
        if self.capacity > 0:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= _entry_bytes(old)
            states = [_copy_state(c.state) for c in cache]
            mx.eval(states)  # own copies now, not views of a live cache
            entry = (model, states, logits)
            self._entries[key] = entry
            self.nbytes += _entry_bytes(entry)
            while self._entries and (len(self._entries) > self.capacity
                                     or self.nbytes > self.max_bytes):
                self.nbytes -= _entry_bytes(self._entries.popitem(last=False)[1])


def _shared(a: tuple, b: tuple) -> int:
    """Length of the longest common prefix of two token tuples (slices compared in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _cut(state: Any, n: int) -> Any:
    """A stored cache state cut to its first n positions, where the cache's state is keys and
    values by position (mlx-lm's KVCache, a slab slot's (keys, values, offset)); other
    states whole (the caller trims the cache after loading them)."""
    if isinstance(state, tuple) and len(state) == 3 and isinstance(state[2], int):
        return state[0], state[1], n  # a slab slot writes the first `offset` positions
    if isinstance(state, tuple) and len(state) == 2 and all(isinstance(a, mx.array)
                                                           for a in state):
        return state[0][..., :n, :], state[1][..., :n, :]
    return state


def _entry_bytes(entry: tuple) -> int:
    arrays = [a for st in entry[1] for a in st if isinstance(a, mx.array)]
    if entry[2] is not None:
        arrays.append(entry[2])
    return sum(a.nbytes for a in arrays)


def _copy_state(state: Any) -> Any:
    """A deep copy of a cache's `state`, whatever its nesting (a recurrent cache's state
    holds a list that the live cache mutates in place; a cache list nests states)."""
    return tree_map(lambda a: mx.array(a) if isinstance(a, mx.array) else a, state)
