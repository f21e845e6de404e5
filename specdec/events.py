"""What a submitted request produces: one typed event stream, the same for every caller.

`Engine.submit` returns a `RequestStream`; the scheduler thread puts events into it and the
caller iterates it (blocking, or `async for` on an event loop). A stream holds, in order:
`ReasoningDelta`s (a thinking request's think block), `TextDelta`s (the answer),
`ToolCallDelta`s (the calls), then exactly one `Finished` or `Failed`. Joining the deltas
gives exactly the `Finished` event's `reasoning`, `text` and calls' arguments.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from .errors import SchedulerStopped, SpecdecError
from .request import ToolCall  # a complete call, as in the conversation's history
from .speculative import SpecStats
from .types import FinishReason, TokenId



@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the distribution it was picked from (the
    target's logits with the bias, under the grammar mask, at the temperature; before top-k
    and top-p), and the `top` most likely tokens of that distribution, best first."""

    token: TokenId
    logprob: float
    top: tuple[tuple[TokenId, float], ...] = ()


# Where an emitted token came from (`TokenSource.source`): "forced": its grammar allowed
# only this token there (whoever proposed it), or the grammar's forced text proposed it; else
# the source of the proposal the target accepted on its chain (`types.ProposalSource`'s
# values: "looked_up" prompt lookup, "suffixed" earlier answers, "drafted" the draft model);
# "branch": a token tree's branch the target accepted; "target": the target's own pick (a
# round's last token, every token of plain decoding); "budget": the token budget's closing
# rule put it in place of the target's pick.
SOURCES = ("forced", "looked_up", "suffixed", "drafted", "branch", "target", "budget")


@dataclass(frozen=True)
class TokenSource:
    """Where an emitted token came from (one of `SOURCES`) and how many tokens its grammar
    allowed at its position (None: unconstrained there), for requests that ask for them
    (`GenerateRequest.token_sources`)."""

    source: str
    allowed: int | None = None


@dataclass(frozen=True)
class TextDelta:
    """Answer text, with the output tokens behind it (and their logprobs and sources when
    asked for)."""

    text: str
    tokens: tuple[TokenId, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    sources: tuple[TokenSource, ...] = ()


@dataclass(frozen=True)
class ReasoningDelta:
    """Think-block text (markers excluded), with the tokens behind it."""

    text: str
    tokens: tuple[TokenId, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    sources: tuple[TokenSource, ...] = ()


@dataclass(frozen=True)
class ToolCallDelta:
    """Part of call `index`: its id and name come with its first delta; `arguments` is
    JSON text to append."""

    index: int
    id: str
    name: str
    arguments: str
    tokens: tuple[TokenId, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    sources: tuple[TokenSource, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int | None = None  # of completion_tokens; None: not a thinking request
    cached_tokens: int = 0  # of prompt_tokens: positions restored from the prompt store

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class GenerationStats:
    """What one request cost. Times in seconds; the decode loop's counters (`prefill_s`,
    `mask_s`, `rounds`, `accepted`, `grammar_cuts`, ...; zero for plain decoding) are
    `counters`'."""

    prompt_tokens: int
    completion_tokens: int
    decode_s: float
    seed: int | None
    k: int
    counters: SpecStats
    seconds: float = 0.0  # from submission (waiting included) to the end

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "counters"}
        d.update(self.counters.as_dict())
        d["tokens_per_s"] = round(self.tokens_per_s, 3)
        d["acceptance_rate"] = round(self.counters.acceptance_rate, 4)
        return d


@dataclass(frozen=True)
class Finished:
    """The request's end: why, and the whole output.

    Attributes:
        finish_reason: "stop" (EOS, the grammar complete, a stop string), "length"
            (max_tokens; a tool call that could not be completed ends so, with no call), or
            "tool_calls".
        text: the answer (content), stop strings cut; "" when the output is a call.
        reasoning: the think block (None: not a thinking request).
        tool_calls: the calls made.
        tokens: the output tokens behind the text (EOS excluded; a stop string's cut drops
            the tokens that lie wholly inside or after it); logprobs, sources: theirs, when
            asked.
        usage, stats, warnings: token counts, costs, what the constraint did not enforce.
        stop_sequence: the stop string that ended the output (None: EOS, the grammar, or
            max_tokens).
    """

    finish_reason: FinishReason
    text: str
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]
    tokens: tuple[TokenId, ...]
    logprobs: tuple[TokenLogprob, ...]
    usage: Usage
    stats: GenerationStats
    warnings: tuple[str, ...] = ()
    stop_sequence: str | None = None
    sources: tuple[TokenSource, ...] = ()


@dataclass(frozen=True)
class Failed:
    """The request failed; nothing past the failure was emitted."""

    error: SpecdecError


Event = TextDelta | ReasoningDelta | ToolCallDelta | Finished | Failed


@dataclass(eq=False)
class RequestStream:
    """A submitted request's events, in order, ending with `Finished` or `Failed`.

    Iterate it (blocking) or `async for` it on the event loop it was bound to (`bind`,
    before submitting). `cancel()` stops the request within one round (a client that left;
    the stream then ends with `Failed`). A stream with `pump` (a scheduler without a thread
    of its own) runs rounds on the iterating thread until its next event is in. Once its
    last event was read (or its reader stopped early and the rest was drained), iterating
    it again yields nothing.
    """

    cancelled: threading.Event = field(default_factory=threading.Event)
    _q: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _loop: asyncio.AbstractEventLoop | None = None
    _aq: asyncio.Queue | None = None
    pump: Callable[[], bool] | None = None
    ended: bool = False  # its Finished or Failed was read

    def bind(self, loop: asyncio.AbstractEventLoop) -> "RequestStream":
        self._loop, self._aq = loop, asyncio.Queue()
        return self

    def put(self, event: Event) -> None:
        """From the scheduler thread."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, event)  # type: ignore
            except RuntimeError:  # its event loop is closed: nobody is listening
                self.cancelled.set()
        else:
            self._q.put(event)

    def cancel(self) -> None:
        self.cancelled.set()

    def __iter__(self) -> Iterator[Event]:
        if self.ended:
            return
        try:
            for ev in self._events():
                self.ended = isinstance(ev, (Finished, Failed))
                yield ev
        finally:
            if not self.ended:  # the caller stopped reading: stop the request too
                self.cancel()
                if self.pump is not None:  # no thread will: the next round drops it
                    for ev in self._events():
                        if isinstance(ev, (Finished, Failed)):
                            self.ended = True
                            break

    def _events(self) -> Iterator[Event]:
        while True:
            if self.pump is None:
                ev = self._q.get()
            else:
                try:
                    ev = self._q.get_nowait()
                except queue.Empty:
                    if not self.pump() and self._q.empty():
                        ev = Failed(SchedulerStopped("the engine stopped after a fatal error"))
                    else:
                        continue
            yield ev
            if isinstance(ev, (Finished, Failed)):
                return

    async def next(self, timeout: float | None = None) -> Event | None:
        """The next event, or None when `timeout` seconds pass first."""
        assert self._aq is not None, "bind the stream to the event loop before submitting"
        try:
            return await asyncio.wait_for(self._aq.get(), timeout)
        except asyncio.TimeoutError:
            return None

    async def __aiter__(self) -> AsyncIterator[Event]:
        while True:
            ev = await self.next()
            assert ev is not None
            yield ev
            if isinstance(ev, (Finished, Failed)):
                return
