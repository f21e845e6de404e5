"""A request's grammar: its state, the rules beside it, and its next mask, in one object.

The engine-level compiler (`grammar.GrammarCompiler`) makes one `CompiledGrammar` per
constraint; each request gets a `RequestGrammar` over a fresh state of it:
- its `state` (`types.GrammarState`): the `LLMatcher`, or one behind the thinking gate
  (`reasoning.ThinkingCursor`, where a thinking budget applies);
- the budget rule (`budget.BudgetRule`), where the answer must close in time;
- the mask at its current state, filled off the round on a worker (`ask_next_mask`,
  `take_next_mask`; `FillPools`), and whether its fills were slow;
- what it consumes (`consume`, which raises the grammar's typed errors), its clones for the
  proposer, the verify and tree masks and the budget rule (`clone`), `fill_row`,
  `single_allowed`, `stopped` and `ended_reasoning`.

A grammar's failure is classified here, once (`failure`): by llguidance's `stop_reason()`
where it names the kind (a parser or lexer too complex, a token limit, no token allowed),
else by its message. llguidance 1.9 reports its parser limits and an empty mask as an
"InternalError" stop whose kind is only in the message's first line (measured: a row's item
limit and `NoExtensionBias` both read "InternalError"; tests/test_request_grammar.py holds
that, so a release that types them shows up there).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance.numpy as llnp
import numpy as np

from .budget import BudgetRule, ended_reasoning
from .decode import StepTimings
from .errors import (GrammarDeadEnd, GrammarRefused, GrammarStateError, GrammarTooComplex,
                     SpecdecError)
from .types import GrammarState, TokenId

# llguidance's stop reasons that are the grammar's cost (its limits), and its dead end.
TOO_COMPLEX_STOPS = frozenset({"ParserTooComplex", "LexerTooComplex", "MaxTokensTotal",
                               "MaxTokensParser"})
DEAD_END = "NoExtensionBias"
# The messages of the limits it reports as "InternalError" (its lexer fuel, Earley items per
# row, lexer states, grammar size): the first line of `get_error()`.
LIMIT_MESSAGES = ("items; max is", "Too many items", "fuel exhausted", "lex fuel",
                  "relevance check fuel",
                  "lexer configuration (grammar) too big", "too many expressions constructed")


def failure(reason: str, *, stop: str, detail: str, position: int | None
            ) -> GrammarStateError | GrammarRefused:
    """The error of a grammar state that failed (`stop`: its `stop_reason()`, `detail`: its
    `get_error()`): one of llguidance's limits is the grammar's cost (`GrammarTooComplex`),
    an empty mask its dead end (`GrammarDeadEnd`); anything else is a fault of ours."""
    first = detail.strip().splitlines()[0] if detail.strip() else ""
    if stop == DEAD_END or first == DEAD_END:
        return GrammarDeadEnd(position=position)
    if stop in TOO_COMPLEX_STOPS or any(m in first for m in LIMIT_MESSAGES):
        return GrammarTooComplex((first.split("<state>")[0].strip() or stop)[:200],
                                 position=position)
    return GrammarStateError(reason, position=position, detail=detail)


def failure_of(state: GrammarState, reason: str, position: int | None
               ) -> GrammarStateError | GrammarRefused:
    """`failure` of a state in its error state."""
    return failure(reason, stop=str(state.stop_reason()), detail=str(state.get_error()),
                   position=position)


def check(state: GrammarState, position: int | None = None) -> None:
    """Raise the grammar's error when `state` is in its error state (`position`: output
    tokens so far, reported in the error)."""
    if state.is_error():
        raise failure_of(state, "grammar entered an error state", position)


def fill_row(state: GrammarState, bitmask: np.ndarray, j: int, stats: StepTimings | None
             ) -> None:
    """Fill mask row j for the state, counting its time in `stats` (every fill counts
    against the request's grammar budget: `config.MaskBudget`)."""
    t0 = time.perf_counter()
    llnp.fill_next_token_bitmask(state, bitmask, j)
    if stats is not None:
        dt = time.perf_counter() - t0
        stats.mask_s += dt
        stats.round_mask_s += dt
        stats.mask_max_s = max(stats.mask_max_s, dt)


class GrammarClock:
    """Counts a stretch of a request's grammar work in its grammar budget
    (`config.MaskBudget`): around every place a round works on the request's grammar state or
    its copies (its proposer's clone and draft masks, the verify and tree masks, the budget
    rule's walks and closing search, forced tokens, consuming the emitted tokens, copying the
    state for the next fill), so that no llguidance work a request causes goes uncounted.
    The stretch's time goes to `mask_s` and `round_mask_s`, less what fills inside it counted
    themselves (`fill_row`, a budget rule's `Spend`), so nothing counts twice.

        with GrammarClock(s.stats):
            ...
    """

    __slots__ = ("stats", "t0", "before")

    def __init__(self, stats: StepTimings | None) -> None:
        self.stats = stats

    def __enter__(self) -> "GrammarClock":
        if self.stats is not None:
            self.before = self.stats.mask_s
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        st = self.stats
        if st is None:
            return
        extra = time.perf_counter() - self.t0 - (st.mask_s - self.before)
        if extra > 0:
            st.mask_s += extra
            st.round_mask_s += extra


def single_allowed(bitmask: np.ndarray) -> int | None:
    """The one allowed token id of a packed mask row, or None when 0 or 2+ are allowed."""
    nz = np.flatnonzero(bitmask)
    if nz.size != 1:
        return None
    word = int(bitmask[nz[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return int(nz[0]) * 32 + word.bit_length() - 1


def _low_priority() -> None:
    """A worker thread's nice value raised (Linux: per thread), so that on a machine whose
    cores the forward needs, a slow grammar's fills take what the forward leaves."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not per thread here (macOS): left as it is
        pass


class FillPools:
    """The workers that fill next masks between rounds, made on first use: a request's fills
    go to `fast` until one is slow, then to `slow` (low priority). A fill cannot be
    interrupted: one whose request was stopped runs on and its row is dropped, so there are
    more workers than requests in a batch."""

    def __init__(self, fast: int = 8, slow: int = 16) -> None:
        self.sizes = (fast, slow)
        self._pools: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = None
        self._lock = threading.Lock()

    def pool(self, slow: bool) -> ThreadPoolExecutor:
        if self._pools is None:
            with self._lock:
                if self._pools is None:
                    self._pools = (
                        ThreadPoolExecutor(self.sizes[0], thread_name_prefix="specdec-mask"),
                        ThreadPoolExecutor(self.sizes[1], thread_name_prefix="specdec-slow-mask",
                                           initializer=_low_priority))
        return self._pools[slow]


@dataclass(frozen=True)
class NextMask:
    """A request's mask at its current state, filled off the round: the packed row, its
    fill time, and the error its state entered while filling (None: none)."""

    row: np.ndarray
    seconds: float
    error: SpecdecError | None = None


def _fill_next(state: GrammarState, vocab_size: int, position: int) -> NextMask:
    """(on a `FillPools` worker, on the caller's own copy of the state)"""
    row = llnp.allocate_token_bitmask(1, vocab_size)
    t0 = time.perf_counter()
    error: SpecdecError | None = None
    try:
        llnp.fill_next_token_bitmask(state, row, 0)
        if state.is_error():
            error = failure_of(state, "grammar error while masking", position)
    except Exception as e:  # the request fails, not the round
        error = failure("grammar error while masking", stop="InternalError",
                        detail=f"mask fill failed: {e}", position=position)
    return NextMask(row[0], time.perf_counter() - t0, error)


class RequestGrammar:
    """One request's grammar (see the module docstring).

    Attributes:
        state: the grammar's state after the request's output so far.
        rule: the budget rule that closes the answer in time (`budget`), or None.
        slow: one of its fills was slow: its fills go to the low-priority pool.
        started: when the pending next-mask fill was asked for (perf_counter).
    """

    POOLS = FillPools()  # every request's (made on first use)

    def __init__(self, state: GrammarState, rule: BudgetRule | None = None,
                 pools: FillPools | None = None) -> None:
        check(state, 0)
        self.state = state
        self.rule = rule
        self.slow = False
        self.started = 0.0
        self._next: Future | None = None
        self._pools = pools or self.POOLS

    # -- the state -------------------------------------------------------------------------
    def clone(self) -> GrammarState:
        """A copy of the state to advance speculatively (the request's is never)."""
        return self.state.deep_copy()

    def consume(self, token: TokenId, position: int) -> None:
        """Take an emitted token; raises the grammar's error where the state fails."""
        self.state.consume_token(token)
        check(self.state, position)

    def advance_rule(self, token: TokenId) -> None:
        """Move the budget rule's place past an emitted token (the state took it)."""
        if self.rule is not None:
            self.rule.advance(token, matcher=self.state)

    def stopped(self) -> bool:
        """Whether the grammar is complete (nothing may follow)."""
        return bool(self.state.is_stopped())

    def ended_reasoning(self) -> bool:
        """Whether the last token taken completed the reasoning's end marker."""
        return ended_reasoning(self.state)

    def fill_row(self, bitmask: np.ndarray, j: int, stats: StepTimings | None) -> None:
        """The mask at the current state into row j (`fill_row`)."""
        fill_row(self.state, bitmask, j, stats)

    @staticmethod
    def single_allowed(bitmask: np.ndarray) -> int | None:
        return single_allowed(bitmask)

    # -- the next mask, filled off the round ------------------------------------------------
    def ask_next_mask(self, vocab_size: int, position: int) -> None:
        """Start filling the mask at the current state, on a worker."""
        self.started = time.perf_counter()
        self._next = self._pools.pool(self.slow).submit(_fill_next, self.state.deep_copy(),
                                                        vocab_size, position)

    @property
    def next_mask(self) -> Future | None:
        """The pending fill (None: none asked for, or taken)."""
        return self._next

    def take_next_mask(self, stats: StepTimings) -> NextMask | None:
        """The mask at the current state, waiting for its fill (None when none was asked
        for); its time counts in `stats`."""
        if self._next is None:
            return None
        m: NextMask = self._next.result()
        self._next = None
        stats.mask_s += m.seconds
        stats.mask_max_s = max(stats.mask_max_s, m.seconds)
        return m

    def drop_next_mask(self) -> None:
        """Forget the pending fill (a finished request's)."""
        self._next = None
