"""The token budget as part of the constraint: a constrained answer closes in time.

A constrained request with a budget of B output tokens is steered, near its end, so that its
document is complete when the budget runs out. The rule, stated once (the oracle implements
it separately, `oracle/closing.py`; the README's "The token budget" says it for users):

**Nesting.** The output's bytes are read as JSON-like text: outside a string, `"` opens one
and `{` `[` open a level, `}` `]` close one; inside, a backslash escapes the next
byte and `"` closes it. The *level* is the open levels plus one inside a string.

**Reasoning.** In a request that thinks before answering, the level reader restarts (at
level 0, outside a string) after the token that completes the reasoning's end marker: the
answer's nesting is read from its own bytes.

**The closing walk** from a grammar state (and the level there) is the token path the walk
takes until the grammar may end (`is_accepting`), one token a step, at most `limit` tokens
(else it has no closing within that bound):
  0. inside the reasoning (opened, its end marker not complete), the end marker's next
     token, as a spent thinking budget forces it: once one is forced, the next (none
     allowed: no closing); else, where the reasoning's last tokens are a start of the
     marker's (the longest), the token after it; else its first token where the grammar
     allows it (else the steps below);
  1. the grammar's first forced token (`compute_ff_tokens()[0]`), where it forces one;
  2. else, where the mask allows at most `FEW` (16) tokens and one lets the grammar end
     right after it, the lowest such id (markup that closes: a calls-end token);
  3. else a *hint*'s next token (hints: token sequences that end free text in the
     request's grammar, e.g. a tool format's `</parameter>`): for each hint in order, for
     each start of it the output ends with (longest first, the empty one last), its next
     token, where the grammar takes the rest of the hint and then allows at most `FEW`
     tokens (or may end);
  4. else, of the *candidates* the mask allows, the one whose bytes change the level the
     least (closing most), ties to a special token, then to the shortest, then to the
     first by their bytes in the byte order `"` `}` `]` `,` space `0`-`9` `a`-`z` `A`-`Z`, then every other byte
     ascending; none allowed: the lowest allowed id (an empty mask: no closing).
The candidates are the special tokens (markup: no text, no level change; first among
equal changes, by id), the tokens made only of the bytes `"{}[],: ` and the one-byte tokens.
`need(state)`: the walk's length; the request's *minimum* is the need at its start.

**The rule** at an output position with `left` tokens of the budget (this one included),
after the decision rule picked `t` from its scores (`sampling.pick_scores`):
  - while `left - 1 >= window` (`window` = the minimum + `SLACK`), nothing is checked;
  - else `t` stands when the walk from the state after `t` closes within `left - 1` tokens
    (an end token: when the grammar may end here);
  - else, when the walk from the current state closes within `left` tokens, the position
    takes the first of the row's `CANDIDATES` best-scoring tokens (score descending, then id;
    finite scores only) whose walk closes within `left - 1`, or else the walk's own first
    token (which always does: the walk from there is the rest of this one; where the
    grammar may end already, the lowest end-of-output id);
  - else (no closing within `left`: the document cannot be completed) `t` stands.
A position where the rule changed the pick is *steered*; a request with a steered position
ends with finish "length" (the budget forced the close), its document complete.

Logprobs stay those of the grammar-masked distribution (the rule filters the pick, not the
distribution). The walk costs a few mask fills a step (a fill is ~5-50 us on a 49k
vocabulary); it runs only in the last `window` tokens of a request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import llguidance.numpy as llnp
import numpy as np

from .types import TokenId

STRUCTURE = frozenset(b'"{}[],: ')
BYTE_ORDER = (b'"}], ' + bytes(range(0x30, 0x3A)) + bytes(range(0x61, 0x7B))
              + bytes(range(0x41, 0x5B)))
SLACK = 64  # the rule is checked from `minimum + SLACK` tokens before the budget's end
CANDIDATES = 8  # the row's best-scoring tokens the rule considers before the walk's own
NEED_LIMIT = 4096
FEW = 16  # where the mask allows at most this many tokens, one that ends the grammar first  # the longest walk measured for a request's minimum
_RANK = {c: n for n, c in enumerate(BYTE_ORDER)}


@dataclass(frozen=True)
class Nesting:
    """The level reader's state after some bytes (see the module docstring)."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    @property
    def level(self) -> int:
        return self.depth + self.in_string

    def read(self, data: bytes) -> "Nesting":
        depth, in_string, escaped = self.depth, self.in_string, self.escaped
        for b in data:
            if in_string:
                if escaped:
                    escaped = False
                elif b == 0x5C:
                    escaped = True
                elif b == 0x22:
                    in_string = False
            elif b == 0x22:
                in_string = True
            elif b in (0x7B, 0x5B):
                depth += 1
            elif b in (0x7D, 0x5D):
                depth -= 1
        return Nesting(depth, in_string, escaped)


def special(b: bytes) -> bool:
    """Whether token bytes are a special token's (llguidance: 0xFF, then its name)."""
    return len(b) > 1 and b[0] == 0xFF


