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
from typing import Any, NamedTuple

import llguidance.numpy as llnp
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from llguidance import LLMatcher

import time

from .decode import StepTimings, grammar_failure
from .lookup import LookupCursor, NgramIndex, SuffixCursor
from .sampling import (SamplingParams, apply_mask, pick_scores, position_noise,
                       unpack_bitmask)

from .errors import DraftConfigError  # noqa: F401
from .config import MAX_TREE_NODES, SpecConfig  # noqa: F401
from .types import MAX_DRAFT_TOKENS, TokenId

TREE_WIDTH = 3  # candidates a token tree reads at each drafted position


TREE_MIN_SCORE = 0.15  # a branch's least score until `TreeCosts` has priced rows
TREE_MIN_FLOOR = 0.01  # the least threshold however cheap rows are


@dataclass(eq=False)
class TreeCosts:
    """What a token tree's branch row costs now and what it brings, learned from the rounds
    an engine runs; the threshold of requests whose `SpecConfig.tree_min_score` is None.

    Each round (`observe`) adds its seconds (proposing through accepting), its verify rows
    (all, and those on branches), its draft forwards, the tokens it emitted, and its branch
    tokens' scores and how many of them were accepted. An exponentially weighted
    least-squares fit of seconds = a + b * rows + e * branch_rows + f * draft_forwards
    (ridge on e: a branch row costs a chain row until branches are measured) prices a
    branch row (its verify row, masks and growing) at b + e; tau, the round seconds per
    emitted token, is what a row's time would buy otherwise. A branch token scored p adds
    ~kappa * p tokens (kappa: accepted branch tokens over the scores proposed, a prior of
    1), so it is worth its row when kappa * p * tau >= b + e: `threshold` is
    (b + e) / (kappa * tau). Rows that cost little (a small batch on a memory-bound GPU)
    give wide trees; rows whose compute the batch waits for (a full batch on a CPU) give a
    threshold over 1, chains. After `explore` rounds without a branch one round uses
    `TREE_MIN_SCORE`, so a stale price is measured again.
    """

    decay: float = 0.97  # each round's weight is this times the next one's
    ridge: float = 4.0
    explore: int = 64
    warmup: float = 8.0  # rounds (by weight) before the fit is used

    def __post_init__(self) -> None:
        self._xx = np.zeros((4, 4))
        self._xy = np.zeros(4)
        self._weight = self._seconds = self._tokens = self._scored = self._hits = 0.0
        self._idle = 0

    def observe(self, seconds: float, rows: int, branch_rows: int, draft_forwards: int,
                emitted: int, scored: float, hits: int) -> None:
        """Add one round's figures."""
        d = self.decay
        x = np.array([1.0, rows, branch_rows, draft_forwards])
        self._xx = d * self._xx + np.outer(x, x)
        self._xy = d * self._xy + x * seconds
        self._weight = d * self._weight + 1.0
        self._seconds = d * self._seconds + seconds
        self._tokens = d * self._tokens + emitted
        self._scored = d * self._scored + scored
        self._hits = d * self._hits + hits
        # a round with branches, or one that measured them again (`threshold`), restarts it
        self._idle = 0 if branch_rows or self._idle >= self.explore else self._idle + 1

    def prices(self) -> tuple[float, float, float] | None:
        """(seconds per branch row, seconds per emitted token, kappa), or None before
        `warmup` rounds."""
        if self._weight < self.warmup or self._tokens <= 0:
            return None
        small = 1e-6 * (np.diag(self._xx) + 1.0)  # a column that never varies: no price
        reg = np.diag([0.0, small[1], self.ridge, small[3]])
        try:
            _, b, e, _ = np.linalg.solve(self._xx + reg + 1e-9 * np.eye(4), self._xy)
        except np.linalg.LinAlgError:
            return None
        return (max(0.0, float(b + e)), self._seconds / self._tokens,
                (self._hits + 1.0) / (self._scored + 1.0))

    def threshold(self) -> float:
        """This round's least branch score (may be over 1: no branch is worth its row)."""
        p = self.prices()
        if p is None:
            return TREE_MIN_SCORE
        if self._idle >= self.explore:
            return TREE_MIN_SCORE
        row_s, token_s, kappa = p
        return max(TREE_MIN_FLOOR, row_s / (kappa * token_s))


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
        branched, branched_accepted: proposals on a token tree's branches (off the chain;
            also counted by source), and how many of those were accepted.
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
    branched: int = 0
    branched_accepted: int = 0
    grammar_cuts: int = 0
    draft_load_skips: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    spec_off: str = ""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


