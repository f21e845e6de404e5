"""Prompt lookup: propose what followed the last time the context's suffix appeared.

Extraction copies spans of the prompt into the output; once the output has started copying,
the continuation is in the context already. The index maps every n-gram (n <= max_n) of the
growing context to the position right after its latest occurrence, so a lookup is a few
dict probes and extending the context is O(max_n) per token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .decode import TokenId


class NgramIndex:
    """Latest continuation of each n-gram of a token sequence that only grows.

    Args:
        tokens: the initial context (the prompt).
        max_n: longest n-gram indexed (the longest suffix a lookup tries first).
    """

    def __init__(self, tokens: Iterable[TokenId] = (), max_n: int = 4) -> None:
        if max_n < 1:
            raise ValueError(f"max_n={max_n}: must be >= 1")
        self.max_n = max_n
        self.tokens: list[TokenId] = []
        self._after: list[dict[tuple[TokenId, ...], int]] = [{} for _ in range(max_n + 1)]
        self.extend(tokens)

    def extend(self, tokens: Iterable[TokenId]) -> None:
        """Append tokens; each n-gram ending before a new token now has that continuation."""
        toks = self.tokens
        for t in tokens:
            p = len(toks)  # index of the new token: the continuation of what precedes it
            for n in range(1, min(self.max_n, p) + 1):
                self._after[n][tuple(toks[p - n:p])] = p
            toks.append(int(t))

    def find(self, suffix: Sequence[TokenId], min_n: int) -> tuple[int, int] | None:
        """(position of the continuation, match length) for the longest suffix of `suffix`
        (at least `min_n` tokens) seen before, or None."""
        for n in range(min(self.max_n, len(suffix)), min_n - 1, -1):
            p = self._after[n].get(tuple(suffix[len(suffix) - n:]))
            if p is not None:
                return p, n
        return None


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
