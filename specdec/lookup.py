"""Prompt lookup: propose what followed the last time the context's suffix appeared (in the
request's own context, `NgramIndex`; in earlier answers, `SuffixStore`).

Extraction copies spans of the prompt into the output; once the output has started copying,
the continuation is in the context already. The index maps every n-gram (n <= max_n) of the
growing context to the position right after its latest occurrence, so a lookup is a few
dict probes and extending the context is O(max_n) per token.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

from .types import TokenId


_END = -1  # between outputs in a store's index: no n-gram crosses it, no proposal is it


class NgramIndex:
    """Latest continuation of each n-gram of a token sequence that only grows.

    Args:
        tokens: the initial context (the prompt).
        max_n: longest n-gram indexed (the longest suffix a lookup tries first).
        older: earlier continuations kept per n-gram, each starting with a token the later
            ones do not (token-tree branches); only n-grams seen followed by different
            tokens hold any.
    """

    def __init__(self, tokens: Iterable[TokenId] = (), max_n: int = 4, older: int = 2) -> None:
        if max_n < 1:
            raise ValueError(f"max_n={max_n}: must be >= 1")
        self.max_n, self.older = max_n, older
        self.tokens: list[TokenId] = []
        self._after: list[dict[tuple[TokenId, ...], int]] = [{} for _ in range(max_n + 1)]
        self._older: list[dict[tuple[TokenId, ...], tuple[int, ...]]] = \
            [{} for _ in range(max_n + 1)]
        self.extend(tokens)

    def extend(self, tokens: Iterable[TokenId]) -> None:
        """Append tokens; each n-gram ending before a new token now has that continuation."""
        toks = self.tokens
        for t in tokens:
            t = int(t)
            p = len(toks)  # index of the new token: the continuation of what precedes it
            for n in range(1, min(self.max_n, p) + 1):
                gram = tuple(toks[p - n:p])
                last = self._after[n].get(gram)
                self._after[n][gram] = p
                if last is None or not self.older:
                    continue
                prev = self._older[n].get(gram, ())
                if toks[last] != t:
                    prev = (last, *prev)
                prev = tuple(q for q in prev if toks[q] != t)[:self.older]
                if prev:
                    self._older[n][gram] = prev
                else:
                    self._older[n].pop(gram, None)
            toks.append(t)

    def find(self, suffix: Sequence[TokenId], min_n: int) -> tuple[int, int] | None:
        """(position of the continuation, match length) for the longest suffix of `suffix`
        (at least `min_n` tokens) seen before, or None."""
        for n in range(min(self.max_n, len(suffix)), min_n - 1, -1):
            p = self._after[n].get(tuple(suffix[len(suffix) - n:]))
            if p is not None:
                return p, n
        return None

    def continuations(self, suffix: Sequence[TokenId], min_n: int, depth: int
                      ) -> list[list[TokenId]]:
        """What followed each match of `suffix`'s last n tokens (n from the longest indexed
        down to `min_n`; for each, the latest occurrence, then the `older` ones), up to
        `depth` tokens each and stopping at an output's end: one run per distinct first
        token, longest match first, latest first (token-tree branches)."""
        runs: dict[TokenId, list[TokenId]] = {}
        toks = self.tokens
        for n in range(min(self.max_n, len(suffix)), min_n - 1, -1):
            gram = tuple(suffix[len(suffix) - n:])
            p = self._after[n].get(gram)
            if p is None:
                continue
            for q in (p, *self._older[n].get(gram, ())):
                if toks[q] == _END or toks[q] in runs:
                    continue
                run = toks[q:q + depth]
                runs[toks[q]] = run[:run.index(_END)] if _END in run else run
        return list(runs.values())


class LookupCursor:
    """Follows one match through a round of proposals.

    `next(context)` gives the token that followed the context's suffix last time (or None);
    after a proposal equal to it the cursor just steps on, otherwise the next call searches
    again with the new suffix.
    """

    def __init__(self, index: NgramIndex, min_n: int) -> None:
        self.index, self.min_n = index, min_n
        self._pos: int | None = None

    def next(self, context: Sequence[TokenId]) -> TokenId | None:
        toks = self.index.tokens
        if self._pos is None or self._pos >= len(toks):
            hit = self.index.find(context[-self.index.max_n:], self.min_n)
            self._pos = hit[0] if hit else None
        return toks[self._pos] if self._pos is not None else None

    def advance(self, proposed: TokenId) -> None:
        """Record the token actually proposed at this position."""
        toks = self.index.tokens
        if self._pos is not None and self._pos < len(toks) and toks[self._pos] == proposed:
            self._pos += 1
        else:
            self._pos = None


def grammar_key(text: str) -> str:
    """A `SuffixStore` key for answers to one grammar: a digest of its text."""
    return hashlib.sha1(text.encode()).hexdigest()


class SuffixStore:
    """Earlier outputs, indexed by n-gram: proposes what followed the context's suffix in a
    recent answer (suffix decoding). Structured answers repeat across requests (a schema's
    keys, enum values, tool names and argument shapes), so the answer to one request
    proposes the next one's run of tokens. Proposals only: the target verifies each, so no
    output of one request reaches another's response.

    One index per key (a digest of a grammar's text: answers to the same schema) and one
    over every output; a lookup tries the key's first. Bounded: the index over every output
    holds at most `max_tokens` tokens of the latest outputs, a key's `key_tokens` (past that
    an index is rebuilt from its newer half), and at most `max_keys` keys are kept (least
    recently used dropped). An indexed token costs ~0.5 KB: ~150 MB at most by default.
    Thread-safe.
    """

    def __init__(self, max_tokens: int = 1 << 15, key_tokens: int = 1 << 13,
                 max_keys: int = 32, max_n: int = 4, max_output: int = 4096) -> None:
        self.max_tokens, self.key_tokens = max_tokens, key_tokens
        self.max_keys, self.max_n = max_keys, max_n
        self.max_output = max_output  # longer outputs are kept to this many first tokens
        self._lock = threading.Lock()
        self._by_key: OrderedDict[str, tuple[NgramIndex, deque[list[TokenId]]]] = OrderedDict()
        self._all = (NgramIndex(max_n=max_n), deque())

    def add(self, key: str | None, tokens: Sequence[TokenId],
            lead: Sequence[TokenId] = ()) -> None:
        """Index an output (under `key`, and in the index over every output). `lead`: the
        prompt's last tokens (the template's answer header), indexed before the output so
        the next answer's first tokens match too."""
        toks = [int(t) for t in tokens[:self.max_output]]
        if len(toks) < 2:
            return
        toks = [int(t) for t in lead[-self.max_n:]] + toks
        with self._lock:
            self._all = self._added(self._all, toks, self.max_tokens)
            if key is not None:
                entry = self._by_key.pop(key, None) or (NgramIndex(max_n=self.max_n), deque())
                self._by_key[key] = self._added(entry, toks, self.key_tokens)
                while len(self._by_key) > self.max_keys:
                    self._by_key.popitem(last=False)

    @staticmethod
    def _added(entry: tuple[NgramIndex, deque[list[TokenId]]], toks: list[TokenId],
               limit: int) -> tuple[NgramIndex, deque[list[TokenId]]]:
        index, outputs = entry
        outputs.append(toks)
        if len(index.tokens) + len(toks) + 1 > limit:
            # Rebuilt from the newer half; readers keep the index they hold.
            kept: deque[list[TokenId]] = deque()
            n = 0
            for out in reversed(outputs):
                if n + len(out) + 1 > limit // 2 and kept:
                    break
                kept.appendleft(out)
                n += len(out) + 1
            index = NgramIndex(max_n=index.max_n)
            for out in kept:
                index.extend(out + [_END])
            return index, kept
        index.extend(toks + [_END])
        return index, outputs

    def indexes(self, key: str | None) -> list[NgramIndex]:
        """The indexes a lookup for `key` tries, in order (the key's, then every output's)."""
        with self._lock:
            entry = self._by_key.get(key) if key is not None else None
            if entry is not None:
                self._by_key.move_to_end(key)  # type: ignore[arg-type]
            return [i for i in (entry[0] if entry else None, self._all[0])
                    if i is not None and i.tokens]

    @property
    def n_tokens(self) -> int:
        with self._lock:
            return len(self._all[0].tokens) + sum(len(i.tokens) for i, _ in
                                                  self._by_key.values())


class SuffixCursor:
    """`LookupCursor` over a store's indexes for one round: the first index whose n-gram
    matches the context's suffix proposes; an output's end proposes nothing."""

    def __init__(self, indexes: Sequence[NgramIndex], min_n: int) -> None:
        self.cursors = [LookupCursor(i, min_n) for i in indexes]
        self._at: LookupCursor | None = None

    def next(self, context: Sequence[TokenId]) -> TokenId | None:
        if self._at is not None:
            t = self._at.next(context)
            if t is not None and t != _END:
                return t
        self._at = None
        for c in self.cursors:
            t = c.next(context)
            if t is not None and t != _END:
                self._at = c
                return t
        return None

    def advance(self, proposed: TokenId) -> None:
        for c in self.cursors:
            c.advance(proposed)
