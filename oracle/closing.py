"""The token-budget rule, re-implemented from its statement (README, "The token budget"),
separately from specdec's `budget` module: a bug shared by both would pass the gate.

Level: the output's bytes read as JSON-like text (outside a string `"` opens one, `{` `[`
open a level and `}` `]` close one; inside, a backslash escapes the next byte and `"`
closes it); the level is the open levels, plus one inside a string. The closing walk from a
grammar state: while the grammar may not end, take its first forced token, else (where at
most 16 tokens are allowed) the lowest one after which the grammar may end, else a
hint's next token (a request's token sequences that end free text: for each in order, for
each start of it the output ends with, longest first and the empty one last, its next
token where the grammar takes the hint's rest and then allows at most 16 tokens or may
end), else among the allowed
candidates (special tokens, read as no text; tokens of the bytes `"{}[],: ` only;
one-byte tokens) the one that changes the level least, then a special token (by id), then
the shortest, then the first by its bytes in the order
`"}], 0-9a-zA-Z` and then the other bytes ascending, then the lowest id; none allowed: the
lowest allowed id; at most `limit` tokens. The rule at a position with `left` budget
tokens, the decision rule having picked `t`: checked only while `left - 1 < minimum + 64`;
`t` stands if the walk after it closes within `left - 1`; else, if the walk from here
closes within `left`, the first of the 8 best-scoring tokens (score descending, then id,
finite) whose walk closes within `left - 1`, else the walk's first token (the lowest end id
where it is empty).

Reasoning (a request that thinks first, `thinking`: its rule's `opened`, `ended` and the end
marker's `close_ids`): while the output is inside the reasoning (opened, not ended), the
walk's step is the end marker's next token: once the thinking budget or the walk forced one,
the next of them (taken as is); else where the reasoning's last tokens are a start of the
marker's tokens (the longest), the one after it; else the first where the mask allows it
(else the usual step). The level restarts from nothing after the token that ends the reasoning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance.numpy as llnp
import numpy as np
from llguidance import LLMatcher

from .sampler import unpack_mask

_BYTES: dict = {}  # (id of a tokenizer, width) -> (the tokenizer, kept alive; its bytes)
WINDOW_SLACK = 64
TOP = 8
BYTE_ORDER = b'"}], 0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'


def level_after(state: tuple[int, bool, bool], data: bytes) -> tuple[int, bool, bool]:
    """(open levels, inside a string, escape pending) after reading `data`."""
    depth, inside, esc = state
    for c in data:
        ch = chr(c)
        if inside:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                inside = False
        elif ch == '"':
            inside = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
    return depth, inside, esc


def level(state: tuple[int, bool, bool]) -> int:
    return state[0] + (1 if state[1] else 0)


def is_special(data: bytes) -> bool:
    """llguidance writes a special token as 0xFF and its name."""
    return len(data) > 1 and data[0] == 0xFF


def tie_key(data: bytes, token: int) -> tuple:
    if is_special(data):
        return (0, token)
    ranks = [BYTE_ORDER.index(c) if c in BYTE_ORDER else len(BYTE_ORDER) + c for c in data]
    return (1, len(data), ranks, token)


@dataclass
class BudgetOracle:
    """The rule for one request: the tokenizer's token bytes (by id), the logits width,
    the end ids, the budget. `minimum` is measured at the start (`start`)."""

    token_bytes: Sequence[bytes]
    vocab_size: int
    eos: tuple[int, ...]
    max_tokens: int
    hints: Sequence[Sequence[int]] = ()  # token sequences that end free text
    minimum: int | None = None
    steered: list[int] = field(default_factory=list)  # positions the rule changed
    nesting: tuple[int, bool, bool] = (0, False, False)  # after the output so far
    output: list[int] = field(default_factory=list)
    thinking: Any = None  # the request's thinking rule (`reference.ThinkingRule`), if any

    def __post_init__(self) -> None:
        self.candidates = [i for i, b in enumerate(self.token_bytes)
                           if is_special(b) or len(b) == 1
                           or (b and set(b) <= set(b'"{}[],: '))]

    @staticmethod
    def of(tokenizer, vocab_size: int, eos: Sequence[int], max_tokens: int,
           hints: Sequence[Sequence[int]] = ()) -> "BudgetOracle":
        """The rule over an llguidance tokenizer's token bytes (its special tokens' bytes
        start 0xFF: never text)."""
        key = (id(tokenizer), vocab_size)
        if key not in _BYTES:
            n = min(tokenizer.vocab_size, vocab_size)
            _BYTES[key] = (tokenizer, [tokenizer.decode_bytes([i]) for i in range(n)])
        return BudgetOracle(_BYTES[key][1], vocab_size, tuple(eos), max_tokens, hints)

    def _bytes(self, tok: int) -> bytes:
        b = self.token_bytes[tok] if tok < len(self.token_bytes) else b""
        return b"" if is_special(b) else b

    def _hint(self, m: LLMatcher, seq: list[int]) -> int | None:
        words = llnp.allocate_token_bitmask(1, self.vocab_size)
        for h in self.hints:
            h = [int(t) for t in h]
            for k in reversed(range(len(h))):
                if k > 0 and seq[-k:] != h[:k]:
                    continue
                probe = m.deep_copy()
                if not all(probe.consume_token(t) for t in h[k:]) or probe.is_error():
                    continue
                llnp.fill_next_token_bitmask(probe, words, 0)
                if probe.is_accepting() or unpack_mask(words[0], self.vocab_size).sum() <= 16:
                    return h[k]
        return None

    def _reasoning(self, seq: Sequence[int]) -> bool:
        """Whether output `seq` is inside its reasoning (opened, its end marker not done)."""
        r = self.thinking
        return r is not None and r.opened(list(seq)) is not None and not r.ended(list(seq))

    def _next(self, state, seq: Sequence[int], tok: int) -> tuple[int, bool, bool]:
        """The level after `seq` took `tok` (restarting where `tok` ended the reasoning)."""
        if self._reasoning(seq) and not self._reasoning(list(seq) + [tok]):
            return (0, False, False)
        return level_after(state, self._bytes(tok))

    def walk(self, matcher: LLMatcher, limit: int, state: tuple[int, bool, bool],
             before: Sequence[int] = (), forced: int = 0) -> list[int] | None:
        """The closing walk; `forced`: the end marker's tokens forced so far."""
        m = matcher.deep_copy()
        taken: list[int] = []
        words = llnp.allocate_token_bitmask(1, self.vocab_size)
        while not m.is_accepting():
            if len(taken) == limit:
                return None
            seq = list(before) + taken
            ff = m.compute_ff_tokens()
            marker = None
            if self._reasoning(seq) and forced < len(self.thinking.close_ids):
                ids = list(self.thinking.close_ids)
                if forced == 0:  # a start of the marker the reasoning ends with
                    inside = seq[self.thinking.opened(seq):]
                    forced = max((k for k in range(1, len(ids)) if inside[-k:] == ids[:k]),
                                 default=0)
                marker = ids[forced]
                if forced == 0:
                    llnp.fill_next_token_bitmask(m, words, 0)
                    if m.is_error() or not unpack_mask(words[0], self.vocab_size)[marker]:
                        marker = None
            if marker is not None:
                tok = marker
                forced += 1
            elif len(ff) > 0:
                tok = ff[0]
            else:
                llnp.fill_next_token_bitmask(m, words, 0)
                if m.is_error():
                    return None
                allowed = unpack_mask(words[0], self.vocab_size)
                if not allowed.any():
                    return None
                options = [i for i in self.candidates if allowed[i]]
                few = np.flatnonzero(allowed) if allowed.sum() <= 16 else []
                finishing = []
                for i in few:
                    probe = m.deep_copy()
                    if probe.consume_token(int(i)) and not probe.is_error() and \
                            probe.is_accepting():
                        finishing.append(int(i))
                hinted = None if finishing or not self.hints else \
                    self._hint(m, list(before) + taken)
                if finishing:
                    tok = finishing[0]
                elif hinted is not None:
                    tok = hinted
                elif options:
                    here = level(state)
                    tok = min(options, key=lambda i: (
                        level(level_after(state, self._bytes(i))) - here,
                        tie_key(self.token_bytes[i], i)))
                else:
                    tok = int(np.argmax(allowed))
            if not m.consume_token(tok) or m.is_error():
                return None
            state = self._next(state, seq, tok)
            taken.append(tok)
        return taken

    def start(self, matcher: LLMatcher) -> int | None:
        """Measure the minimum at the request's start (None: no closing within 4096)."""
        w = self.walk(matcher, 4096, self.nesting, self.output)
        self.minimum = None if w is None else len(w)
        return self.minimum

    def _fits(self, matcher: LLMatcher, tok: int, left: int, forced: int) -> bool:
        if tok in self.eos:
            return matcher.is_accepting()
        after = matcher.deep_copy()
        if not after.consume_token(tok) or after.is_error():
            return False
        return self.walk(after, left, self._next(self.nesting, self.output, tok),
                         self.output + [tok], forced) is not None

    def took(self, tok: int) -> None:
        """The output took `tok` (advances the level reader)."""
        self.nesting = self._next(self.nesting, self.output, tok)
        self.output.append(tok)

    def choose(self, matcher: LLMatcher, position: int, pick: int,
               scores: np.ndarray, forced: int = 0, forced_after: int = 0) -> int:
        """The token at output `position` (0-based), `pick` being the decision rule's;
        `forced` / `forced_after`: the end marker's tokens the thinking budget forced
        before this position / through it."""
        if self.minimum is None:
            return pick
        left = self.max_tokens - position
        if left - 1 >= self.minimum + WINDOW_SLACK or \
                self._fits(matcher, pick, left - 1, forced_after):
            return pick
        here = self.walk(matcher, left, self.nesting, self.output, forced)
        if here is None:
            return pick
        ranked = [int(i) for i in np.argsort(-scores, kind="stable")[:TOP]
                  if np.isfinite(scores[i])]
        for tok in ranked:
            if tok != pick and self._fits(matcher, tok, left - 1, forced_after):
                self.steered.append(position)
                return tok
        out = here[0] if here else min(self.eos)
        if out != pick:
            self.steered.append(position)
        return out
