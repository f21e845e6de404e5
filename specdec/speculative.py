"""Speculative decoding under grammars: masked drafting, one-pass verify, exact acceptance.

This module holds the proposers (`_draft`) and the verify-side masks (`verify_masks`); the
round that uses them lives in `core.py`, shared by plain, speculative and batched decoding.
Each round:
1. Draft: a clone of the request's matcher (`deep_copy`) masks the draft model's logits, so
   every proposal is legal; where the grammar allows exactly one token it is proposed without
   running the draft (forced-token drafting). With no draft model at all, only forced tokens
   are proposed ("jump-forward": a run of forced tokens costs one target forward). The draft
   picks with the same (seed, position) noise as the target, so under sampling it agrees as
   often as it can.
2. Backstop and verify masks, in one pass over a clone: a `deep_copy` of the request's
   matcher is advanced through the proposals, filling the mask row of each verify position;
   the first proposal its row forbids ends the round's proposals (a "grammar cut"; never
   happens with draft masking on). The request's own matcher only ever consumes accepted
   tokens: it is never advanced speculatively and never rolled back (llguidance's `rollback`
   can leave a state that consumes differently until a mask is computed on it; see
   tests/test_llguidance_rollback.py).
3. Verify: the target scores [last token, proposals...] in one forward pass under those
   k+1 masks, applied in one call.
4. Accept: proposal j is accepted iff it equals the target's own pick at that position (same
   mask, same noise as plain decoding), so the output equals plain decoding's token for
   token. The first mismatch yields the target's pick (the bonus token).
5. Rewind: both KV caches are trimmed to the accepted length.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance.numpy as llnp
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from llguidance import LLMatcher

import time

from .decode import StepTimings, TokenId, grammar_failure
from .lookup import LookupCursor, NgramIndex, SuffixCursor
from .sampling import SamplingParams, apply_mask, pick, position_noise, unpack_bitmask

from .errors import RequestError

MAX_DRAFT_TOKENS = 16


class DraftConfigError(RequestError):
    """Speculative settings out of range, or a draft that cannot serve this target."""

    param = "spec"


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings.

    Attributes:
        k: most draft-model tokens proposed per round (1..16); forced and looked-up tokens
            may extend a round to `cheap_k` = min(2k, 16).
        draft_masking: mask the draft's logits with a matcher clone (proposals legal by
            construction). Off: the draft proposes unmasked and the backstop cuts.
        forced_drafting: propose grammar-forced tokens without running the draft model.
        lookup: propose continuations of the context's own n-grams (prompt lookup) before
            asking the draft model; legal ones only, like every proposal.
        lookup_min_ngram: the shortest context suffix (tokens) a lookup match must repeat.
        suffix: propose continuations from earlier answers (`lookup.SuffixStore`: those to
            the same grammar first, then any), after prompt lookup; legal ones only.
        draft_min_prob: stop drafting this round when the draft model gives its own pick
            less than this probability (a likely rejection costs verify width and draft
            steps); 0 drafts all k.
    """

    k: int = 4
    draft_masking: bool = True
    forced_drafting: bool = True
    lookup: bool = False
    lookup_min_ngram: int = 2
    suffix: bool = False
    draft_min_prob: float = 0.0

    @property
    def cheap_k(self) -> int:
        """Most proposals per round when they come free (forced) or from lookup."""
        return min(2 * self.k, MAX_DRAFT_TOKENS)

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or not (1 <= self.k <= MAX_DRAFT_TOKENS):
            raise DraftConfigError(f"k={self.k!r}: must be an integer in [1, {MAX_DRAFT_TOKENS}]")
        if not 0.0 <= self.draft_min_prob < 1.0:
            raise DraftConfigError(f"draft_min_prob={self.draft_min_prob!r}: must be in [0, 1)")
        if self.lookup_min_ngram < 1:
            raise DraftConfigError(f"lookup_min_ngram={self.lookup_min_ngram!r}: must be >= 1")


@dataclass
class SpecStats(StepTimings):
    """Speculative counters (mutable accumulator; times in seconds).

    Attributes:
        rounds: draft/verify rounds.
        proposed: tokens proposed (forced, looked up or by the draft model).
        accepted: proposals equal to the target's pick.
        forced, looked_up, suffixed, drafted: proposals by source (grammar-forced, prompt
            lookup, earlier answers, draft model); `*_accepted`: how many of each the
            target accepted.
        grammar_cuts: rounds whose proposals the backstop truncated.
        draft_load_skips: rounds in which the draft model was left out because the batch
            was larger than `Models.draft_max_batch`.
        draft_s, verify_s: time in draft and verify phases.
        spec_off: why a request that asked for speculation decodes plainly, or the draft
            model is left out ("" when neither): a cache kind that cannot be trimmed exactly.
    """

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    forced: int = 0
    forced_accepted: int = 0
    looked_up: int = 0
    looked_up_accepted: int = 0
    suffixed: int = 0
    suffixed_accepted: int = 0
    drafted: int = 0
    drafted_accepted: int = 0
    grammar_cuts: int = 0
    draft_load_skips: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    spec_off: str = ""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def fill_row(matcher: Any, bitmask: np.ndarray, j: int, stats: StepTimings | None) -> None:
    """Fill mask row j for the matcher's state, counting its time in `stats` (every fill
    counts against the request's grammar budget: `core.MaskBudget`)."""
    t0 = time.perf_counter()
    llnp.fill_next_token_bitmask(matcher, bitmask, j)
    if stats is not None:
        dt = time.perf_counter() - t0
        stats.mask_s += dt
        stats.round_mask_s += dt
        stats.mask_max_s = max(stats.mask_max_s, dt)