def _static_key(b: bytes) -> tuple:
    if special(b):
        return (0,)
    return (1, len(b), tuple(_RANK.get(c, len(_RANK) + c) for c in b))


@dataclass(frozen=True)
class ClosingOrder:
    """A tokenizer's walk tables: each id's bytes (`token_bytes`), the candidates in their
    tie order (`candidates`), and the logits width (`vocab_size`)."""

    token_bytes: tuple[bytes, ...]
    candidates: np.ndarray
    vocab_size: int
    _deltas: dict = field(default_factory=dict, repr=False, compare=False)

    @staticmethod
    def of(token_bytes: Sequence[bytes], vocab_size: int) -> "ClosingOrder":
        """The tables over ids [0, len(token_bytes)); a special token's bytes are
        llguidance's 0xFF marker and its name (`special`): read as no text."""
        text = [b"" if special(b) else b for b in token_bytes]
        ids = [i for i, b in enumerate(token_bytes)
               if special(b) or (b and (len(b) == 1 or all(c in STRUCTURE for c in b)))]
        ids.sort(key=lambda i: (_static_key(token_bytes[i]), i))
        return ClosingOrder(tuple(text), np.array(ids, dtype=np.int64), vocab_size)

    def deltas(self, at: Nesting) -> np.ndarray:
        """Each candidate's level change read from `at` (cached by `at`'s string state)."""
        key = (at.in_string, at.escaped)
        got = self._deltas.get(key)
        if got is None:
            start = Nesting(0, at.in_string, at.escaped)
            got = np.array([start.read(self.token_bytes[i]).level - start.level
                            for i in self.candidates], dtype=np.int64)
            self._deltas[key] = got
        return got

    def bytes_of(self, token: TokenId) -> bytes:
        return self.token_bytes[token] if 0 <= token < len(self.token_bytes) else b""


def order_of(tokenizer, vocab_size: int) -> ClosingOrder:
    """The walk tables of an `LLTokenizer` (its special tokens' bytes start 0xFF)."""
    n = min(tokenizer.vocab_size, vocab_size)
    return ClosingOrder.of([tokenizer.decode_bytes([i]) for i in range(n)], vocab_size)


def _allowed(matcher, vocab_size: int) -> np.ndarray | None:
    """The mask at the matcher's state as bools (vocab_size,), None on an error."""
    row = llnp.allocate_token_bitmask(1, vocab_size)
    llnp.fill_next_token_bitmask(matcher, row, 0)
    if matcher.is_error():
        return None
    bits = np.unpackbits(row[0].view(np.uint8), bitorder="little")[:vocab_size]
    return bits.astype(bool)


def _ends_after(matcher, token: TokenId) -> bool:
    """Whether the grammar may end right after `token`."""
    m = matcher.deep_copy()
    return bool(m.consume_token(token)) and not m.is_error() and bool(m.is_accepting())


@dataclass(frozen=True)
class Place:
    """Where a walk stands beyond its grammar state: the level reader's state after the
    output so far, and the output's last tokens (as many as the longest hint)."""

    nesting: Nesting = Nesting()
    tail: tuple[TokenId, ...] = ()

    def after(self, order: ClosingOrder, token: TokenId, keep: int, restart: bool = False
              ) -> "Place":
        """The place after `token`; `restart`: the token completed the reasoning's end
        marker, and the level reader starts afresh after it."""
        return Place(Nesting() if restart else self.nesting.read(order.bytes_of(token)),
                     (self.tail + (token,))[-keep:] if keep else ())


def ended_reasoning(matcher) -> bool:
    """Whether the token the matcher took last completed its reasoning's end marker (a
    thinking matcher, `reasoning.ThinkingMatcher`; plain matchers never reason)."""
    at = getattr(matcher, "ended_at", None)
    return at is not None and at == matcher.n


def _hinted(matcher, order: ClosingOrder, hints: Sequence[Sequence[TokenId]],
            tail: tuple[TokenId, ...]) -> TokenId | None:
    """A hint's next token: for each hint in order, for each start of it the output ends
    with (longest first, the empty one last), its next token where the grammar takes the
    hint's rest and then leaves free text (allows at most `FEW` tokens)."""
    for h in hints:
        for k in range(len(h) - 1, -1, -1):
            if k and tuple(tail[-k:]) != tuple(h[:k]):
                continue
            m = matcher.deep_copy()
            if not all(m.consume_token(int(t)) for t in h[k:]) or m.is_error():
                continue
            ok = _allowed(m, order.vocab_size)
            if ok is not None and (m.is_accepting() or ok.sum() <= FEW):
                return int(h[k])
    return None


