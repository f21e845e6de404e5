"""One request's emitted tokens → its typed events (`events`): the one place where stop
strings, logprobs, usage, the reasoning/answer split and tool calls are computed, for every
caller (CLI, library, server, benchmarks).

`TextStream` turns tokens into stable text deltas and applies stop strings; `Output` routes
that text into reasoning, answer or a tool call and puts the events into the request's sink.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .errors import SpecdecError
from .events import (Event, Failed, FinishReason, Finished, GenerationStats, ReasoningDelta,
                     TextDelta, TokenId, TokenLogprob, TokenSource, ToolCall, ToolCallDelta,
                     Usage)
from .reasoning import ReasoningDeltas, Thinking, reasoning_bounds, split_reasoning
from .speculative import SpecStats
from .tools import ID, CallParser


class TextStream:
    """Token ids → text deltas for one request, applying its stop strings.

    With `thinking` (a reasoning request's protocol), stop strings apply to the answer only,
    never to the reasoning before it.

    Incremental: each token decodes a short window (the tokens since the last stable point
    plus the few before it, as their context), so a long output costs O(n), not O(n²). Text
    is stable once the window decodes to more than its context and does not end in U+FFFD
    (a byte-fallback or byte-level tokenizer's partial character: one U+FFFD per pending
    byte). Deltas also hold back a possible stop-string prefix. The final text is the stable
    text plus the flushed remainder, so a client that joins the deltas gets exactly it.

    `starts[i]` is where token i's text begins in the text (at most: a token fed while a
    character was pending counts from that character's start); a stop string's cut keeps the
    tokens that begin before it (`kept`).
    """

    def __init__(self, decode: Any, stop: Sequence[str], thinking: Thinking | None = None,
                 calls_from: Sequence[str] = ()) -> None:
        self._decode, self._stop = decode, tuple(stop)
        self._thinking = thinking  # stop strings apply only in the answer after it
        self._calls_from = tuple(c for c in calls_from if c)  # ... and never inside calls
        self._hold = max((len(x) for x in stop), default=0)
        self.tokens: list[TokenId] = []
        self.starts: list[int] = []
        self._text = ""  # stable text
        self._prefix = self._read = 0  # token offsets: window context start, stable end
        self.sent = 0  # characters of _text sent
        self._cut: str | None = None
        self._recheck: int | None = None  # where to search again for a stop that waited
        self.stopped_by: str | None = None  # the stop string that cut, once one did

    def _advance(self, flush: bool = False) -> None:
        context = self._decode(self.tokens[self._prefix:self._read]) if self._read else ""
        window = self._decode(self.tokens[self._prefix:])
        if flush or (len(window) > len(context) and not window.endswith("\ufffd")):
            self._text += window[len(context):]
            self._prefix, self._read = self._read, len(self.tokens)

    def _find_stop(self, since: int, final: bool = False) -> bool:
        if not self._stop:
            return False
        start = max(0, since - self._hold + 1)
        if self._recheck is not None:  # a hit that waited for possible call markup
            start, self._recheck = min(start, self._recheck), None
        answer = 0
        if self._thinking is not None:
            at = reasoning_bounds(self._text, self._thinking)[2]
            if at is None:
                return False
            answer = at
            start = max(start, answer)
        limit = min((at for at in (self._text.find(c, answer) for c in self._calls_from)
                     if at >= 0), default=None)
        if not final:  # where a call's markup may be starting, stop strings wait for it
            held = max((_suffix_prefix(self._text, c) for c in self._calls_from), default=0)
            if held:
                at = len(self._text) - held
                limit = at if limit is None else min(limit, at)
                self._recheck = at if self._recheck is None else min(self._recheck, at)
        hits = [(i, x) for i, x in ((self._text.find(x, start), x) for x in self._stop)
                if i >= 0 and (limit is None or i < limit)]
        if hits:
            at, self.stopped_by = min(hits, key=lambda h: (h[0], -len(h[1])))
            self._cut = self._text[:at]
        return bool(hits)

    def feed(self, tok: TokenId) -> tuple[str, bool]:
        """Add a token; returns (text delta, whether a stop string ended the output)."""
        self.starts.append(len(self._text))
        self.tokens.append(tok)
        before = len(self._text)
        self._advance()
        if self._find_stop(before):
            return "", True
        safe = len(self._text) - (self._hold - 1 if self._hold else 0)
        delta = self._text[self.sent:max(safe, self.sent)]
        self.sent += len(delta)
        return delta, False

    def close(self, finish: FinishReason) -> tuple[FinishReason, str]:
        """The finish reason and the full text (a stop string's cut wins)."""
        if self._cut is None:
            before = len(self._text)
            self._advance(flush=True)
            self._find_stop(before, final=True)
        if self._cut is not None:
            return "stop", self._cut
        return finish, self._text

    def kept(self, text: str) -> int:
        """How many tokens lie behind the final `text` (all, unless a stop string cut it)."""
        if self._cut is None:
            return len(self.tokens)
        return sum(1 for s in self.starts if s < len(text))


class Output:
    """Routes one request's tokens into events and hands them to `sink`.

    Args:
        decode: token ids → text.
        sink: called with each event (on the scheduler thread).
        stop: stop strings (answer text only: never inside reasoning or a call).
        thinking: the request's think block, or None.
        calls: reads the answer as text and tool calls (`tools.CallParser`): text deltas
            never hold call markup; a call streams as `ToolCallDelta`s (its id and name
            first, then its arguments); a call cut by max_tokens is not reported in
            `Finished` (finish "length"), never half-written.
        reasoning_tokens: counts a thinking output's think-block tokens.
        prompt_tokens, seed, k, warnings: reported in `Finished`.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], sink: Callable[[Event], None],
                 *, stop: Sequence[str] = (), thinking: Thinking | None = None,
                 calls: CallParser | None = None,
                 reasoning_tokens: Callable[[Sequence[int], Thinking], int] | None = None,
                 prompt_tokens: int = 0, seed: int | None = None, k: int = 0,
                 warnings: tuple[str, ...] = ()) -> None:
        fmt = calls.fmt if calls is not None else None
        starts = ((fmt.marker, fmt.first) + ((fmt.text_open + fmt.after_text.split(ID)[0],)
                                              if fmt.after_text is not None else ())
                  if fmt else ())
        self.text = TextStream(decode, stop, thinking, calls_from=starts)
        self.sink, self.thinking, self.calls = sink, thinking, calls
        self.split = ReasoningDeltas(thinking) if thinking is not None else None
        self._reasoning_tokens = reasoning_tokens
        self.prompt_tokens, self.seed, self.k, self.warnings = prompt_tokens, seed, k, warnings
        self.logprobs: list[TokenLogprob | None] = []
        self.sources: list[TokenSource | None] = []
        self._attached = 0  # tokens already carried by an event
        self._ready = 0  # tokens whose text has been released (carried by the next event)
        self._answer = ""  # the answer so far (read by `calls`)
        self._text_sent = 0  # characters of the calls' answer text sent
        self._args_sent: dict[int, int] = {}  # call index -> characters of arguments sent
        self._parsed: dict[int, Any] = {}  # the calls read so far, by index
        self._cut_short = False  # max_tokens ended the output

    def _emit(self, delta: str, upto: int, final: bool = False) -> None:
        """Send a text delta; the first event sent carries the tokens not yet carried that
        begin before `upto` characters (all of them when `final`). Text held back (a possible
        marker) keeps its tokens for the event that sends it."""
        if not delta and not final:
            return
        n = self._ready
        while n < len(self.text.tokens) and (final or self.text.starts[n] < upto):
            n += 1
        self._ready = n
        r, a = (("", delta) if self.split is None else self.split.feed(delta, final))
        events: list[tuple[Any, tuple[Any, ...]]] = [(ReasoningDelta, (r,))] if r else []
        if self.calls is None:
            if a:
                events.append((TextDelta, (a,)))
        else:
            self._answer += a
            events += self._call_events(final)
            if final and not events and self._ready > self._attached and self._args_sent:
                # the call's closing markup: carried by an empty delta of the last call
                last = max(self._args_sent)
                c = self._parsed[last]
                events.append((ToolCallDelta, (c.index, c.id, c.name, "")))
        for i, (kind, fields) in enumerate(events):
            toks, lps, srcs = self._take() if i == 0 else ((), (), ())
            self.sink(kind(*fields, toks, lps, srcs))

    def _call_events(self, final: bool) -> list[tuple[Any, tuple[Any, ...]]]:
        """What became certain of the answer's text and calls since the last time."""
        assert self.calls is not None
        text, certain, calls = self.calls.parse(self._answer, final, cut=self._cut_short)
        self._parsed = {c.index: c for c in calls}
        out: list[tuple[Any, tuple[Any, ...]]] = []
        if certain > self._text_sent:
            out.append((TextDelta, (text[self._text_sent:certain],)))
            self._text_sent = certain
        fmt = self.calls.fmt
        whole = fmt.xml is not None or fmt.id_len > 0  # arguments known once complete
        for c in calls:
            if whole and not c.done:
                break
            sent = self._args_sent.get(c.index)
            if sent is None or len(c.arguments) > sent:
                out.append((ToolCallDelta, (c.index, c.id, c.name, c.arguments[sent or 0:])))
                self._args_sent[c.index] = len(c.arguments)
        return out

    def _take(self) -> tuple[tuple[TokenId, ...], tuple[TokenLogprob, ...],
                             tuple[TokenSource, ...]]:
        """The tokens ready and not yet carried by an event, with their logprobs and
        sources."""
        a, self._attached = self._attached, self._ready
        return (tuple(self.text.tokens[a:self._ready]),
                tuple(x for x in self.logprobs[a:self._ready] if x is not None),
                tuple(x for x in self.sources[a:self._ready] if x is not None))

    def feed(self, token: TokenId, logprob: TokenLogprob | None = None,
             source: TokenSource | None = None) -> bool:
        """Add an emitted token (with its logprob and source, where asked for); returns True
        when a stop string ended the output."""
        self.logprobs.append(logprob)
        self.sources.append(source)
        delta, stopped = self.text.feed(token)
        if not stopped:
            self._emit(delta, self.text.sent)
        return stopped

    def fail(self, error: SpecdecError) -> None:
        self.sink(Failed(error))

    def finish(self, finish: FinishReason, counters: SpecStats, seconds: float) -> Finished:
        """Flush what was held back and send `Finished`; returns it."""
        finish, full = self.text.close(finish)
        self._cut_short = finish == "length"
        kept = self.text.kept(full)
        sent = self.text.sent
        self.text.tokens, self.text.starts = self.text.tokens[:kept], self.text.starts[:kept]
        self._ready, self._attached = min(self._ready, kept), min(self._attached, kept)
        self.text.sent = len(full)
        self._emit(full[sent:], len(full), final=True)
        tokens = tuple(self.text.tokens)
        reasoning, answer = None, full
        n_reasoning = None
        if self.thinking is not None:
            reasoning, answer = split_reasoning(full, self.thinking)
            answer = answer or ""
            if self._reasoning_tokens is not None:
                n_reasoning = self._reasoning_tokens(tokens, self.thinking)
        calls: tuple[ToolCall, ...] = ()
        if self.calls is not None:
            answer, _, parsed = self.calls.parse(answer, final=True, cut=self._cut_short)
            calls = tuple(ToolCall(c.id, c.name, c.arguments) for c in parsed if c.done)
            if calls and finish == "stop":
                finish = "tool_calls"
        stats = GenerationStats(
            prompt_tokens=self.prompt_tokens, completion_tokens=kept,
            decode_s=max(seconds - counters.prefill_s, 0.0), seed=self.seed, k=self.k,
            counters=counters, seconds=seconds)
        done = Finished(finish, answer, reasoning, calls, tokens,
                        tuple(x for x in self.logprobs[:kept] if x is not None),
                        Usage(self.prompt_tokens, kept, n_reasoning,
                              min(counters.prompt_cached, self.prompt_tokens)), stats, self.warnings,
                        self.text.stopped_by,
                        tuple(x for x in self.sources[:kept] if x is not None))
        self.sink(done)
        return done


def _suffix_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` are a proper start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