def over_round_budget(stats: StepTimings, budget_s: float | None) -> bool:
    """Whether this round's fills for a request have spent its in-round budget (then it
    proposes no further and verifies what it has: the round ends sooner, output unchanged)."""
    return budget_s is not None and stats.round_mask_s > budget_s


def single_allowed(bitmask: np.ndarray) -> int | None:
    """The one allowed token id of a packed mask row, or None when 0 or 2+ are allowed."""
    nz = np.flatnonzero(bitmask)
    if nz.size != 1:
        return None
    word = int(bitmask[nz[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return int(nz[0]) * 32 + word.bit_length() - 1


def _trim(cache: list, n: int) -> None:
    if n > 0:
        for c in cache:
            c.trim(n)


def draft_steps(draft: nn.Module | None, d_cache: list, seq: list[TokenId], kk: int,
           matcher: LLMatcher | None, params: SamplingParams, spec: SpecConfig,
           stats: SpecStats, eos: set[int], vocab_size: int, draft_vocab: int, emitted: int,
           index: NgramIndex | None = None, run_on: bool = True,
           space: np.ndarray | None = None, row0: np.ndarray | None = None,
           budget_s: float | None = None, earlier: Sequence[NgramIndex] = ()
           ) -> Generator[tuple[str, Any], Any, tuple[list[TokenId], list[str], int]]:
    """Propose up to kk tokens, each from the first source that has one: the grammar (a
    forced token), prompt lookup (a legal continuation of a repeated n-gram), earlier
    answers (`earlier`: a `SuffixStore`'s indexes, the same), the draft model.

    Returns (proposals, their sources: "forced" | "looked_up" | "suffixed" | "drafted", how
    many proposals
    the draft cache holds). The draft cache holds a prefix of `seq`; the tokens after it are
    fed with the next draft forward. With masking off an illegal proposal puts the clone in
    error, so drafting stops.

    `space`: the draft's logits (the replies to "forward") are over its own pruned
    vocabulary, column i being target id space[i], ascending (`MappedDraft.own_logits`); the
    mask and the (seed, position) noise are read at those ids, so the pick is the one over
    target-width logits (-inf off the draft's vocabulary), ties included, at a sixth of the
    width.

    `row0`: the matcher's mask at its current state, when already filled (the round's first
    verify row); the first step reads it instead of filling it again. `budget_s`: stop
    proposing once the round's fills took this long (`over_round_budget`).
    """
    props: list[TokenId] = []
    sources: list[str] = []
    if kk <= 0:
        return props, sources, 0
    # The draft model proposes up to k per round; forced and looked-up tokens (no draft step,
    # and usually accepted) may run on to 2k, capped by the token budget.
    # run_on=False (a batched round: past ~16 rows every verify row costs compute that the
    # other requests wait for, while a run that stops at k finishes next round): k in all.
    k_model, kk = min(spec.k, kk), min(spec.cheap_k if run_on else spec.k, kk)
    clone = None
    if matcher is not None and (spec.draft_masking or spec.forced_drafting or index
                                or earlier):
        clone = matcher.deep_copy()
    row = llnp.allocate_token_bitmask(1, vocab_size)  # the matcher's width: target logits
    feed = seq[d_cache[0].offset:] if d_cache else []  # not yet in the draft cache
    fed = 0
    seed = params.seed or 0
    cursor = LookupCursor(index, spec.lookup_min_ngram) if index is not None else None
    suffix = SuffixCursor(earlier, spec.lookup_min_ngram) if earlier else None
    max_n = max([i.max_n for i in earlier] + ([index.max_n] if index is not None else [1]))
    tail = seq[-max_n:]
    for j in range(kk):
        forced = cand = None
        if clone is not None:
            if j == 0 and row0 is not None:
                row[0] = row0
            elif over_round_budget(stats, budget_s):
                break
            else:
                fill_row(clone, row, 0, stats)
                if clone.is_error():
                    break
            if spec.forced_drafting:
                forced = single_allowed(row[0])
        if forced is None and cursor is not None:
            cand = cursor.next(tail)
            if cand is not None and clone is not None and not mask_allows(row[0], cand):
                cand = None  # the grammar forbids it here: not a proposal
        src = "looked_up"
        if forced is None and cand is None and suffix is not None:
            cand, src = suffix.next(tail), "suffixed"
            if cand is not None and clone is not None and not mask_allows(row[0], cand):
                cand = None
        if forced is not None:
            if forced >= draft_vocab:
                break  # the draft cannot embed it; let the target decide
            tok, src = forced, "forced"
        elif cand is not None and cand < draft_vocab:
            tok = cand
        elif draft is None or j >= k_model:
            break  # no model (or its share is spent): stop at the first open position
        else:
            logits = yield ("forward", feed)  # (Vd,), or (len(space),) with `space`
            fed, feed = len(props), []
            if space is not None:
                if clone is not None and spec.draft_masking:
                    logits = apply_mask(logits, mx.array(space_mask(row[0], space)))
            elif clone is not None and spec.draft_masking:
                logits = apply_mask(logits, unpack_bitmask(mx.array(row[0]), draft_vocab))
            noise = None
            if not params.greedy:
                noise = position_noise(seed, emitted + j, draft_vocab)
                noise = mx.array(noise if space is None else noise[space])
            choice = pick(logits, params, noise)
            # In one sync: the pick's logit (-inf: every legal token is outside what the
            # draft can propose, e.g. a pruned draft vocabulary; the target decides) and,
            # when gated, the pick's own probability.
            scale = 1.0 if params.greedy else params.temperature
            p_pick = (mx.softmax(logits / scale, axis=-1)[choice] if spec.draft_min_prob > 0
                      else mx.array(1.0))
            picked = logits[choice]
            yield ("eval", (choice, picked, p_pick))
            if picked.item() == -np.inf:
                break
            if p_pick.item() < spec.draft_min_prob:
                break  # unlikely to be accepted: verify what we have
            tok = int(choice.item())
            tok, src = (tok if space is None else int(space[tok])), "drafted"
        props.append(tok)
        sources.append(src)
        setattr(stats, src, getattr(stats, src) + 1)
        if tok in eos:
            break
        feed.append(tok)
        if cursor is not None:
            cursor.advance(tok)
        if suffix is not None:
            suffix.advance(tok)
        tail = (tail + [tok])[-max_n:]
        if clone is not None:
            clone.consume_token(tok)
            if clone.is_error():  # an unmasked illegal proposal: the backstop will cut it
                break
    return props, sources, fed


def space_mask(row: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Whether a packed mask row allows each of `ids` (bool, like `ids`)."""
    words = ids >> 5
    ok = words < row.shape[0]
    bits = (row[np.minimum(words, row.shape[0] - 1)] >> (ids & 31)) & 1
    return ok & (bits != 0)


def mask_allows(row: np.ndarray, token: TokenId) -> bool:
    """Whether a packed mask row allows `token`."""
    return token >> 5 < row.shape[0] and bool((int(row[token >> 5]) >> (token & 31)) & 1)


def verify_masks(matcher: LLMatcher, props: Sequence[TokenId], eos: set[int], vocab_size: int,
                 position: int | None = None, row0: np.ndarray | None = None,
                 stats: StepTimings | None = None, budget_s: float | None = None
                 ) -> tuple[np.ndarray, int]:
    """Mask rows for every verify position, and how many proposals the grammar allows.

    Looks ahead on a `deep_copy` of the request's matcher (~2 µs), advanced through the
    proposals: row j is the mask after props[:j]. The first proposal its row forbids ends the
    look-ahead (the backstop). The request's matcher is left untouched.

    Returns:
        (bitmask (len(props)+1, words) int32, n_ok): rows past n_ok and the row after a
        proposed EOS stay all-banned (fail closed); they are never used.
    Args:
        position: output tokens emitted before this round (reported in errors).
        row0: the matcher's mask at its current state, when already filled.
        stats: where each fill's time is counted.
        budget_s: verify fewer proposals rather than fill rows past this round's budget
            (`over_round_budget`): rows 0..j-1 filled verify proposals[:j-1].
    Raises:
        GrammarStateError: the matcher is in (or enters) an error state.
        GrammarTooComplex: it reached one of llguidance's parser limits.
    """
    bitmask = np.zeros((len(props) + 1, (vocab_size + 31) // 32), dtype=np.int32)
    look = matcher.deep_copy()
    for j in range(len(props) + 1):
        if j == 0 and row0 is not None:
            bitmask[0] = row0
        elif j > 0 and stats is not None and over_round_budget(stats, budget_s):
            return bitmask, j - 1
        else:
            fill_row(look, bitmask, j, stats)
        if look.is_error():
            raise grammar_failure("grammar error while verifying", detail=look.get_error(),
                                  position=None if position is None else position + j)
        if j == len(props):
            break
        t = props[j]
        if not mask_allows(bitmask[j], t):
            return bitmask, j
        if t in eos:
            return bitmask, j + 1  # nothing follows EOS
        if not look.consume_token(t):
            raise grammar_failure(f"the grammar rejected token {t} its own mask allowed",
                                  detail=look.get_error(),
                                  position=None if position is None else position + j)
    return bitmask, len(props)