# A branch candidate: (token, its estimated chance of acceptance, source, the run that
# follows it: a lookup match's next tokens, () for the draft model's).
Branch = tuple[TokenId, float, str, Sequence[TokenId]]


class Proposals(NamedTuple):
    """A round's proposals (`draft_steps`): tokens, their sources ("forced" | "looked_up" |
    "suffixed" | "drafted"), how many of them the draft cache holds, and, for a token tree,
    each one's parent (-1: the context; None: a chain) with the chain's length (the tokens
    before the first branch; the draft model fed those only) and the sum of the branch
    tokens' scores (`TreeCosts`)."""

    tokens: list[TokenId]
    sources: list[str]
    fed: int = 0
    parents: list[int] | None = None
    chain: int = 0
    score: float = 0.0  # the branch tokens' scores, summed


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
           budget_s: float | None = None, earlier: Sequence[NgramIndex] = (), tree: int = 0,
           min_score: float = TREE_MIN_SCORE) -> Generator[tuple[str, Any], Any, Proposals]:
    """Propose up to kk tokens, each from the first source that has one: the grammar (a
    forced token), prompt lookup (a legal continuation of a repeated n-gram), earlier
    answers (`earlier`: a `SuffixStore`'s indexes, the same), the draft model.

    Returns the `Proposals`. The draft cache holds a prefix of `seq`; the tokens after it
    are fed with the next draft forward. With masking off an illegal proposal puts the clone
    in error, so drafting stops.

    `tree`: up to this many more proposals, on branches off the chain (`SpecConfig.tree`):
    at each drafted position the draft's other likeliest tokens (its top `TREE_WIDTH` by the
    pick's own order, so under sampling by its noisy scores), and where the gate ended the
    chain its pick too, scored by the draft's estimate of reaching and accepting them (the
    product of the chain's pick probabilities before them, times theirs); the best over
    `spec.tree_min_score` become branches, each followed by the tokens the grammar forces after
    it (`min_score` where the spec leaves it to the engine, None: `TreeCosts.threshold`). At
    each looked-up position, the other runs the prompt's index and the earlier
    answers hold after the same context (other match lengths, other answers) become branches
    too, scored by their source's acceptance rate in this request, each followed by the rest
    of its run while that stays legal and over the threshold. The chain comes first
    (proposals[i] under proposals[i - 1]), the branches after it. Branch tokens are never fed
    to the draft model.

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
        return Proposals(props, sources)
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
    # Branch candidates per drafted or looked-up position: (position, its matcher state, its
    # `Branch`es, the chance of reaching it); `reach` multiplies the chain's pick
    # probabilities (and lookup's rates).
    branches: list[tuple[int, LLMatcher | None, list[Branch], float]] = []
    reach = 1.0
    # A looked-up token's chance of being accepted: its source's rate so far in this
    # request (a prior of 1/2), for the reach of what follows it and for lookup branches.
    rate = {src: (getattr(stats, src + "_accepted") + 1) / (getattr(stats, src) + 2)
            for src in ("looked_up", "suffixed")}
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
            if tree > 0:  # the other runs the indexes hold here become branches
                runs = _lookup_runs(index, earlier, tail, spec.lookup_min_ngram, kk - j,
                                    row[0] if clone is not None else None, tok)
                if runs:
                    branches.append((j, clone.deep_copy() if clone is not None else None,
                                     [(r[0], rate[s], s, r[1:]) for s, r in runs], reach))
            reach *= rate[src]
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
            scores = pick_scores(logits, params, noise)
            choice = mx.argmax(scores, axis=-1)  # = `pick(logits, params, noise)`
            # In one sync: the pick's logit (-inf: every legal token is outside what the
            # draft can propose, e.g. a pruned draft vocabulary; the target decides) and,
            # when gated or branching, the pick's own probability (and the candidates').
            scale = 1.0 if params.greedy else params.temperature
            probs = (mx.softmax(logits / scale, axis=-1)
                     if spec.draft_min_prob > 0 or tree > 0 else None)
            p_pick = probs[choice] if probs is not None else mx.array(1.0)
            picked = logits[choice]
            alts: tuple[mx.array, ...] = ()
            if tree > 0:
                w = min(TREE_WIDTH, scores.shape[-1])
                ids = mx.argpartition(-scores, w - 1)[:w] if w < scores.shape[-1] \
                    else mx.arange(w)
                alts = (ids, probs[ids])
            yield ("eval", (choice, picked, p_pick, *alts))
            if picked.item() == -np.inf:
                break
            tok = int(choice.item())
            gated = p_pick.item() < spec.draft_min_prob
            if alts:
                opts = [(int(t if space is None else space[t]), float(q), "drafted", ())
                        for t, q in zip(alts[0].tolist(), alts[1].tolist())
                        if q > 0 and (gated or t != tok)]
                if opts:
                    branches.append((j, clone.deep_copy() if clone is not None else None,
                                     opts, reach))
            if gated:
                break  # unlikely to be accepted: verify what we have
            reach *= p_pick.item()
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
    if not branches:
        return Proposals(props, sources, fed)
    chain = len(props)
    parents = list(range(-1, chain - 1))
    score = _grow_tree(props, sources, parents, branches, tree,
                       spec.tree_min_score if spec.tree_min_score is not None else min_score,
                       kk, eos, stats, budget_s, spec.forced_drafting, vocab_size)
    return Proposals(props, sources, fed, parents if len(props) > chain else None, chain,
                     score)


def _lookup_runs(index: NgramIndex | None, earlier: Sequence[NgramIndex], tail: list[TokenId],
                 min_n: int, depth: int, row: np.ndarray | None, chosen: TokenId
                 ) -> list[tuple[str, list[TokenId]]]:
    """(source, run) for each run the prompt's index and the earlier answers' hold after
    `tail` (`NgramIndex.continuations`) whose first token is legal here (`row`: the mask,
    None: unconstrained) and not `chosen` or another run's."""
    runs, seen = [], {chosen}
    for src, indexes in (("looked_up", [index] if index is not None else []),
                         ("suffixed", earlier)):
        for ix in indexes:
            for run in ix.continuations(tail, min_n, depth):
                if run[0] in seen or (row is not None and not mask_allows(row, run[0])):
                    continue
                seen.add(run[0])
                runs.append((src, run))
    return runs


