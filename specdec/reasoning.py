"""Think, then answer under the constraint: one grammar from the first token to the last.

A reasoning protocol is data (`Thinking`): the marker that opens the reasoning (unless the
prompt already did), the marker that ends it, the header between its end and the answer,
and, where the model may answer without reasoning, that answer's own header. `think_grammar`
turns any of them plus the request's constraint into one grammar for the whole output:
[open] reasoning text, end marker, header, then the constraint; or the direct header, then
the constraint. Every decode path masks with that one matcher, so forced tokens, prompt
lookup and draft proposals cross the end of reasoning like any other position, and
speculative output stays plain output.

The formats (`HARMONY`, `GEMMA`, `think_tag`): the think-tag family (`<think>` ...
`</think>` as Qwen 3, DeepSeek R1 / V3.1, GLM, Kimi and MiniMax write it; Seed-OSS's `<seed:think>`; any `<think...>` tag
with a suffix, whose close repeats it), Gemma's channel (`<|channel>thought` ... `<channel|>`)
and OpenAI Harmony (the `analysis` channel ended by `<|end|>`, then the `final` channel's
header). `chat.render_thinking` picks one from what the rendered template writes.

The thinking budget is the one rule outside the grammar (llguidance's own `max_tokens`
disables the rollback speculation needs): a `ThinkingGate` beside the request's matcher
(`ThinkingCursor`), once `budget` output tokens were spent inside the reasoning, allows only
the end marker's tokens, one by one; the grammar allows them there, so the header and answer
follow as usual.

Markers are token sequences: a special token of the vocabulary is named in the grammar by id
(`<|end|>`, or `</think>` where it is one added token), the rest as text.
"""

from __future__ import annotations

import ctypes
import json
import re
from dataclasses import dataclass

import numpy as np
from llguidance import LLMatcher, LLTokenizer

SEPARATOR = "\n\n"  # the think-tag family's header: between `</think>` and the answer


@dataclass(frozen=True)
class Thinking:
    """How a request reasons before its (constrained) answer: one reasoning protocol.

    Attributes:
        close: the end-of-reasoning marker (`</think>`, Harmony's `<|end|>`).
        open: the marker the output must start its reasoning with, or None when the prompt
            already opened it (the template's generation prompt ends inside it).
        budget: most output tokens inside the reasoning before the end marker is forced
            (None: no limit but max_tokens).
        header: what the output writes between the end marker and the answer (the
            think-tag family's blank line, Harmony's final-channel header).
        direct: where the output opens the reasoning and may instead answer at once, the
            answer's header on that branch (Harmony's `<|channel|>final<|message|>`; "" for
            an answer straight away); None: the output must reason first.
        name: the protocol's name (`Protocol.name`).
    """

    close: str
    open: str | None = None
    budget: int | None = None
    header: str = SEPARATOR
    direct: str | None = None
    name: str = "think"

    def __post_init__(self) -> None:
        if not self.close:
            raise ValueError("the end-of-thinking marker must be non-empty")
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget < 0):
            raise ValueError(f"thinking budget {self.budget!r}: must be an integer >= 0")
        if self.direct is not None and self.open is None:
            raise ValueError("an answer without reasoning needs the output to open it")


@dataclass(frozen=True)
class Protocol:
    """A reasoning format's spelling: its markers, the header before the answer after
    reasoning (`after`), and the answer's header without reasoning (`direct`) where the
    output may skip it."""

    name: str
    open: str
    close: str
    after: str
    direct: str | None


HARMONY = Protocol("harmony", "<|channel|>analysis<|message|>", "<|end|>",
                   "<|start|>assistant<|channel|>final<|message|>", "<|channel|>final<|message|>")
GEMMA = Protocol("gemma", "<|channel>thought", "<channel|>", "", "")
# Think tags: `<think>`, Seed-OSS's `<seed:think>`, a suffixed `<think:S>` (its close repeats
# the suffix) and the older spellings; an answer may follow at once where the output opens.
THINK_TAG = re.compile(r"<((?:seed:)?think(?:[:_\-][^<>\s]{1,32})?|thinking|reasoning)>")
OTHER_TAGS = (("<|begin_of_thought|>", "<|end_of_thought|>"),)


def think_tag(open_marker: str) -> Protocol:
    """The think-tag protocol of an open tag (`<think>` → `</think>`)."""
    m = THINK_TAG.fullmatch(open_marker)
    close = f"</{m.group(1)}>" if m else dict(OTHER_TAGS)[open_marker]
    return Protocol("think", open_marker, close, SEPARATOR, "")


