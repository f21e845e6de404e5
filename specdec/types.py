"""The floor: names every layer of specdec shares, defined once and importing nothing of ours.

Token ids, finish reasons as the library knows them, proposal sources, and the grammar state
every decode path advances (`GrammarState`). The
protocol-neutral request (`request.py`) and every error class (`errors.py`) sit beside this
module on the same floor; the decode core, the scheduler and the Engine import from here,
never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal, Protocol

TokenId = int
MAX_DRAFT_TOKENS = 16  # most proposals one round verifies (a request's KV holds them too)

# Why an output ended: "stop" (EOS, the grammar complete, a stop string), "length" (the token
# budget), "tool_calls" (the output is one or more calls). The decode core ends a request
# with "stop" or "length" only (`DecodeFinish`); reading the output back as calls makes
# "tool_calls".
FinishReason = Literal["stop", "length", "tool_calls"]
DecodeFinish = Literal["stop", "length"]


class ProposalSource(str, Enum):
    """Where a speculative proposal came from. The value is the counter's name in
    `SpecStats` and on the wire (the response's `specdec` extension, /metrics)."""

    FORCED = "forced"  # the grammar allows exactly one token
    LOOKED_UP = "looked_up"  # prompt lookup: a legal continuation of a repeated n-gram
    SUFFIXED = "suffixed"  # earlier answers (`lookup.SuffixStore`)
    DRAFTED = "drafted"  # the draft model


@dataclass
class SourceCount:
    """One source's proposals in a request and how many of them the target accepted
    (`SpecStats.sources`; mutable accumulator)."""

    proposed: int = 0
    accepted: int = 0


class GrammarState(Protocol):
    """A grammar's state at one position, as the decode paths read and advance it: an
    `llguidance.LLMatcher`, or one behind a thinking gate (`reasoning.ThinkingCursor`). The
    request's own state lives in its `request_grammar.RequestGrammar`; the proposer, the
    verify and tree masks and the budget rule work on copies (`deep_copy`)."""

    def consume_token(self, token: TokenId) -> bool: ...

    def deep_copy(self) -> GrammarState: ...

    def is_error(self) -> bool: ...

    def get_error(self) -> str: ...

    def stop_reason(self) -> str: ...

    def is_stopped(self) -> bool: ...

    def is_accepting(self) -> bool: ...

    def compute_ff_tokens(self) -> list[TokenId]: ...

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None: ...