def _grow_tree(props: list[TokenId], sources: list[str], parents: list[int],
               branches: list[tuple[int, LLMatcher | None, list[Branch], float]],
               budget: int, min_score: float, kk: int, eos: set[int], stats: SpecStats,
               budget_s: float | None, forced_drafting: bool, vocab_size: int) -> float:
    """Add the best branches (`draft_steps`' `tree`) to a chain, in place: each candidate at
    chain position j hangs under proposal j - 1, followed (up to the round's depth `kk`) by
    the tokens its grammar state then forces and, for a lookup run, the rest of the run
    while legal and its score stays over `min_score` (each token multiplying it by the
    run's rate). Returns the added tokens' scores, summed (a forced token's is its
    branch's)."""
    cands = sorted(((reach * q, j, t, q, src, follow, st)
                    for j, st, opts, reach in branches for t, q, src, follow in opts),
                   key=lambda c: -c[0])
    row = llnp.allocate_token_bitmask(1, vocab_size)
    total = 0.0
    for score, j, tok, q, src, follow, st in cands:
        if budget <= 0 or score < min_score:
            break
        total += score
        props.append(tok)
        sources.append(src)
        parents.append(j - 1)
        setattr(stats, src, getattr(stats, src) + 1)
        stats.branched += 1
        budget -= 1
        if tok in eos:
            continue
        if not follow and (st is None or not forced_drafting):
            continue  # nothing can follow it
        look = st.deep_copy() if st is not None else None
        if look is not None and not look.consume_token(tok):
            continue
        at, depth, rest = len(props) - 1, j + 1, list(follow)
        while budget > 0 and depth < kk and not over_round_budget(stats, budget_s):
            f = None
            if look is not None:
                fill_row(look, row, 0, stats)
                if look.is_error():
                    break
                f = single_allowed(row[0]) if forced_drafting else None
            if f is not None:  # forced: the run goes on only where it agrees
                nxt, how = f, "forced"
                rest = rest[1:] if rest and rest[0] == f else []
            elif rest and score * q >= min_score and \
                    (look is None or mask_allows(row[0], rest[0])):
                nxt, how, rest = rest[0], src, rest[1:]
                score *= q
            else:
                break
            total += score
            props.append(nxt)
            sources.append(how)
            parents.append(at)
            setattr(stats, how, getattr(stats, how) + 1)
            stats.branched += 1
            budget -= 1
            at, depth = len(props) - 1, depth + 1
            if nxt in eos or (look is not None and not look.consume_token(nxt)):
                break
    return total


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


