"""Think, then answer under the constraint: one grammar from the first token to the last.

A reasoning request's grammar is the think block (free text up to the template's
end-of-thinking marker, which the text itself may not contain), a fixed separator, then the
request's constraint (`think_grammar`). Every decode path masks with that one matcher, so
forced tokens, prompt lookup and draft proposals cross the end of thinking like any other
position, and speculative output stays plain output.

The thinking budget is the one rule outside the grammar (llguidance's own `max_tokens`
disables the rollback speculation needs): `ThinkingMatcher` wraps the request's matcher and,
once `budget` output tokens were spent inside the think block, allows only the end marker's
tokens, one by one; the grammar allows them there, so the answer follows as usual.

Markers: when the marker is a single token of the vocabulary (Qwen 3, DeepSeek-R1: added
tokens), the grammar names that token; otherwise the marker is text.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from llguidance import LLMatcher, LLTokenizer

SEPARATOR = "\n\n"  # between the end of thinking and the answer (Qwen 3's and R1's format)


@dataclass(frozen=True)
class Thinking:
    """How a request thinks before its constrained answer.

    Attributes:
        close: the end-of-thinking marker (`</think>`).
        open: the marker the output must start with, or None when the prompt already opened
            the think block (the template's generation prompt ends inside it).
        budget: most output tokens inside the think block before the end marker is forced
            (None: no limit but max_tokens).
    """

    close: str
    open: str | None = None
    budget: int | None = None

    def __post_init__(self) -> None:
        if not self.close:
            raise ValueError("the end-of-thinking marker must be non-empty")
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget < 0):
            raise ValueError(f"thinking budget {self.budget!r}: must be an integer >= 0")


def marker_ids(tokenizer: LLTokenizer, marker: str) -> tuple[tuple[int, ...], bool]:
    """The marker's token ids, and whether it is one special token (named in the grammar by
    id) rather than text."""
    ids = tuple(tokenizer.tokenize_str(marker))
    return ids, len(ids) == 1 and tokenizer.is_special_token(ids[0])


def _lark_marker(tokenizer: LLTokenizer, marker: str) -> str:
    ids, special = marker_ids(tokenizer, marker)
    return f"<[{ids[0]}]>" if special else json.dumps(marker)


def _regex_literal(text: str) -> str:
    return "".join(c if c.isalnum() else f"\\x{ord(c):02x}" if ord(c) < 128 else c
                   for c in text)


def think_grammar(answer: str, thinking: Thinking, tokenizer: LLTokenizer) -> str:
    """The llguidance grammar (TopLevelGrammar JSON) for: [open marker] thinking text, end
    marker, SEPARATOR, then the `answer` grammar (any text `to_grammar` returns)."""
    text = answer.strip()
    subs = json.loads(text)["grammars"] if text.startswith("{") else [{"lark_grammar": answer}]
    names = {g.get("name") for g in subs[1:]}
    name = next(n for n in ("answer", "answer_", "answer__", "_answer") if n not in names)
    close = _regex_literal(thinking.close)
    opener = _lark_marker(tokenizer, thinking.open) + " " if thinking.open else ""
    if marker_ids(tokenizer, thinking.close)[1]:  # text without the marker, then its token
        think = (f"THINK {_lark_marker(tokenizer, thinking.close)}\n"
                 f"THINK: /(?s:.*)/ & ~/(?s:.*){close}(?s:.*)/\n")
    else:  # the shortest text that ends with the marker
        think = f"think\nthink[lazy]: /(?s:.*){close}/\n"
    first, _, rest = think.partition("\n")
    lark = f"start: {opener}{first} {json.dumps(SEPARATOR)} @{name}\n{rest}"
    return json.dumps({"grammars": [{"lark_grammar": lark}, {**subs[0], "name": name},
                                    *subs[1:]]})


class ThinkingMatcher:
    """An `LLMatcher` with a thinking budget: the same interface the decode paths use
    (`unsafe_compute_mask_ptr` for `llguidance.numpy`, `consume_token`, `deep_copy`, ...).

    Counts output tokens from the start of the think block (after the open marker when the
    output opens it) until the end marker is complete (its one special token, or its text in
    the output's bytes); from `budget` tokens in, while thinking, the mask allows only the
    end marker's next token (fail closed: if the grammar does not allow it, the
    mask is empty and the matcher reports an error).
    """

    def __init__(self, inner: LLMatcher, tokenizer: LLTokenizer, thinking: Thinking,
                 vocab_size: int) -> None:
        self.inner = inner
        self.tokenizer = tokenizer
        self.budget = thinking.budget
        self.close_ids, self.special = marker_ids(tokenizer, thinking.close)
        self.close_bytes = thinking.close.encode()
        self.open_bytes = (thinking.open or "").encode()
        self.vocab_size = vocab_size
        self.n = 0  # output tokens consumed
        self.start: int | None = None if thinking.open else 0  # where the thinking text begins
        self.thinking = True
        self.forced = 0  # end-marker tokens the budget has forced so far
        self.tail = b""  # the output's bytes since the last marker (a bounded window)
        self._error: str | None = None

    # -- state ------------------------------------------------------------------------
    def _due(self) -> int | None:
        """The end marker's token the budget forces next (the first one only where the
        grammar allows it), or None."""
        if (not self.thinking or self.budget is None or self.start is None
                or self.n - self.start < self.budget or self.forced >= len(self.close_ids)):
            return None
        return self.close_ids[self.forced]

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        self.inner.unsafe_compute_mask_ptr(ptr, size)
        due = self._due()
        if due is None:
            return
        row = np.ctypeslib.as_array((ctypes.c_int32 * (size // 4)).from_address(ptr))
        ok = bool((int(row[due >> 5]) >> (due & 31)) & 1)
        if not ok and self.forced == 0:
            return  # mid-character, say: the marker starts where the grammar allows it
        row[:] = 0
        if ok:
            row[due >> 5] = np.int32(np.uint32(1 << (due & 31)).view(np.int32))
        elif not self.inner.is_error():
            self._error = (f"thinking budget: the grammar does not allow the end marker's "
                           f"token {due} at output position {self.n}")

    def _forces(self) -> int | None:
        """The token the budget forces at this position (None: the grammar decides)."""
        due = self._due()
        if due is None or self.forced > 0:
            return due
        row = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)  # as the mask says
        self.inner.deep_copy().unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return due if (int(row[due >> 5]) >> (due & 31)) & 1 else None

    def consume_token(self, token: int) -> bool:
        forced = self._forces()
        if forced is not None and token != forced:
            self._error = (f"thinking budget: token {token} at output position {self.n} where "
                           f"only {forced} (the end marker) is allowed")
            return False
        if forced is not None:
            self.forced += 1
        ok = bool(self.inner.consume_token(token))
        self.n += 1
        if not self.thinking:
            return ok
        marker = self.open_bytes if self.start is None else self.close_bytes
        self.tail = (self.tail + self.tokenizer.decode_bytes([token]))[-4 * len(marker):]
        if self.start is None:
            if self.open_bytes in self.tail:  # the output opened the think block
                self.start, self.tail = self.n, b""
        elif self.special:
            self.thinking = token != self.close_ids[0]
        else:
            self.thinking = self.close_bytes not in self.tail
        return ok

    def deep_copy(self) -> "ThinkingMatcher":
        c = object.__new__(ThinkingMatcher)
        c.__dict__.update(self.__dict__)
        c.inner = self.inner.deep_copy()
        return c

    def is_error(self) -> bool:
        return self._error is not None or bool(self.inner.is_error())

    def get_error(self) -> str:
        return self._error or str(self.inner.get_error())

    def __getattr__(self, name: str) -> Any:  # is_stopped, is_accepting, validate_tokens, ...
        if name in ("rollback", "reset", "consume_tokens", "try_consume_tokens"):
            raise AttributeError(f"ThinkingMatcher does not support {name}")
        return getattr(self.inner, name)


def split_reasoning(text: str, thinking: Thinking) -> tuple[str, str | None]:
    """An output's (reasoning, answer): the text between the markers, and the text after the
    end marker and separator (None while thinking has not ended)."""
    if thinking.open and text.startswith(thinking.open):
        text = text[len(thinking.open):]
    at = text.find(thinking.close)
    if at < 0:  # still thinking (or cut): a partial end marker is not reasoning
        for k in range(min(len(thinking.close) - 1, len(text)), 0, -1):
            if text.endswith(thinking.close[:k]):
                return text[:-k], None
        return text, None
    rest = text[at + len(thinking.close):]
    if rest.startswith(SEPARATOR):
        return text[:at], rest[len(SEPARATOR):]
    return text[:at], "" if SEPARATOR.startswith(rest) else rest


class ReasoningDeltas:
    """Streamed text deltas → (reasoning delta, answer delta) pairs, holding back what could
    still be the start of a marker; joining them gives `split_reasoning` of the whole."""

    def __init__(self, thinking: Thinking) -> None:
        self.thinking = thinking
        self.text = ""
        self.sent_reasoning = self.sent_answer = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        reasoning, answer = split_reasoning(self.text, self.thinking)
        if answer is None and not final:
            hold = len(self.thinking.close) + len(self.thinking.open or "")
            reasoning = reasoning[:max(len(reasoning) - hold, self.sent_reasoning)]
        r = reasoning[self.sent_reasoning:]
        a = (answer or "")[self.sent_answer:]
        self.sent_reasoning += len(r)
        self.sent_answer += len(a)
        return r, a
