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
takes until the grammar may end (`is_accepting`), one token a step, at most `NEED_LIMIT` tokens
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
     first by their bytes in the byte order `"` `@` `}` `]` `,` space `:` `/` `A`-`Z` `.`
     `1`-`9` `0` `a`-`z`, then every other byte ascending (separators and designators
     before the bytes they separate: an email's `@`, a duration's `D`, an address's `.`;
     no year 0); none allowed: the lowest allowed id (an empty mask: no closing).
The candidates are the special tokens (markup: no text, no level change; first among
equal changes, by id), the tokens made only of the bytes `"{}[],: ` and the one-byte tokens.

**Stalls and the search.** At each step of 2-4 the walk notes the state's *signature*: its
mask, the level reader's state and, for each hint, the length of its longest start the
output ends with (0: none; a whole hint is no start).
The walk *stalls* when it meets one signature for the `REPEAT`-th (16th) time, or when it
reaches that bound (or the grammar errs) having met its last signature more than once: it
keeps coming back to a state its steps do not leave (an email's local part: the `@` is
never the candidate that closes most). Then, from the step where it first met that
signature (the state and place there), a *search* finds the shortest way on, and the walk
goes on after it (noting signatures afresh). Where the search finds nothing, the walk goes
on from where it stalled as if it had not, stalling no more (a long count, such as
`minItems: 500`, is walked to its end). A stall where the last signature was met once
only (or none: the walk only forced), or at the bound after a search found nothing, is no
closing.

The search from a state is breadth-first over token paths, depth by depth (at most the
walk's tokens left): at each depth, the first path in order whose state may end, or whose
level is below the level where the search started, is its result. Each path of the depth
is extended, in order, by its successors: where step 0 or 1 forces a token, that token;
else, where a path with the same signature was extended earlier in this search, the
tokens that extension kept; else the *search tokens* the mask allows, in the candidates'
tie order (the special tokens, the structure tokens and the one-byte tokens of printable
ASCII, 0x20-0x7E), then, where the mask allows at most `FEW` tokens, the others by id, then
each hint's next token (its longest start the output ends with, else its first) where
allowed and not listed yet. An extension keeps, for each signature its successors reach,
the first token that reached it. Of the new paths of a depth, one whose signature equals
an earlier one's is dropped. The search gives up (no closing) after making `PROBES` (4096)
successor states.

Last, the closing is *written anew* where that is shorter: each run of its tokens between
special tokens is replaced by the tokenizer's own tokens for the run's bytes
(`tokenize_bytes`); where the result has fewer tokens, the grammar takes it from the
state and may end after it, it is the closing.

The walk and its searches go on for at most `NEED_LIMIT` (4096) tokens, whatever the
bound asked for; a closing *within* `n` tokens is the closing found, where it has at most
`n` tokens (written anew).

`need(state)`: the closing's length; the request's *minimum* is the need at its start.

**The rule** at an output position with `left` tokens of the budget (this one included),
after the decision rule picked `t` from its scores (`sampling.pick_scores`). The rule
remembers `known`: the closing it proved for the token the previous position took (from
the state after it); none at its first check. A token's *proof* within `n` tokens is: an
end token, `[]` where the grammar may end here (else none); else, from `known`, its rest
where the token is its first and the rest has at most `n` tokens; else `known` itself
where it has at most `n` tokens and the grammar takes the token, then `known`, and may
end; else, where the token has text (not a special token) and its bytes begin (and are
shorter than) the bytes of `known`'s tokens before its first special token, the
tokenizer's own tokens for the rest of those bytes followed by `known`'s tokens from that
special token on, where it has at most `n` tokens and the grammar takes the token, then
it, and may end; else the closing from the state after the token, within `n`. Then:
  - while `left - 1 >= window` (`window` = the minimum + `SLACK`), nothing is checked;
  - else `t` stands when it has a proof within `left - 1`;
  - else, when there is a closing from the current state within `left` (`known` where it
    has at most `left` tokens, else the closing from here), the position takes the first
    of the row's `CANDIDATES` best-scoring tokens (score descending, then id; finite scores
    only) with a proof within `left - 1`, or else that closing's first token (its rest
    the proof; where the grammar may end already, the lowest end-of-output id);
  - else (no closing within `left`: the document cannot be completed) `t` stands.