def closing(matcher, order: ClosingOrder, limit: int, at: Place = Place(),
            hints: Sequence[Sequence[TokenId]] = ()) -> list[TokenId] | None:
    """The closing walk from `matcher`'s state (on a copy) and `at`, or None when it does
    not reach a state where the grammar may end within `limit` tokens. `hints`: token
    sequences that end free text in this grammar (a tool format's raw value end)."""
    keep = max((len(h) for h in hints), default=0)
    m = matcher.deep_copy()
    reasons = hasattr(m, "close_now")
    if reasons:
        m.close_now()
    out: list[TokenId] = []
    while not m.is_accepting():
        if len(out) >= limit or m.is_error():
            return None
        due = m.forcing() if reasons else None
        forced = [due] if due is not None else m.compute_ff_tokens()
        if forced:
            t = int(forced[0])
        else:
            ok = _allowed(m, order.vocab_size)
            if ok is None or not ok.any():
                return None
            few = np.flatnonzero(ok) if ok.sum() <= FEW else ()
            ends = [int(i) for i in few if _ends_after(m, int(i))]
            fits = ok[order.candidates]
            hinted = None if ends or not hints else _hinted(m, order, hints, at.tail)
            if ends:
                t = ends[0]
            elif hinted is not None:
                t = hinted
            elif fits.any():
                d = np.where(fits, order.deltas(at.nesting), np.iinfo(np.int64).max)
                t = int(order.candidates[int(np.argmin(d))])
            else:
                t = int(np.flatnonzero(ok)[0])
        if not m.consume_token(t):
            return None
        at = at.after(order, t, keep, ended_reasoning(m))
        out.append(t)
    return out


def need(matcher, order: ClosingOrder, limit: int = NEED_LIMIT, at: Place = Place(),
         hints: Sequence[Sequence[TokenId]] = ()) -> int | None:
    """The walk's length from `matcher`'s state (None: longer than `limit`)."""
    walk = closing(matcher, order, limit, at, hints)
    return None if walk is None else len(walk)


def closes_after(matcher, token: TokenId, order: ClosingOrder, left: int,
                 eos: frozenset[int], at: Place, hints: Sequence[Sequence[TokenId]] = ()
                 ) -> bool:
    """Whether the walk from the state after `token` closes within `left` tokens (an end
    token: whether the grammar may end here)."""
    if token in eos:
        return bool(matcher.is_accepting())
    m = matcher.deep_copy()
    if not m.consume_token(token) or m.is_error():
        return False
    keep = max((len(h) for h in hints), default=0)
    return closing(m, order, left, at.after(order, token, keep, ended_reasoning(m)),
                   hints) is not None


@dataclass(frozen=True)
class Closing:
    """What a prepared request's rule needs: its tokenizer's closing order and the need at
    its start (its minimum budget)."""

    order: ClosingOrder
    minimum: int
    hints: tuple[tuple[TokenId, ...], ...] = ()


@dataclass
class BudgetRule:
    """One request's rule (see the module docstring): its closing order, its budget and
    minimum; `steered` counts the positions it changed."""

    order: ClosingOrder
    max_tokens: int
    minimum: int
    eos: frozenset[int]
    hints: tuple[tuple[TokenId, ...], ...] = ()
    steered: int = 0
    place: Place = Place()  # after the output so far

    @property
    def keep(self) -> int:
        return max((len(h) for h in self.hints), default=0)

    def advance(self, token: TokenId, at: Place | None = None, matcher=None) -> Place:
        """The place after `token` from `at` (default: the output's; then the output took
        it and its place moves); `matcher`: the one that just took it (where it ended the
        reasoning, the level reader restarts)."""
        moved = (self.place if at is None else at).after(
            self.order, token, self.keep, matcher is not None and ended_reasoning(matcher))
        if at is None:
            self.place = moved
        return moved

    @property
    def window(self) -> int:
        return self.minimum + SLACK

    def active(self, emitted: int) -> bool:
        """Whether positions `emitted` on are checked (`left - 1 < window`)."""
        return self.max_tokens - emitted - 1 < self.window

    def decide(self, matcher, emitted: int, pick: TokenId,
               ranked: Callable[[], Sequence[TokenId]], at: Place | None = None) -> TokenId:
        """The token output position `emitted` takes, the decision rule having picked
        `pick` at the matcher's current state (the level reader's `at`: by default, after
        the output so far); `ranked()`: the row's best-scoring tokens (score descending,
        then id; finite scores), asked for only when `pick` fails."""
        at = self.place if at is None else at
        left = self.max_tokens - emitted
        if not self.active(emitted) or closes_after(matcher, pick, self.order, left - 1,
                                                    self.eos, at, self.hints):
            return pick
        walk = closing(matcher, self.order, left, at, self.hints)
        if walk is None:
            return pick  # no closing within the budget: as it is
        # the walk's first token; where the grammar may end here, the first end token
        chosen = walk[0] if walk else min(self.eos)
        for t in list(ranked())[:CANDIDATES]:
            if t != pick and closes_after(matcher, t, self.order, left - 1, self.eos, at,
                                          self.hints):
                chosen = int(t)
                break
        self.steered += chosen != pick
        return chosen


def ranked_ids(scores: np.ndarray, n: int = CANDIDATES) -> list[TokenId]:
    """A row's `n` best-scoring token ids, score descending then id, finite scores only."""
    order = np.argsort(-scores, kind="stable")[:n]
    return [int(i) for i in order if np.isfinite(scores[i])]
