"""The token-budget rule, re-implemented from its statement (`specdec.budget`'s docstring,
the README's "The token budget"), separately from specdec's code: a bug shared by both
would pass the gate.

Level: the output's bytes read as JSON-like text (outside a string `"` opens one, `{` `[`
open a level and `}` `]` close one; inside, a backslash escapes the next byte and `"`
closes it); the level is the open levels, plus one inside a string. It restarts from
nothing after the token that completes a reasoning block's end marker.

The closing walk from a grammar state, one token a step until the grammar may end, at most
`NEED_LIMIT` tokens: (0) inside the reasoning, the end marker's next token (continuing one
forced or one the reasoning ends with a start of; else its first where allowed); (1) the
first forced token; (2) where at most 16 tokens are allowed, the lowest after which the
grammar may end; (3) a hint's next token (for each hint in order, each start of it the
output ends with, longest first and the empty one last, where the grammar takes the
hint's rest and then allows at most 16 tokens or may end); (4) of the allowed candidates
(special tokens, read as no text; tokens of the bytes `"{}[],: ` only; one-byte tokens)
the one that changes the level least, then a special token (by id), then the shortest,
then the first by its bytes in the order `"@}], :/A-Z.1-90a-z` and the other bytes
ascending; none allowed: the lowest allowed id; an empty mask: no closing.

Stalls: at each step of 2-4 the walk counts the state's signature (the mask's words, the
level reader's state and, for each hint, the length of its longest start the output ends
with).
Meeting one for the 16th time, or reaching the bound (or a grammar error) with the last
one met more than once, it searches from where it first met that signature; with a path
found it walks on after it, counting afresh; with none, it goes on as if it had not
stalled and stalls no more (at the bound or an error: no closing). The search is
breadth-first (depth at most the tokens left) for the first path to a state that may end
or whose level is below the search's start, extending each path of a depth in order by:
the forced token (steps 0, 1); else the tokens the first extension of a path with the
same signature kept (for each signature its successors reached, the first token reaching
it); else the allowed search tokens (special, structure and printable one-byte tokens, in
the candidates' tie order), then every other allowed one by id where at most 16 are
allowed, then each hint's next token. A new path whose signature another new path of its
depth has is dropped; after 4096 successor states the search gives up (found nothing). Last,
the closing is written anew where shorter: each run between special tokens as the
tokenizer's own tokens for its bytes, where the grammar takes that and may end. A closing
within `n` is the closing where it has at most `n` tokens.

The rule at a position with `left` budget tokens, the decision rule having picked `t`:
nothing checked while `left - 1 >= minimum + 64`. A token's proof within `n`: an end
token: `[]` where the grammar may end; else, from `known` (the proof of the previous
position's token; none at the first check), its rest where the token is its first; else
`known` where the grammar takes the token, then `known`, and may end; else, where the
token (with text) has bytes that begin `known`'s text before its first special token, the
tokenizer's tokens
for the rest of that text, then `known` from the special token on, where the grammar
takes the token, then that, and may end; else the closing after the token; each with at
most `n` tokens. `t` stands with a proof within `left - 1`; else, where a closing from
here fits `left` (`known` if it fits, else the closing), the first of the 8 best-scoring
tokens (score descending, then id, finite) with such a proof, else the closing's first
token (the lowest end id where it is empty; its rest the proof); else `t` stands. The
taken token's proof becomes `known` (none where nothing was proved). A check's walk does
not search again from a signature where an earlier check's search found nothing (the
minimum's walk at the start neither reads nor notes these).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance.numpy as llnp
import numpy as np
from llguidance import LLMatcher

from .sampler import unpack_mask

_BYTES: dict = {}  # (id of a tokenizer, width) -> (the tokenizer, kept alive; its bytes)
_ORDERS: dict = {}  # id of a token-bytes list -> (the list, kept alive; its orders)
WINDOW_SLACK = 64
TOP = 8
FEW = 16
REPEAT = 16
PROBES = 4096
NEED_LIMIT = 4096
BYTE_ORDER = b'"@}], :/ABCDEFGHIJKLMNOPQRSTUVWXYZ.1234567890abcdefghijklmnopqrstuvwxyz'
STRUCTURE = set(b'"{}[],: ')

Nest = tuple[int, bool, bool]  # (open levels, inside a string, escape pending)


def level_after(state: Nest, data: bytes) -> Nest:
    """(open levels, inside a string, escape pending) after reading `data`."""
    depth, inside, esc = state
    for c in data:
        ch = chr(c)
        if inside:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                inside = False
        elif ch == '"':
            inside = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
    return depth, inside, esc


def level(state: Nest) -> int:
    return state[0] + (1 if state[1] else 0)


def is_special(data: bytes) -> bool:
    """llguidance writes a special token as 0xFF and its name."""
    return len(data) > 1 and data[0] == 0xFF


def tie_key(data: bytes, token: int) -> tuple:
    if is_special(data):
        return (0, token)
    ranks = [BYTE_ORDER.index(c) if c in BYTE_ORDER else len(BYTE_ORDER) + c for c in data]
    return (1, len(data), ranks, token)


def _orders(token_bytes: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(candidates by id, the candidates' tie rank by id (-1: not one), the search tokens in
    tie order) of a vocabulary, computed once per token-bytes list."""
    key = id(token_bytes)
    if key not in _ORDERS:
        cands = [i for i, b in enumerate(token_bytes)
                 if is_special(b) or len(b) == 1 or (b and set(b) <= STRUCTURE)]
        ranked = sorted(cands, key=lambda i: tie_key(token_bytes[i], i))
        rank = np.full(len(token_bytes), -1, dtype=np.int64)
        rank[ranked] = np.arange(len(ranked))
        search = [i for i in ranked if is_special(token_bytes[i])
                  or (len(token_bytes[i]) == 1 and 0x20 <= token_bytes[i][0] <= 0x7E)
                  or set(token_bytes[i]) <= STRUCTURE]
        _ORDERS[key] = (token_bytes, (np.array(cands, dtype=np.int64), rank,
                                      np.array(search, dtype=np.int64)))
    return _ORDERS[key][1]