The proof of the token the position takes becomes `known` (none where `t` stands without
one). The rule also remembers the signatures from which a search of its checks found
nothing: a later check's walk that stalls at one of them goes on at once as if its search
had found nothing (the minimum's walk, at the start, remembers nothing).
A position where the rule changed the pick is *steered*; a request with a steered position
ends with finish "length" (the budget forced its close), its document complete.

A request whose minimum is not found (no closing within `NEED_LIMIT` tokens, a dead end, or
more than `MINIMUM_S` spent finding it) is served without the rule, and says so
(`budget_unguaranteed`).

The closing's work counts in the request's grammar budget (`config.MaskBudget`, `Spend`):
a fill slower than its `mask_s`, or the rule's work in all past what is left of its
`total_s`, stops the request (`Overspent`, a `GrammarTooComplex` to the client), and one
slower than `slow_s` has it decode plainly from then on, as any other fill would (a sharded
target's ranks leave that to rank 0's decisions); the minimum's
search at preparation has `MINIMUM_S` seconds, past which the rule is off for the request
(`budget_unguaranteed`).

Logprobs stay those of the grammar-masked distribution (the rule filters the pick, not the
distribution). A check costs a replay of the remembered closing (a few token steps) and,
where the output left it, a walk (a few mask fills a step); it runs only in the last
`window` tokens of a request.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import llguidance.numpy as llnp
import numpy as np
from llguidance import LLMatcher

from .errors import Overspent
from .reasoning import ThinkingCursor
from .types import GrammarState, TokenId

STRUCTURE = frozenset(b'"{}[],: ')
BYTE_ORDER = (b'"@}], :/' + bytes(range(0x41, 0x5B)) + b"." + b"1234567890"
              + bytes(range(0x61, 0x7B)))
SLACK = 64  # the rule is checked from `minimum + SLACK` tokens before the budget's end
CANDIDATES = 8  # the row's best-scoring tokens the rule considers before the walk's own
NEED_LIMIT = 4096
FEW = 16  # where the mask allows at most this many tokens, one that ends the grammar first
REPEAT = 16  # the walk stalls where it meets one state this many times
PROBES = 4096  # the most states one search makes
MINIMUM_S = 5.0  # the longest the minimum's closing may take to find at preparation
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
    specials: frozenset[int] = frozenset()
    # the tokenizer's own tokens for some bytes (a closing written anew), if known
    tokenize: Callable[[bytes], list[TokenId]] | None = field(default=None, repr=False,
                                                               compare=False)

    @staticmethod
    def of(token_bytes: Sequence[bytes], vocab_size: int,
           tokenize: Callable[[bytes], list[TokenId]] | None = None) -> "ClosingOrder":
        """The tables over ids [0, len(token_bytes)); a special token's bytes are
        llguidance's 0xFF marker and its name (`special`): read as no text."""
        text = [b"" if special(b) else b for b in token_bytes]
        ids = [i for i, b in enumerate(token_bytes)
               if special(b) or (b and (len(b) == 1 or all(c in STRUCTURE for c in b)))]
        ids.sort(key=lambda i: (_static_key(token_bytes[i]), i))
        return ClosingOrder(tuple(text), np.array(ids, dtype=np.int64), vocab_size,
                            specials=frozenset(i for i, b in enumerate(token_bytes)
                                               if special(b)), tokenize=tokenize)

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
    return ClosingOrder.of([tokenizer.decode_bytes([i]) for i in range(n)], vocab_size,
                           lambda b: [int(t) for t in tokenizer.tokenize_bytes(b)])


@dataclass
class Spend:
    """What the closing's grammar work may cost (the request's grammar budget,
    `config.MaskBudget`): each mask fill at most `fill_s`, all of it done by `deadline`
    (`time.perf_counter`); `slowest` and `fills` record what it cost."""

    deadline: float | None = None
    fill_s: float | None = None
    slowest: float = 0.0
    fills: int = 0

    def check(self) -> None:
        """Raise `Overspent` once past the deadline."""
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise Overspent("its grammar budget ran out while the token budget's closing "
                            "was sought")

    def filled(self, seconds: float) -> None:
        self.fills += 1
        self.slowest = max(self.slowest, seconds)
        if self.fill_s is not None and seconds > self.fill_s:
            raise Overspent(f"one mask took {seconds:.2f}s (at most {self.fill_s:g}s) "
                            "while the token budget's closing was sought")
        self.check()


_SPENDING = threading.local()


@contextlib.contextmanager
def spending(spend: Spend) -> Iterator[Spend]:
    """Bound the closing work this thread does inside the block by `spend`."""
    before = getattr(_SPENDING, "spend", None)
    _SPENDING.spend = spend
    try:
        yield spend
    finally:
        _SPENDING.spend = before


def _step() -> None:
    """A walk's or a search's step: past the deadline, stop (`Spend.check`)."""
    spend = getattr(_SPENDING, "spend", None)
    if spend is not None:
        spend.check()


def _allowed(matcher: GrammarState, vocab_size: int) -> np.ndarray | None:
    """The mask at the matcher's state as bools (vocab_size,), None on an error; its time
    counts in the thread's `Spend`."""
    row = llnp.allocate_token_bitmask(1, vocab_size)
    t0 = time.perf_counter()
    llnp.fill_next_token_bitmask(matcher, row, 0)
    spend = getattr(_SPENDING, "spend", None)
    if spend is not None:
        spend.filled(time.perf_counter() - t0)
    if matcher.is_error():
        return None
    bits = np.unpackbits(row[0].view(np.uint8), bitorder="little")[:vocab_size]
    return bits.astype(bool)


def _takes(m: GrammarState, tokens: Sequence[TokenId]) -> bool:
    """Whether `m` takes `tokens` in turn (advancing it): the answer of consuming each. An
    `LLMatcher` checks each token before consuming it (`try_consume_tokens`), since a refused
    consume costs llguidance an error state and its message (~10x a taken token), and most
    replays that fail, fail so. The check refuses an end token where consuming takes it
    (and stops the matcher): a refused token where the grammar may end is consumed as
    usual. tests/test_budget_search.py compares the two."""
    toks = [int(t) for t in tokens]
    if isinstance(m, ThinkingCursor):
        return all(m.consume_token(t) for t in toks) and not m.is_error()
    while toks:
        n = m.try_consume_tokens(toks)
        if m.is_error():
            return False
        if n == len(toks):
            return True
        if not m.is_accepting() or not m.consume_token(toks[n]) or m.is_error():
            return False
        toks = toks[n + 1:]
    return True


def _ends_after(matcher: GrammarState, token: TokenId) -> bool:
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


def ended_reasoning(matcher: GrammarState) -> bool:
    """Whether the token the matcher took last completed its reasoning's end marker (a
    thinking state, `reasoning.ThinkingCursor`; plain matchers never reason)."""
    return isinstance(matcher, ThinkingCursor) and matcher.gate.ended


def _hinted(matcher: GrammarState, order: ClosingOrder, hints: Sequence[Sequence[TokenId]],
            tail: tuple[TokenId, ...]) -> TokenId | None:
    """A hint's next token: for each hint in order, for each start of it the output ends
    with (longest first, the empty one last), its next token where the grammar takes the
    hint's rest and then leaves free text (allows at most `FEW` tokens)."""
    for h in hints:
        for k in _starts(tail, h):
            m = matcher.deep_copy()
            if not _takes(m, h[k:]):
                continue
            ok = _allowed(m, order.vocab_size)
            if ok is not None and (m.is_accepting() or np.count_nonzero(ok) <= FEW):
                return int(h[k])
    return None


def _starts(tail: Sequence[TokenId], hint: Sequence[TokenId]) -> Iterator[int]:
    """The lengths of the starts of `hint` (not all of it) that `tail` ends with, longest
    first, then 0 (the empty start)."""
    for k in range(len(hint) - 1, 0, -1):
        if tuple(tail[-k:]) == tuple(hint[:k]):
            yield k
    yield 0


def _signature(mask: np.ndarray, at: Place, hints: Sequence[Sequence[TokenId]]) -> tuple:
    """What the walk and the search tell grammar states apart by: the mask there, the level
    reader's state and, for each hint, the longest start of it the output ends with."""
    begun = tuple(next(_starts(at.tail, h)) for h in hints)
    return (np.packbits(mask).tobytes(), at.nesting, begun)


def closing(matcher: GrammarState, order: ClosingOrder, limit: int, at: Place = Place(),
            hints: Sequence[Sequence[TokenId]] = (), why: list[str] | None = None,
            gave_up: set[tuple] | None = None) -> list[TokenId] | None:
    """The closing from `matcher`'s state (on a copy) and `at`: the greedy walk, or where it
    stalls, the walk up to the loop it stalled in and the search from there (within
    `NEED_LIMIT` tokens), written anew; None when it is not found or has more than `limit`
    tokens (see the module docstring), and then why is appended to `why`. `hints`: token
    sequences that end free text in this grammar (a tool format's raw value end).
    `gave_up`: the signatures whose search found nothing in earlier closings of the same
    rule (not searched again; a search that finds nothing adds its own)."""
    found, reasons = _closing(matcher, order, at, hints, gave_up)
    if found is not None and len(found) > limit:
        found, reasons = None, [f"no closing within {limit} tokens (its closing takes "
                                f"{len(found)})"]
    if found is None and why is not None:
        why += reasons
    return found


def _closing(matcher: GrammarState, order: ClosingOrder, at: Place,
             hints: Sequence[Sequence[TokenId]], gave_up: set[tuple] | None
             ) -> tuple[list[TokenId] | None, list[str]]:
    """The closing within `NEED_LIMIT` tokens (`closing`), written anew, or None and why."""
    limit = NEED_LIMIT
    keep = _keep(hints)
    m = matcher.deep_copy()
    if isinstance(m, ThinkingCursor):
        m.close_now()
    out: list[TokenId] = []
    # since the walk last left a search: the state there, the place before each step, and
    # each mask signature met (the step it was first met at, the times met)
    base, places = m.deep_copy(), [at]
    seen: dict[tuple, list[int]] = {}
    last: tuple | None = None
    stalls = True  # whether a stall searches (not after a search that found nothing)
    tried: list[str] = []  # what the searches that found nothing said
    while not m.is_accepting():
        _step()
        stalled = False
        if len(out) >= limit or m.is_error():
            stalled = True
        else:
            forced = _forced(m)
            if forced is not None:
                t = forced
            else:
                ok = _allowed(m, order.vocab_size)
                if ok is not None and not ok.any():
                    return None, ["the closing walk reached a state where the grammar allows "
                                  "no token"]
                if ok is None:  # the grammar erred: a stall
                    stalled = True
                else:
                    last = _signature(ok, at, hints)
                    met = seen.setdefault(last, [len(out), 0])
                    met[1] += 1
                    stalled = stalls and met[1] >= REPEAT
                    if not stalled:
                        t = _greedy_step(m, ok, order, hints, at)
        if stalled:
            if not stalls or last is None or seen[last][1] < 2:  # no loop, or no way on
                return None, tried + [f"no closing within {limit} tokens" if len(out) >= limit
                                      else "the closing walk ran into a grammar error"]
            # search from where the walk first met the state it kept coming back to, until
            # it may end or leaves that state's level; then walk on from there
            i = seen[last][0]
            start = len(out) - len(places) + 1
            part = None
            if gave_up is None or last not in gave_up:
                m = _replayed(base, out[start:i])
                at = places[i - start]
                part = search(m, order, limit - i, at, hints, below=at.nesting.level,
                              why=tried)
                if part is None and gave_up is not None:
                    gave_up.add(last)
            if part is None:  # the walk goes on from where it stalled, as if it had not
                m, at, stalls = _replayed(base, out[start:]), places[-1], False
                continue
            for t in part:
                m.consume_token(t)
                at = at.after(order, t, keep, ended_reasoning(m))
            out = out[:i] + part
            base, places, seen, last = m.deep_copy(), [at], {}, None
            continue
        if not m.consume_token(t):
            continue  # the grammar erred: a stall, above
        at = at.after(order, t, keep, ended_reasoning(m))
        out.append(t)
        places.append(at)
    return _anew(matcher, order, out), []


def _keep(hints: Sequence[Sequence[TokenId]]) -> int:
    """How many of the output's last tokens a place keeps: as many as the longest hint."""
    return max((len(h) for h in hints), default=0)


def _forced(m: GrammarState) -> TokenId | None:
    """The token steps 0 and 1 force at `m`'s state (the reasoning's end marker where it
    reasons, else the grammar's first forced token), or None."""
    due = m.forcing() if isinstance(m, ThinkingCursor) else None
    if due is not None:
        return int(due)
    if isinstance(m, LLMatcher) and not m.compute_ff_bytes():
        return None  # no forced bytes, no forced token (without the tokenizer's call)
    ff = m.compute_ff_tokens()
    return int(ff[0]) if ff else None


def _replayed(base: GrammarState, tokens: Sequence[TokenId]) -> GrammarState:
    """A copy of `base` that took `tokens`."""
    m = base.deep_copy()
    for t in tokens:
        m.consume_token(t)
    return m


def _anew(matcher: GrammarState, order: ClosingOrder, path: list[TokenId]) -> list[TokenId]:
    """`path` written anew where that is shorter: each run of its tokens between special
    tokens replaced by the tokenizer's own tokens for its bytes, where the grammar takes
    the result from `matcher`'s state and may end after it (see the module docstring)."""
    if order.tokenize is None or not path:
        return path
    out: list[TokenId] = []
    run: list[TokenId] = []
    for t in [*path, None]:
        if t is not None and t not in order.specials:
            run.append(t)
            continue
        if run:
            out += order.tokenize(b"".join(order.bytes_of(u) for u in run))
            run = []
        if t is not None:
            out.append(t)
    if len(out) >= len(path):
        return path
    m = matcher.deep_copy()  # (the grammar's check: a thinking matcher forces nothing here)
    return out if _takes(m, out) and m.is_accepting() else path


def _greedy_step(m, ok: np.ndarray, order: ClosingOrder, hints: Sequence[Sequence[TokenId]],
                 at: Place) -> TokenId:
    """The walk's step where the grammar forces nothing (steps 2 to 4 of the walk)."""
    few = np.flatnonzero(ok) if np.count_nonzero(ok) <= FEW else ()
    end = next((int(i) for i in few if _ends_after(m, int(i))), None)
    if end is not None:
        return end
    hinted = _hinted(m, order, hints, at.tail) if hints else None
    if hinted is not None:
        return hinted
    fits = ok[order.candidates]
    if fits.any():
        d = np.where(fits, order.deltas(at.nesting), np.iinfo(np.int64).max)
        return int(order.candidates[int(np.argmin(d))])
    return int(np.flatnonzero(ok)[0])


def _alphabet(order: ClosingOrder) -> np.ndarray:
    """The search's tokens in the candidates' tie order: the special tokens, the structure
    tokens and the one-byte tokens of printable ASCII."""
    got = order._deltas.get("alphabet")
    if got is None:
        one = order.token_bytes
        got = np.array([i for i in order.candidates
                        if len(one[i]) != 1 or 0x20 <= one[i][0] < 0x7F], dtype=np.int64)
        order._deltas["alphabet"] = got
    return got


@dataclass
class _Node:
    matcher: GrammarState
    at: Place
    path: list[TokenId]
    mask: np.ndarray | None  # None: the search's start (not filled yet)
    sig: tuple | None


def search(matcher: GrammarState, order: ClosingOrder, limit: int, at: Place = Place(),
           hints: Sequence[Sequence[TokenId]] = (), below: int | None = None,
           probes: int | None = None, why: list[str] | None = None) -> list[TokenId] | None:
    """The breadth-first search from `matcher`'s state (on copies) and `at`: the first of
    the shortest token paths over its tokens, of at most `limit`, to a state where the
    grammar may end or (`below`) whose level is below `below`; None: none that short, or
    more than `probes` (default `PROBES`) states made, and then why is appended to `why`.
    See the module docstring."""
    probes = PROBES if probes is None else probes
    keep = _keep(hints)
    frontier = [_Node(matcher.deep_copy(), at, [], None, None)]
    reps: dict[tuple, list[TokenId]] = {}  # signature -> the tokens its first expansion kept
    made = 0
    alphabet = _alphabet(order)
    for depth in range(limit + 1):
        for node in frontier:
            if node.matcher.is_accepting() or (below is not None
                                               and node.at.nesting.level < below):
                return node.path
        if depth == limit or not frontier:
            if why is not None:
                why.append(f"the closing search found no way on within {limit} tokens"
                           if frontier else "the closing search ran out of states")
            return None
        nxt: list[_Node] = []
        kept: set[tuple] = set()
        for node in frontier:
            m = node.matcher
            forced = _forced(m)
            mine: dict[tuple, TokenId] | None = None
            if forced is not None:
                tokens = [forced]
            elif node.sig in reps:
                tokens = reps[node.sig]
            else:
                ok = node.mask if node.mask is not None else _allowed(m, order.vocab_size)
                if ok is None:
                    continue
                tokens = alphabet[ok[alphabet]].tolist()
                if np.count_nonzero(ok) <= FEW:
                    listed = set(tokens)
                    tokens += [int(i) for i in np.flatnonzero(ok) if int(i) not in listed]
                for h in hints:
                    t = int(h[next(_starts(node.at.tail, h))])
                    if ok[t] and t not in tokens:
                        tokens.append(t)
                mine = {}
            for t in tokens:
                _step()
                made += 1
                if made > probes:
                    if why is not None:
                        why.append(f"the closing search gave up after {probes} states")
                    return None
                c = m.deep_copy()
                if not c.consume_token(t) or c.is_error():
                    continue
                c_at = node.at.after(order, t, keep, ended_reasoning(c))
                c_ok = _allowed(c, order.vocab_size)
                if c_ok is None:
                    continue
                sig = _signature(c_ok, c_at, hints)
                if mine is not None:
                    mine.setdefault(sig, t)
                if sig in kept:
                    continue
                kept.add(sig)
                nxt.append(_Node(c, c_at, node.path + [t], c_ok, sig))
            if mine is not None and node.sig is not None:
                reps[node.sig] = list(mine.values())
        frontier = nxt
    return None


def need(matcher: GrammarState, order: ClosingOrder, limit: int = NEED_LIMIT, at: Place = Place(),
         hints: Sequence[Sequence[TokenId]] = (), why: list[str] | None = None) -> int | None:
    """The closing's length from `matcher`'s state (None: none found within `limit`, why
    appended to `why`)."""
    walk = closing(matcher, order, limit, at, hints, why)
    return None if walk is None else len(walk)


def replays(matcher: GrammarState, token: TokenId, path: Sequence[TokenId], left: int) -> bool:
    """Whether `path` (at most `left` tokens) takes the grammar from the state after `token`
    to where it may end (`matcher` untouched)."""
    if len(path) > left:
        return False
    m = matcher.deep_copy()
    return _takes(m, (token, *path)) and bool(m.is_accepting())


def _rest(order: ClosingOrder, token: TokenId, known: Sequence[TokenId]
          ) -> list[TokenId] | None:
    """Where `token`'s bytes begin those of `known`'s first run of text tokens (up to its
    first special token), the tokenizer's tokens for the rest of that run, then the rest
    of `known`; else None."""
    if order.tokenize is None or token in order.specials:
        return None
    n = next((k for k, t in enumerate(known) if t in order.specials), len(known))
    run = b"".join(order.bytes_of(t) for t in known[:n])
    head = order.bytes_of(token)
    if not head or len(head) >= len(run) or not run.startswith(head):
        return None
    return order.tokenize(run[len(head):]) + list(known[n:])


def closing_after(matcher: GrammarState, token: TokenId, order: ClosingOrder, left: int,
                  eos: frozenset[int], at: Place, hints: Sequence[Sequence[TokenId]] = (),
                  known: Sequence[TokenId] | None = None, gave_up: set[tuple] | None = None
                  ) -> list[TokenId] | None:
    """A closing of at most `left` tokens from the state after `token`: from `known` (a
    closing from the matcher's state: the rule's last proved one), its rest where `token`
    is its first, or itself where it replays from there, or its bytes after `token`'s
    (`_rest`) where they replay; else the closing (`closing`); None: none of these. An end
    token: `[]` where the grammar may end here. `gave_up`: as `closing`'s."""
    if token in eos:
        return [] if matcher.is_accepting() else None
    if known:
        if token == known[0] and len(known) - 1 <= left:
            return list(known[1:])
        if replays(matcher, token, known, left):
            return list(known)
        rest = _rest(order, token, known)
        if rest is not None and replays(matcher, token, rest, left):
            return rest
    m = matcher.deep_copy()
    if not m.consume_token(token) or m.is_error():
        return None
    keep = _keep(hints)
    return closing(m, order, left, at.after(order, token, keep, ended_reasoning(m)), hints,
                   gave_up=gave_up)


@dataclass(frozen=True)
class Closing:
    """What a prepared request's rule needs: its tokenizer's closing order (None in a
    sharded target's replica of it: `distributed.for_replicas`) and the need at its start
    (its minimum budget)."""

    order: ClosingOrder | None
    minimum: int
    hints: tuple[tuple[TokenId, ...], ...] = ()


@dataclass
class BudgetRule:
    """One request's rule (see the module docstring): its closing order, its budget and
    minimum; `steered` counts the positions it changed; `known` is the closing the rule
    proved for the token it took last (from the state after it), None before its first
    check; `gave_up` the signatures from which its searches found nothing."""

    order: ClosingOrder
    max_tokens: int
    minimum: int
    eos: frozenset[int]
    hints: tuple[tuple[TokenId, ...], ...] = ()
    steered: int = 0
    place: Place = Place()  # after the output so far
    known: list[TokenId] | None = None
    gave_up: set[tuple] = field(default_factory=set)  # signatures its searches left

    @property
    def keep(self) -> int:
        return _keep(self.hints)

    def advance(self, token: TokenId, at: Place | None = None,
                matcher: GrammarState | None = None) -> Place:
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

    def decide(self, matcher: GrammarState, emitted: int, pick: TokenId,
               ranked: Callable[[], Sequence[TokenId]], at: Place | None = None) -> TokenId:
        """The token output position `emitted` takes, the decision rule having picked
        `pick` at the matcher's current state (the level reader's `at`: by default, after
        the output so far); `ranked()`: the row's best-scoring tokens (score descending,
        then id; finite scores), asked for only when `pick` fails. Positions are decided
        in order, each once (the remembered closing, `known`, moves with them)."""
        at = self.place if at is None else at
        left = self.max_tokens - emitted
        if not self.active(emitted):
            return pick
        proof = closing_after(matcher, pick, self.order, left - 1, self.eos, at, self.hints,
                              self.known, self.gave_up)
        if proof is not None:
            self.known = proof
            return pick
        here = self.known if self.known is not None and len(self.known) <= left else \
            closing(matcher, self.order, left, at, self.hints, gave_up=self.gave_up)
        if here is None:
            self.known = None
            return pick  # no closing within the budget: as it is
        # the closing's first token; where the grammar may end here, the first end token
        chosen, proof = (here[0], here[1:]) if here else (min(self.eos), [])
        for t in list(ranked())[:CANDIDATES]:
            if t == pick:
                continue
            got = closing_after(matcher, t, self.order, left - 1, self.eos, at, self.hints,
                                self.known, self.gave_up)
            if got is not None:
                chosen, proof = int(t), got
                break
        self.known = proof
        self.steered += chosen != pick
        return chosen


def ranked_ids(scores: np.ndarray, n: int = CANDIDATES) -> list[TokenId]:
    """A row's `n` best-scoring token ids, score descending then id, finite scores only."""
    order = np.argsort(-scores, kind="stable")[:n]
    return [int(i) for i in order if np.isfinite(scores[i])]