def tree_masks(matcher: LLMatcher, props: Sequence[TokenId], parents: Sequence[int],
               eos: set[int], vocab_size: int, position: int | None = None,
               row0: np.ndarray | None = None, stats: StepTimings | None = None,
               budget_s: float | None = None) -> tuple[np.ndarray, list[bool], int]:
    """`verify_masks` for a token tree (`draft_steps`' parents): row 0 is the mask at the
    matcher's state, row i + 1 the mask after the branch ending at proposal i (on a
    `deep_copy` advanced along that branch).

    Returns:
        (bitmask (len(props)+1, words) int32, which proposals may be accepted, how many the
        backstop cut): a proposal its parent's row forbids is cut with everything under it;
        one under an EOS, or whose row was not filled (the round's budget, `budget_s`), may
        not be accepted either. Rows not filled stay all-banned (fail closed).
    Raises:
        GrammarStateError, GrammarTooComplex: as `verify_masks`.
    """
    n = len(props)
    bitmask = np.zeros((n + 1, (vocab_size + 31) // 32), dtype=np.int32)
    root = matcher.deep_copy()
    if row0 is not None:
        bitmask[0] = row0
    else:
        fill_row(root, bitmask, 0, stats)
    if root.is_error():
        raise grammar_failure("grammar error while verifying", detail=root.get_error(),
                              position=position)
    states: dict[int, LLMatcher] = {-1: root}
    ok = [False] * n
    cuts = 0
    depth = {-1: 0}
    for i, (t, par) in enumerate(zip(props, parents)):
        if par >= 0 and (not ok[par] or props[par] in eos):
            continue
        depth[i] = depth[par] + 1
        at = None if position is None else position + depth[i]
        if not mask_allows(bitmask[par + 1], t):
            cuts += 1
            continue
        if t in eos:
            ok[i] = True  # nothing follows EOS: its row stays banned
            continue
        if stats is not None and over_round_budget(stats, budget_s):
            break
        look = states[par].deep_copy()
        if not look.consume_token(t):
            raise grammar_failure(f"the grammar rejected token {t} its own mask allowed",
                                  detail=look.get_error(), position=at)
        fill_row(look, bitmask, i + 1, stats)
        if look.is_error():
            raise grammar_failure("grammar error while verifying", detail=look.get_error(),
                                  position=at)
        states[i] = look
        ok[i] = True
    return bitmask, ok, cuts


def tree_path(props: Sequence[TokenId], parents: Sequence[int], ok: Sequence[bool],
              picks: Sequence[int]) -> list[int]:
    """The accepted branch of a verified tree: from the context, the child whose token is the
    target's pick at its parent's row (row 0 for the context, i + 1 after proposal i), as
    long as there is one. Returns the proposals' indices along it."""
    children: dict[int, dict[int, int]] = {}
    for i, (t, par) in enumerate(zip(props, parents)):
        if ok[i]:
            children.setdefault(par, {}).setdefault(t, i)
    path, at = [], -1
    while True:
        nxt = children.get(at, {}).get(int(picks[at + 1]))
        if nxt is None:
            return path
        path.append(nxt)
        at = nxt