def find_protocol(*rendered: str) -> Protocol | None:
    """The reasoning protocol whose markers the rendered texts (a template's output, never
    its source) write, or None: Harmony's channels, Gemma's, else the first think tag."""
    text = "".join(rendered)
    if HARMONY.open in text or "<|channel|>final<|message|>" in text:
        return HARMONY
    if GEMMA.open in text or GEMMA.close in text:
        return GEMMA
    hits = [(m.start(), m.group(0)) for m in THINK_TAG.finditer(text)]
    hits += [(text.find(o), o) for o, _ in OTHER_TAGS if o in text]
    if hits:
        return think_tag(min(hits)[1])
    closes = [m for m in re.finditer(r"</((?:seed:)?think[^<>\s]{0,33})>", text)]
    return think_tag(f"<{closes[0].group(1)}>") if closes else None


class Markup:
    """A tokenizer's markup: text, and its special tokens by name. llguidance tokenizes text
    into text tokens only (`grammar.text_tokenizer`), so a marker's special tokens are found
    here by name and named in grammars by id.

    Attributes:
        tokenizer: the `LLTokenizer`.
        specials: special token text -> id.
    """

    def __init__(self, tokenizer: LLTokenizer, specials: dict[str, int]) -> None:
        self.tokenizer = tokenizer
        self.specials = dict(specials)
        names = sorted(self.specials, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    def pieces(self, text: str) -> list[str | int]:
        """The text as runs of text and special-token ids."""
        if self._split is None:
            return [text] if text else []
        return [self.specials[p] if i % 2 else p
                for i, p in enumerate(self._split.split(text)) if i % 2 or p]

    def ids(self, text: str) -> list[int]:
        """The markup's token ids: its special tokens by name, the text between tokenized."""
        out: list[int] = []
        for p in self.pieces(text):
            out.extend([p] if isinstance(p, int) else self.tokenizer.tokenize_str(p))
        return out

    def lark(self, text: str) -> str:
        """The markup as a Lark sequence: special tokens by id, the text between as strings."""
        return " ".join(f"<[{p}]>" if isinstance(p, int) else json.dumps(p)
                        for p in self.pieces(text))


def marker_ids(markup: Markup, marker: str) -> tuple[tuple[int, ...], bool]:
    """The marker's token ids, and whether it is one special token (named in the grammar by
    id) rather than text."""
    pieces = markup.pieces(marker)
    if len(pieces) == 1 and isinstance(pieces[0], int):
        return (pieces[0],), True
    return tuple(markup.ids(marker)), False


def _regex_literal(text: str) -> str:
    return "".join(c if c.isalnum() else f"\\x{ord(c):02x}" if ord(c) < 128 else c
                   for c in text)


def think_grammar(answer: str, thinking: Thinking, markup: Markup) -> str:
    """The llguidance grammar (TopLevelGrammar JSON) for: [open marker] reasoning text, end
    marker, header, then the `answer` grammar (any text `to_grammar` returns); or, where the
    protocol allows an answer without reasoning, its direct header, then the answer."""
    text = answer.strip()
    subs = json.loads(text)["grammars"] if text.startswith("{") else [{"lark_grammar": answer}]
    names = {g.get("name") for g in subs[1:]}
    name = next(n for n in ("answer", "answer_", "answer__", "_answer") if n not in names)
    close = _regex_literal(thinking.close)
    opener = markup.lark(thinking.open) + " " if thinking.open else ""
    if marker_ids(markup, thinking.close)[1]:  # text without the marker, then its token
        think = (f"THINK {markup.lark(thinking.close)}\n"
                 f"THINK: /(?s:.*)/ & ~/(?s:.*){close}(?s:.*)/\n")
    else:  # the shortest text that ends with the marker
        think = f"think\nthink[lazy]: /(?s:.*){close}/\n"
    first, _, rest = think.partition("\n")
    header = markup.lark(thinking.header) + " " if thinking.header else ""
    branches = [f"{opener}{first} {header}@{name}"]
    if thinking.direct is not None:
        direct = markup.lark(thinking.direct) + " " if thinking.direct else ""
        branches.append(f"{direct}@{name}")
    lark = f"start: {' | '.join(branches)}\n{rest}"
    return json.dumps({"grammars": [{"lark_grammar": lark}, {**subs[0], "name": name},
                                    *subs[1:]]})


class ThinkingGate:
    """The thinking budget's state and rule, a part of a request's grammar state
    (`ThinkingCursor`): it reads the tokens the grammar takes and restricts its masks, and
    holds no matcher.

    Counts output tokens from the start of the think block (after the open marker when the
    output opens it: the output's first bytes; output that parts from the marker took the
    branch without reasoning, and nothing is forced) until the end marker is complete (its
    one special token, or its text in the output's bytes); from `budget` tokens in, while
    thinking, the mask allows only the end marker's next token (fail closed: if the grammar
    does not allow it, the mask is empty and the state reports an error).
    """

    def __init__(self, markup: Markup, thinking: Thinking, vocab_size: int) -> None:
        self.tokenizer = markup.tokenizer
        self.budget = thinking.budget
        self.close_ids, self.special = marker_ids(markup, thinking.close)
        self.close_bytes = thinking.close.encode()
        self.open_bytes = (thinking.open or "").encode()
        self.vocab_size = vocab_size
        self.n = 0  # output tokens consumed
        self.start: int | None = None if thinking.open else 0  # where the thinking text begins
        self.thinking = True
        self.forced = 0  # end-marker tokens the budget has forced so far
        self.tail = b""  # the output's bytes since the last marker (a bounded window)
        self.error: str | None = None
        self.closing = False  # the budget rule's walk: the end marker is due at once
        self.ended_at: int | None = None  # output tokens through the end marker, once it ended
        self.recent: tuple[int, ...] = ()  # the reasoning's last tokens (fewer than the marker's)

    def copy(self) -> "ThinkingGate":
        c = object.__new__(ThinkingGate)
        c.__dict__.update(self.__dict__)
        return c

    def close_now(self) -> None:
        """From here on, the end marker is due as if the thinking budget were spent (the
        budget rule's closing walk, `budget.closing`, on a copy); where the reasoning already
        ends with a start of the marker's tokens (the longest), the marker goes on from there."""
        self.closing = True
        if self.forced == 0 and self.thinking and self.start is not None:
            ids = self.close_ids
            self.forced = next((k for k in range(len(ids) - 1, 0, -1)
                                if self.recent[-k:] == ids[:k]), 0)

    @property
    def ended(self) -> bool:
        """Whether the last token taken completed the end marker."""
        return self.ended_at is not None and self.ended_at == self.n

    def due(self) -> int | None:
        """The end marker's token the budget forces next (the first one only where the
        grammar allows it), or None."""
        if not self.thinking or self.start is None or self.forced >= len(self.close_ids):
            return None
        if not self.closing and (self.budget is None or self.n - self.start < self.budget):
            return None
        return self.close_ids[self.forced]

    def restrict(self, ptr: int, size: int, grammar_error: bool) -> None:
        """Restrict the grammar's mask at `ptr` (packed, `size` bytes) to the due token."""
        due = self.due()
        if due is None:
            return
        row = np.ctypeslib.as_array((ctypes.c_int32 * (size // 4)).from_address(ptr))
        ok = bool((int(row[due >> 5]) >> (due & 31)) & 1)
        if not ok and self.forced == 0:
            return  # mid-character, say: the marker starts where the grammar allows it
        row[:] = 0
        if ok:
            row[due >> 5] = np.int32(np.uint32(1 << (due & 31)).view(np.int32))
        elif not grammar_error:
            self.error = (f"thinking budget: the grammar does not allow the end marker's "
                          f"token {due} at output position {self.n}")

    def forces(self, matcher: LLMatcher) -> int | None:
        """The token the budget forces at `matcher`'s state (None: the grammar decides)."""
        due = self.due()
        if due is None or self.forced > 0:
            return due
        row = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)  # as the mask says
        matcher.deep_copy().unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return due if (int(row[due >> 5]) >> (due & 31)) & 1 else None

    def took(self, token: int) -> None:
        """Count a token the grammar took, and follow the reasoning's markers."""
        self.n += 1
        if not self.thinking:
            return
        if self.start is None:  # the output is still choosing its branch
            self.tail += self.tokenizer.decode_bytes([token])
            if self.tail.startswith(self.open_bytes):  # it opened the reasoning
                self.start, self.tail = self.n, b""
            elif not self.open_bytes.startswith(self.tail):  # it answers at once
                self.thinking = False
            return
        marker = self.close_bytes
        self.recent = (self.recent + (token,))[-(len(self.close_ids) - 1):] \
            if len(self.close_ids) > 1 else ()
        self.tail = (self.tail + self.tokenizer.decode_bytes([token]))[-4 * len(marker):]
        if self.special:
            self.thinking = token != self.close_ids[0]
        else:
            self.thinking = self.close_bytes not in self.tail
        if not self.thinking:
            self.ended_at = self.n


class ThinkingCursor:
    """A grammar state with a thinking budget (a `types.GrammarState`): the request's
    `LLMatcher` and its `ThinkingGate`, advanced together."""

    def __init__(self, matcher: LLMatcher, gate: ThinkingGate) -> None:
        self.matcher, self.gate = matcher, gate

    @staticmethod
    def of(matcher: LLMatcher, markup: Markup, thinking: Thinking, vocab_size: int
           ) -> "ThinkingCursor":
        return ThinkingCursor(matcher, ThinkingGate(markup, thinking, vocab_size))

    def forcing(self) -> int | None:
        """The end marker's token forced at this position (the budget spent and the grammar
        allowing it, or a marker already under way), or None."""
        return self.gate.forces(self.matcher)

    def close_now(self) -> None:
        self.gate.close_now()

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        self.matcher.unsafe_compute_mask_ptr(ptr, size)
        self.gate.restrict(ptr, size, bool(self.matcher.is_error()))

    def consume_token(self, token: int) -> bool:
        gate = self.gate
        forced = gate.forces(self.matcher)
        if forced is not None and token != forced:
            gate.error = (f"thinking budget: token {token} at output position {gate.n} where "
                          f"only {forced} (the end marker) is allowed")
            return False
        if forced is not None:
            gate.forced += 1
        ok = bool(self.matcher.consume_token(token))
        gate.took(token)
        return ok

    def deep_copy(self) -> "ThinkingCursor":
        return ThinkingCursor(self.matcher.deep_copy(), self.gate.copy())

    def is_error(self) -> bool:
        return self.gate.error is not None or bool(self.matcher.is_error())

    def get_error(self) -> str:
        return self.gate.error or str(self.matcher.get_error())

    def stop_reason(self) -> str:
        return "InternalError" if self.gate.error is not None else self.matcher.stop_reason()

    def is_stopped(self) -> bool:
        return bool(self.matcher.is_stopped())

    def is_accepting(self) -> bool:
        return bool(self.matcher.is_accepting())

    def compute_ff_tokens(self) -> list[int]:
        return self.matcher.compute_ff_tokens()


def reasoning_bounds(text: str, thinking: Thinking) -> tuple[int, int, int | None]:
    """Where an output's reasoning lies and its answer begins, along the grammar's branches:
    (reasoning start, reasoning end, answer start or None while it has not begun). After the
    open marker (or from the start, where the prompt opened it) the reasoning runs to the end
    marker, which the grammar keeps out of it, and the answer follows the header; on the
    direct branch the answer follows its header and the reasoning is empty. An unfinished
    marker or header is neither reasoning nor answer."""
    start = 0
    if thinking.open is not None:
        if text.startswith(thinking.open):
            start = len(thinking.open)
        elif thinking.open.startswith(text) or (
                thinking.direct is not None and thinking.direct.startswith(text)):
            return 0, 0, None  # which branch is not yet known
        elif thinking.direct is not None and text.startswith(thinking.direct):
            return 0, 0, len(thinking.direct)
    at = text.find(thinking.close, start)
    if at < 0:  # still thinking (or cut): a partial end marker is not reasoning
        return start, len(text) - _suffix_prefix(text[start:], thinking.close), None
    rest = at + len(thinking.close)
    if text.startswith(thinking.header, rest):
        return start, at, rest + len(thinking.header)
    return start, at, len(text) if thinking.header.startswith(text[rest:]) else rest


def split_reasoning(text: str, thinking: Thinking) -> tuple[str, str | None]:
    """An output's (reasoning, answer) (`reasoning_bounds`); the answer is None while it has
    not begun."""
    r0, r1, a = reasoning_bounds(text, thinking)
    return text[r0:r1], None if a is None else text[a:]


def _suffix_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` are a proper start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


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
            t = self.thinking
            hold = len(t.close) + len(t.header) + len(t.open or "") + len(t.direct or "")
            reasoning = reasoning[:max(len(reasoning) - hold, self.sent_reasoning)]
        r = reasoning[self.sent_reasoning:]
        a = (answer or "")[self.sent_answer:]
        self.sent_reasoning += len(r)
        self.sent_answer += len(a)
        return r, a