@dataclass
class _At:
    """A state the walk or the search stands in: the matcher (owned), the level reader's
    state, the output so far, the end marker's tokens forced, the path from the search's
    start; `words`/`allowed`/`sig` once its mask was filled."""

    m: LLMatcher
    nest: Nest
    seq: list[int]
    forced: int
    path: list[int] = field(default_factory=list)
    words: bytes | None = None
    allowed: np.ndarray | None = None
    sig: tuple | None = None


@dataclass
class BudgetOracle:
    """The rule for one request: the tokenizer's token bytes (by id), the logits width,
    the end ids, the budget. `minimum` is measured at the start (`start`); `known` is the
    closing proved for the previous position's token."""

    token_bytes: Sequence[bytes]
    vocab_size: int
    eos: tuple[int, ...]
    max_tokens: int
    hints: Sequence[Sequence[int]] = ()  # token sequences that end free text
    minimum: int | None = None
    steered: list[int] = field(default_factory=list)  # positions the rule changed
    nesting: Nest = (0, False, False)  # after the output so far
    output: list[int] = field(default_factory=list)
    thinking: Any = None  # the request's thinking rule (`reference.ThinkingRule`), if any
    known: list[int] | None = None
    tokenizer: Any = None  # llguidance's, to write a closing anew (None: never)
    searches: int = 0  # searches its walks made (a test can see the search ran)
    gave_up: set = field(default_factory=set)  # where its checks' searches found nothing

    def __post_init__(self) -> None:
        self.candidates, self.rank, self.search_order = _orders(self.token_bytes)
        self.hints = [[int(t) for t in h] for h in self.hints]
        self.words = llnp.allocate_token_bitmask(1, self.vocab_size)

    @staticmethod
    def of(tokenizer, vocab_size: int, eos: Sequence[int], max_tokens: int,
           hints: Sequence[Sequence[int]] = ()) -> "BudgetOracle":
        """The rule over an llguidance tokenizer's token bytes (its special tokens' bytes
        start 0xFF: never text)."""
        key = (id(tokenizer), vocab_size)
        if key not in _BYTES:
            n = min(tokenizer.vocab_size, vocab_size)
            _BYTES[key] = (tokenizer, [tokenizer.decode_bytes([i]) for i in range(n)])
        return BudgetOracle(_BYTES[key][1], vocab_size, tuple(eos), max_tokens, hints,
                            tokenizer=tokenizer)

    # -- states ---------------------------------------------------------------------------

    def _bytes(self, tok: int) -> bytes:
        b = self.token_bytes[tok] if tok < len(self.token_bytes) else b""
        return b"" if is_special(b) else b

    def _reasoning(self, seq: Sequence[int]) -> bool:
        """Whether output `seq` is inside its reasoning (opened, its end marker not done)."""
        r = self.thinking
        return r is not None and r.opened(list(seq)) is not None and not r.ended(list(seq))

    def _next(self, state: Nest, seq: Sequence[int], tok: int) -> Nest:
        """The level after `seq` took `tok` (restarting where `tok` ended the reasoning)."""
        if self._reasoning(seq) and not self._reasoning(list(seq) + [tok]):
            return (0, False, False)
        return level_after(state, self._bytes(tok))

    def _fill(self, at: _At) -> bool:
        """Fill `at`'s mask and signature; False where the grammar errs."""
        llnp.fill_next_token_bitmask(at.m, self.words, 0)
        if at.m.is_error():
            return False
        at.words = self.words[0].tobytes()
        at.allowed = unpack_mask(self.words[0], self.vocab_size)
        at.sig = (at.words, at.nest, tuple(self._start(h, at.seq) for h in self.hints))
        return True

    def _take(self, at: _At, tok: int, forced: int) -> bool:
        """Advance `at` by `tok` in place; False where the grammar refuses it."""
        if not at.m.consume_token(tok) or at.m.is_error():
            return False
        at.nest = self._next(at.nest, at.seq, tok)
        at.seq.append(tok)
        at.path.append(tok)
        at.forced = forced
        at.words = at.allowed = at.sig = None
        return True

    def _copy(self, at: _At) -> _At:
        return _At(at.m.deep_copy(), at.nest, list(at.seq), at.forced, [], at.words,
                   at.allowed, at.sig)

    def _allows(self, at: _At, tok: int) -> bool:
        if at.allowed is None and not self._fill(at):
            return False
        assert at.allowed is not None
        return bool(at.allowed[tok])

    def _marker(self, at: _At) -> tuple[int, int] | None:
        """Step 0: (the end marker's next token, its tokens forced after it), where the
        reasoning's end marker gives the step."""
        if not self._reasoning(at.seq):
            return None
        ids = list(self.thinking.close_ids)
        forced = at.forced
        if forced >= len(ids):
            return None
        if forced == 0:  # a start of the marker the reasoning ends with
            inside = at.seq[self.thinking.opened(at.seq):]
            forced = max((k for k in range(1, len(ids)) if inside[-k:] == ids[:k]),
                         default=0)
            if forced == 0 and not self._allows(at, ids[0]):
                return None
        return ids[forced], forced + 1

    def _forced(self, at: _At) -> tuple[int, int, bool] | None:
        """Steps 0 and 1: the token forced here, the marker's count after it, and whether
        it is the marker's."""
        mk = self._marker(at)
        if mk is not None:
            return mk[0], mk[1], True
        ff = at.m.compute_ff_tokens()
        return (int(ff[0]), at.forced, False) if len(ff) > 0 else None

    # -- the walk -------------------------------------------------------------------------

    @staticmethod
    def _start(hint: list[int], seq: list[int]) -> int:
        """The length of the longest start of `hint` that `seq` ends with (0: none; a
        whole hint is no start)."""
        return max((k for k in range(1, len(hint)) if seq[-k:] == hint[:k]), default=0)

    def _hint(self, at: _At) -> int | None:
        """Step 3: a hint's next token."""
        for h in self.hints:
            for k in reversed(range(len(h))):
                if k > 0 and at.seq[-k:] != h[:k]:
                    continue
                probe = at.m.deep_copy()
                if not all(probe.consume_token(t) for t in h[k:]) or probe.is_error():
                    continue
                llnp.fill_next_token_bitmask(probe, self.words, 0)
                if probe.is_accepting() or \
                        unpack_mask(self.words[0], self.vocab_size).sum() <= FEW:
                    return h[k]
        return None

    def _step(self, at: _At) -> int | None:
        """Steps 2-4 at a state whose mask is filled (None: an empty mask)."""
        allowed = at.allowed
        assert allowed is not None
        ids = np.flatnonzero(allowed)
        if ids.size == 0:
            return None
        if ids.size <= FEW:
            for i in ids:
                probe = at.m.deep_copy()
                if probe.consume_token(int(i)) and not probe.is_error() and \
                        probe.is_accepting():
                    return int(i)
        if self.hints:
            hinted = self._hint(at)
            if hinted is not None:
                return hinted
        options = self.candidates[allowed[self.candidates]]
        if options.size == 0:
            return int(ids[0])
        here = level(at.nest)
        return int(min(options, key=lambda i: (
            level(level_after(at.nest, self._bytes(int(i)))) - here, self.rank[i])))

    def walk(self, matcher: LLMatcher, limit: int, state: Nest,
             before: Sequence[int] = (), forced: int = 0) -> list[int] | None:
        """The closing within `limit` tokens from `matcher`'s state (left as it is), the
        level reader at `state` after output `before`; `forced`: the end marker's tokens
        forced so far. None: no closing, or a longer one."""
        found = self.closing(matcher, state, before, forced, remember=True)
        return found if found is not None and len(found) <= limit else None

    def closing(self, matcher: LLMatcher, state: Nest, before: Sequence[int] = (),
                forced: int = 0, remember: bool = False) -> list[int] | None:
        """The closing walk (at most `NEED_LIMIT` tokens, written anew); None: none.
        `remember`: a check's walk (it skips the searches from signatures where an earlier
        check's search found nothing, and notes its own)."""
        at = _At(matcher.deep_copy(), state, list(before), forced)
        taken: list[int] = []
        seen: dict[tuple, list] = {}  # signature -> [times met, where first, the state]
        last: tuple | None = None
        stalls = True  # until a search finds nothing

        def stalled() -> tuple | bool:  # at the limit or an error: search, or no closing
            return stalls and last is not None and seen[last][0] > 1 and last

        while not at.m.is_accepting():
            stall: tuple | bool | None = None
            repeat = False
            tok = -1
            if len(taken) == NEED_LIMIT:
                stall = stalled()
            else:
                step = self._forced(at)
                if step is not None:
                    tok, after, marker = step
                    if not self._take(at, tok, after):
                        if marker:
                            return None  # the marker's next token refused: no closing
                        stall = stalled()
                elif not self._fill(at):
                    stall = stalled()
                else:
                    assert at.sig is not None
                    entry = seen.setdefault(at.sig, [0, len(taken), None])
                    if entry[0] == 0:
                        entry[2] = self._copy(at)
                    entry[0] += 1
                    last = at.sig
                    repeat = stalls and entry[0] == REPEAT
                    if repeat:
                        stall = at.sig
                    else:
                        chosen = self._step(at)
                        if chosen is None:
                            return None  # an empty mask
                        tok = chosen
                        if not self._take(at, tok, at.forced):
                            stall = stalled()
            if stall is None:
                taken.append(tok)
                continue
            if stall is False:
                return None
            assert isinstance(stall, tuple)
            _, first, there = seen[stall]
            # (a search that gave up found nothing: "a long count, such as `minItems:
            # 500`, is walked to its end", which only a search giving up leaves)
            found = None
            if not (remember and stall in self.gave_up):
                found, _ = self._search(there, NEED_LIMIT - first)
                self.searches += 1
                if found is None and remember:
                    self.gave_up.add(stall)
            if found is not None:
                taken = taken[:first] + found.path
                at, seen, last = found, {}, None
                continue
            stalls = False  # nothing found: on as if it had not stalled, stalling no more
            if not repeat:
                return None  # at the limit, or the grammar erred
            chosen = self._step(at)
            if chosen is None:
                return None
            if not self._take(at, chosen, at.forced):
                return None
            taken.append(chosen)
        return self._anew(matcher, taken)

    def _special(self, tok: int) -> bool:
        return tok < len(self.token_bytes) and is_special(self.token_bytes[tok])

    def _anew(self, matcher: LLMatcher, taken: list[int]) -> list[int]:
        """The closing written anew where that is shorter: each run between special
        tokens as the tokenizer's own tokens for its bytes, kept where the grammar takes
        the whole and may end after it."""
        if self.tokenizer is None:
            return taken
        out: list[int] = []
        run: list[int] = []
        for tok in [*taken, None]:
            if tok is not None and not self._special(tok):
                run.append(tok)
                continue
            if run:
                out += [int(t) for t in self.tokenizer.tokenize_bytes(
                    b"".join(self._bytes(t) for t in run))]
                run = []
            if tok is not None:
                out.append(tok)
        return out if len(out) < len(taken) and self._takes(matcher, out) else taken

    # -- the search -----------------------------------------------------------------------

    def _successors(self, at: _At, kept: dict[tuple, list[int]]) -> list[tuple[int, int]]:
        """The tokens a search extends `at` by, with the marker's count after each."""
        step = self._forced(at)
        if step is not None:
            return [step[:2]]
        assert at.sig is not None and at.allowed is not None
        if at.sig in kept:
            return [(t, at.forced) for t in kept[at.sig]]
        allowed = at.allowed
        toks = [int(t) for t in self.search_order[allowed[self.search_order]]]
        listed = set(toks)
        if allowed.sum() <= FEW:
            toks += [int(t) for t in np.flatnonzero(allowed) if int(t) not in listed]
            listed = set(toks)
        for h in self.hints:
            k = self._start(h, at.seq)
            if allowed[h[k]] and h[k] not in listed:
                toks.append(h[k])
                listed.add(h[k])
        return [(t, at.forced) for t in toks]

    def _search(self, start: _At, depth: int) -> tuple[_At | None, bool]:
        """Breadth-first from `start` (its mask filled) for the first path, shortest
        first, to a state that may end or whose level is below `start`'s: (its state, or
        None where there is none within `depth` tokens; whether it gave up, having made
        `PROBES` successor states)."""
        base = level(start.nest)
        kept: dict[tuple, list[int]] = {}  # signature -> the tokens its extension kept
        layer, made = [start], 0
        start.path = []
        for _ in range(depth):
            new: list[_At] = []
            met: set[tuple] = set()
            for at in layer:
                reached: dict[tuple, int] = {}
                for tok, after in self._successors(at, kept):
                    if made == PROBES:
                        return None, True
                    made += 1
                    child = _At(at.m.deep_copy(), at.nest, list(at.seq), at.forced,
                                list(at.path))
                    if not self._take(child, tok, after) or not self._fill(child):
                        continue
                    assert child.sig is not None
                    reached.setdefault(child.sig, tok)
                    if child.sig in met:
                        continue
                    met.add(child.sig)
                    if child.m.is_accepting() or level(child.nest) < base:
                        return child, False
                    new.append(child)
                assert at.sig is not None
                kept.setdefault(at.sig, list(reached.values()))
            if not new:
                return None, False
            layer = new
        return None, False

    # -- the rule -------------------------------------------------------------------------

    def start(self, matcher: LLMatcher) -> int | None:
        """Measure the minimum at the request's start (None: no closing within 4096)."""
        w = self.closing(matcher, self.nesting, self.output)
        self.minimum = None if w is None else len(w)
        self.known = None
        return self.minimum

    def _proof(self, matcher: LLMatcher, tok: int, n: int, known: list[int] | None,
               forced: int) -> list[int] | None:
        """A closing after `tok` within `n` tokens, as the rule proves it (None: none)."""
        if tok in self.eos:
            return [] if matcher.is_accepting() else None
        if known is not None:
            if known[:1] == [tok] and len(known) - 1 <= n:
                return known[1:]
            if len(known) <= n and self._takes(matcher, [tok, *known]):
                return known
            rest = self._rest_of_text(tok, known)
            if rest is not None and len(rest) <= n and self._takes(matcher, [tok, *rest]):
                return rest
        after = matcher.deep_copy()
        if not after.consume_token(tok) or after.is_error():
            return None
        return self.walk(after, n, self._next(self.nesting, self.output, tok),
                         self.output + [tok], forced)

    def _takes(self, matcher: LLMatcher, tokens: list[int]) -> bool:
        """Whether the grammar takes `tokens` from `matcher`'s state and may end after."""
        probe = matcher.deep_copy()
        return all(probe.consume_token(t) and not probe.is_error() for t in tokens) and \
            probe.is_accepting()

    def _rest_of_text(self, tok: int, known: list[int]) -> list[int] | None:
        """Where `tok`'s bytes begin (and are shorter than) those of `known`'s tokens
        before its first special token: the tokenizer's tokens for the rest of those
        bytes, then `known` from that special token on."""
        if self.tokenizer is None:
            return None
        cut = next((i for i, t in enumerate(known) if self._special(t)), len(known))
        text = b"".join(self._bytes(t) for t in known[:cut])
        head = self._bytes(tok)
        if not head or len(head) >= len(text) or not text.startswith(head):
            return None
        return [int(t) for t in self.tokenizer.tokenize_bytes(text[len(head):])] + known[cut:]

    def took(self, tok: int) -> None:
        """The output took `tok` (advances the level reader)."""
        self.nesting = self._next(self.nesting, self.output, tok)
        self.output.append(tok)

    def choose(self, matcher: LLMatcher, position: int, pick: int,
               scores: np.ndarray, forced: int = 0, forced_after: int = 0) -> int:
        """The token at output `position` (0-based; positions come in order, each once),
        `pick` being the decision rule's; `forced` / `forced_after`: the end marker's tokens
        the thinking budget forced before this position / through it."""
        if self.minimum is None:
            return pick
        left = self.max_tokens - position
        known, self.known = self.known, None
        if left - 1 >= self.minimum + WINDOW_SLACK:
            return pick
        proof = self._proof(matcher, pick, left - 1, known, forced_after)
        if proof is not None:
            self.known = proof
            return pick
        here = known if known is not None and len(known) <= left else \
            self.walk(matcher, left, self.nesting, self.output, forced)
        if here is None:
            return pick
        order = np.argsort(-scores, kind="stable")
        ranked = [int(i) for i in order[np.isfinite(scores[order])][:TOP]]
        for tok in ranked:
            if tok == pick:
                continue
            proof = self._proof(matcher, tok, left - 1, known, forced_after)
            if proof is not None:
                self.steered.append(position)
                self.known = proof
                return tok
        out = here[0] if here else min(self.eos)
        self.known = here[1:]
        if out != pick:
            self.steered.append(position)
        return out
