"""Speculative decoding under grammars: masked drafting, one-pass verify, exact acceptance.

This module holds the proposer (`Proposer`) and the verify-side masks (`verify_masks`); the
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
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import llguidance.numpy as llnp
import mlx.core as mx
import mlx.nn as nn
import numpy as np


from .decode import StepTimings
from .lookup import LookupCursor, NgramIndex, SuffixCursor
from .sampling import (SamplingParams, apply_mask, pick_scores, position_noise,
                       unpack_bitmask)

from .errors import DraftConfigError  # noqa: F401
from .config import MAX_TREE_NODES, SpecConfig  # noqa: F401
from .request_grammar import failure_of, fill_row, single_allowed
from .types import MAX_DRAFT_TOKENS, GrammarState, ProposalSource, SourceCount, TokenId

FORCED, LOOKED_UP = ProposalSource.FORCED, ProposalSource.LOOKED_UP
SUFFIXED, DRAFTED = ProposalSource.SUFFIXED, ProposalSource.DRAFTED

SOURCE_NAMES = frozenset(s.value for s in ProposalSource)  # the counters' wire names
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
        sources: proposals by source (`ProposalSource`: grammar-forced, prompt lookup,
            earlier answers, draft model) and how many of each the target accepted; counted
            by `propose` and `accept`, read by their wire names (`source_counts`:
            `forced`, `forced_accepted`, ...).
        branched, branched_accepted: proposals on a token tree's branches (off the chain;
            also counted by source), and how many of those were accepted.
        grammar_cuts: rounds whose proposals the backstop truncated.
        budget_steered: output positions the token-budget rule changed (`budget`): the
            budget forced the document's close; budget_s: time spent in the rule.
        draft_load_skips: rounds in which the draft model was left out because the batch
            was larger than `Models.draft_max_batch`.
        draft_s, verify_s: time in draft and verify phases.
        first_round_s: the request's first round, the one that gave its first tokens (its
            time to first token is its wait, its prefill and this).
        spec_off: why a request that asked for speculation decodes plainly, or the draft
            model is left out ("" when neither): a cache kind that cannot be trimmed exactly.
    """

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    sources: dict[ProposalSource, SourceCount] = field(
        default_factory=lambda: {src: SourceCount() for src in ProposalSource})
    branched: int = 0
    branched_accepted: int = 0
    grammar_cuts: int = 0
    budget_steered: int = 0
    budget_s: float = 0.0
    draft_load_skips: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    first_round_s: float = 0.0
    spec_off: str = ""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def propose(self, src: ProposalSource, branch: bool = False) -> None:
        """Count one proposal from `src` (`branch`: on a token tree's branch)."""
        self.sources[src].proposed += 1
        self.branched += branch

    def accept(self, src: ProposalSource, branch: bool = False) -> None:
        """Count one accepted proposal from `src` (`branch`: on a token tree's branch)."""
        self.sources[src].accepted += 1
        self.branched_accepted += branch

    def rate(self, src: ProposalSource) -> float:
        """`src`'s acceptance rate so far in this request, with a prior of 1/2."""
        c = self.sources[src]
        return (c.accepted + 1) / (c.proposed + 2)

    def source_counts(self) -> dict[str, int]:
        """The proposals and acceptances by source and on branches, under their wire names
        (`forced`, `forced_accepted`, ..., `branched`, `branched_accepted`): what the
        response's `specdec` extension, /metrics and the bench report."""
        out: dict[str, int] = {}
        for src, c in self.sources.items():
            out[src.value], out[f"{src.value}_accepted"] = c.proposed, c.accepted
        out["branched"], out["branched_accepted"] = self.branched, self.branched_accepted
        return out

    def as_dict(self) -> dict[str, Any]:
        """Every counter under its wire name, in field order (`sources` spelled out)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "sources":
                out.update(self.source_counts())
            elif f.name not in out:
                out[f.name] = getattr(self, f.name)
        return out


class Branch(NamedTuple):
    """A branch candidate at a chain position: its token, its estimated chance of being
    accepted, its source, and the run that follows it (a lookup match's next tokens; () for
    the draft model's)."""

    token: TokenId
    q: float
    source: ProposalSource
    follow: Sequence[TokenId]


class BranchPoint(NamedTuple):
    """A chain position branches may hang at: the position, the grammar's state there (None:
    unconstrained), its candidates, and the chance of reaching it (the chain's pick
    probabilities before it, and lookup's rates)."""

    position: int
    state: GrammarState | None
    options: list[Branch]
    reach: float


class Proposals(NamedTuple):
    """A round's proposals (`Proposer`): tokens, their sources, how many of them the draft
    cache holds, and, for a token tree, each one's parent (-1: the context; None: a chain)
    with the chain's length (the tokens before the first branch; the draft model fed those
    only) and the sum of the branch tokens' scores (`TreeCosts`)."""

    tokens: list[TokenId]
    sources: list[ProposalSource]
    fed: int = 0
    parents: list[int] | None = None
    chain: int = 0
    score: float = 0.0  # the branch tokens' scores, summed


def over_round_budget(stats: StepTimings, budget_s: float | None) -> bool:
    """Whether this round's fills for a request have spent its in-round budget (then it
    proposes no further and verifies what it has: the round ends sooner, output unchanged)."""
    return budget_s is not None and stats.round_mask_s > budget_s


def trim_cache(cache: list, n: int) -> None:
    """Drop the last `n` positions of every layer's cache (n <= 0: none)."""
    if n > 0:
        for c in cache:
            c.trim(n)


@dataclass(frozen=True)
class RequestView:
    """One request as its proposer reads it.

    Attributes:
        seq: prompt + emitted tokens; emitted: how many were emitted.
        eos: the end-of-sequence ids (nothing is proposed after one).
        params, spec, stats: its sampling, speculative settings, and counters (`SpecStats`:
            proposals are counted there, and the looked-up sources' rates read).
        vocab_size: the grammar's width (the target's logits).
        matcher: its grammar (None: unconstrained); never advanced, a clone is.
        index: its prompt-lookup index (None: lookup off).
        earlier: earlier answers' indexes (`SuffixStore.indexes`; (): none).
    """

    seq: list[TokenId]
    emitted: int
    eos: AbstractSet[int]
    params: SamplingParams
    spec: SpecConfig
    stats: SpecStats
    vocab_size: int
    matcher: GrammarState | None = None
    index: NgramIndex | None = None
    earlier: Sequence[NgramIndex] = ()


@dataclass(frozen=True)
class DraftSide:
    """The draft model as one request's proposer sees it in a round.

    Attributes:
        model: the draft (None: none, or left out this round: no drafted tokens).
        cache: its KV cache of the request (a prefix of `seq`; the rest is fed with its
            next forward).
        vocab: the draft's logits width (the target's when there is no draft): a token past
            it cannot be fed to the draft, so it is not proposed.
        space: a pruned vocabulary's target ids (`MappedDraft.space`): the draft's logits
            are over those, column i being target id space[i], ascending; None: target ids.
    """

    model: nn.Module | None = None
    cache: list = field(default_factory=list)
    vocab: int = 0
    space: np.ndarray | None = None


@dataclass(frozen=True)
class RoundBounds:
    """What a round lets one request propose.

    Attributes:
        depth: most proposals (its token budget; the spec's k, `cheap_k` or
            `MAX_DRAFT_TOKENS` caps it).
        run_on: looked-up tokens may run on past k to `cheap_k`, forced ones past those to
            `MAX_DRAFT_TOKENS` (False in a batched round: past ~16 rows every verify row
            costs compute the other requests wait for, while a run that stops at k finishes
            next round).
        tree: most branch tokens (its share of `SpecConfig.tree`; 0: a chain).
        min_score: the branch threshold where the spec leaves it open
            (`TreeCosts.threshold`).
        row0: the matcher's mask at its current state, when already filled (the round's
            first verify row): read instead of filled again.
        budget_s: stop proposing once the round's fills took this long
            (`over_round_budget`).
    """

    depth: int
    run_on: bool = True
    tree: int = 0
    min_score: float = TREE_MIN_SCORE
    row0: np.ndarray | None = None
    budget_s: float | None = None


@dataclass(frozen=True)
class Forward:
    """A proposer's ask: feed `tokens` to the draft model, answer with its logits at the
    last position."""

    tokens: Sequence[TokenId]


@dataclass(frozen=True)
class Evaluate:
    """A proposer's ask: evaluate `arrays` (the driver evaluates every request's at once)."""

    arrays: tuple[mx.array, ...]


Ask = Forward | Evaluate  # what a proposer asks its driver


class Proposer:
    """One request's proposals for one round: up to `depth` tokens, each from the first
    source that has one: the grammar (a forced token), prompt lookup (a legal continuation of
    a repeated n-gram), earlier answers (`RequestView.earlier`, the same), the draft model.

    Driven by `steps`, a generator: it asks `Forward(tokens)` for a draft forward (those
    tokens fed, then answered with the draft's logits at the last position: (Vd,), or
    (len(space),) with `DraftSide.space`) and `Evaluate(arrays)` to have arrays evaluated (the
    driver evaluates every request's at once), and returns the `Proposals`. `core` drives
    every request's proposer in lock-step, one batched draft forward per step. With masking
    off an illegal proposal puts the clone in error, so proposing stops.

    Token trees (`RoundBounds.tree`: up to that many more proposals, on branches off the
    chain): at each drafted position the draft's other likeliest tokens (its top
    `TREE_WIDTH` by the pick's own order, so under sampling by its noisy scores), and where
    the gate ended the chain its pick too, scored by the draft's estimate of reaching and
    accepting them (the product of the chain's pick probabilities before them, times
    theirs); at each looked-up position, the other runs the prompt's index and the earlier
    answers hold after the same context (other match lengths, other answers), scored by
    their source's acceptance rate in this request. The best over `spec.tree_min_score`
    (`RoundBounds.min_score` where the spec leaves it open) become branches, each followed
    by the tokens the grammar forces after it and, for a run, the rest of the run while it
    stays legal and over the threshold (`_grow_tree`). The chain comes first (proposals[i]
    under proposals[i - 1]), the branches after it; branch tokens are never fed to the
    draft model.

    A pruned-vocabulary draft (`DraftSide.space`): the mask and the (seed, position) noise
    are read at its ids, so the pick is the one over target-width logits (-inf off the
    draft's vocabulary), ties included, at a sixth of the width.
    """

    def __init__(self, req: RequestView, draft: DraftSide, bounds: RoundBounds) -> None:
        spec = req.spec
        self.req, self.draft, self.bounds = req, draft, bounds
        # The draft model proposes up to k per round; looked-up tokens (no draft step, and
        # usually accepted) may bring the proposals that are not forced to 2k; forced tokens
        # (certain) run on past them to `MAX_DRAFT_TOKENS`: a call's markup and name, a
        # schema's keys, come in the round that reaches them. All capped by the token budget.
        self.k_model = min(spec.k, bounds.depth)
        self.open_k = min(spec.cheap_k if bounds.run_on else spec.k, bounds.depth)
        self.depth = min(MAX_DRAFT_TOKENS if bounds.run_on else spec.k, bounds.depth)
        self.clone: GrammarState | None = None  # advanced through the proposals
        if req.matcher is not None and (spec.draft_masking or spec.forced_drafting
                                        or req.index or req.earlier):
            self.clone = req.matcher.deep_copy()
        self.row = llnp.allocate_token_bitmask(1, req.vocab_size)  # the clone's mask
        self.feed = req.seq[draft.cache[0].offset:] if draft.cache else []  # not yet fed
        self.fed = 0
        self.cursor = (LookupCursor(req.index, spec.lookup_min_ngram)
                       if req.index is not None else None)
        self.suffix = (SuffixCursor(req.earlier, spec.lookup_min_ngram)
                       if req.earlier else None)
        self.max_n = max([i.max_n for i in req.earlier]
                         + ([req.index.max_n] if req.index is not None else [1]))
        self.tail = req.seq[-self.max_n:]
        self.tokens: list[TokenId] = []
        self.sources: list[ProposalSource] = []
        self.branches: list[BranchPoint] = []
        self.reach = 1.0  # the chance of reaching the next position (`BranchPoint.reach`)
        # A looked-up token's chance of being accepted: its source's rate so far in this
        # request, for the reach of what follows it and for lookup branches.
        self.rate = {src: req.stats.rate(src) for src in (LOOKED_UP, SUFFIXED)}
        # A token tree's growth (`_grow_tree`): parents, branch tokens left, their scores.
        self.parents: list[int] = []
        self.room = bounds.tree
        self.score = 0.0

    def steps(self) -> Generator[Ask, Any, Proposals]:
        """Propose, asking the driver for draft forwards and evaluations; returns the
        `Proposals`."""
        if self.bounds.depth <= 0:
            return Proposals([], [])
        opened = drafts = 0  # proposals not forced; of them, the draft model's
        for j in range(self.depth):
            if self.clone is not None and not self._fill(j):
                break
            forced = (single_allowed(self.row[0])
                      if self.clone is not None and self.req.spec.forced_drafting else None)
            if forced is None and opened >= self.open_k:
                break  # only forced tokens run on past the open share
            found = self._looked_up() if forced is None else None
            if forced is not None:
                if forced >= self.draft.vocab:
                    break  # the draft cannot embed it; let the target decide
                tok, src = forced, FORCED
            elif found is not None and found[0] < self.draft.vocab:
                tok, src = found
                if self.bounds.tree > 0:  # the other runs the indexes hold here: branches
                    self._branch_runs(j, tok)
                self.reach *= self.rate[src]
            elif self.draft.model is None or drafts >= self.k_model:
                break  # no model (or its share is spent): stop at the first open position
            else:
                drafted = yield from self._draft(j)
                if drafted is None:
                    break
                tok, src = drafted, DRAFTED
                drafts += 1
            opened += src != FORCED
            if not self._take(tok, src):
                break
        return self._finish()

    def _fill(self, j: int) -> bool:
        """The clone's mask into `row` (the round's first row, where given); False: stop
        proposing (the round's fills are over budget, or the grammar is in error)."""
        assert self.clone is not None
        if j == 0 and self.bounds.row0 is not None:
            self.row[0] = self.bounds.row0
        elif over_round_budget(self.req.stats, self.bounds.budget_s):
            return False
        else:
            fill_row(self.clone, self.row, 0, self.req.stats)
            if self.clone.is_error():
                return False
        return True

    def _looked_up(self) -> tuple[TokenId, ProposalSource] | None:
        """The first legal continuation prompt lookup, then the earlier answers, hold after
        the tail (None: neither has one)."""
        for src, cursor in ((LOOKED_UP, self.cursor), (SUFFIXED, self.suffix)):
            if cursor is None:
                continue
            cand = cursor.next(self.tail)
            if cand is not None and self.clone is not None \
                    and not mask_allows(self.row[0], cand):
                cand = None  # the grammar forbids it here: not a proposal
            if cand is not None:
                return cand, src
        return None

    def _branch_runs(self, j: int, tok: TokenId) -> None:
        """The other runs the indexes hold at looked-up position j become its branches."""
        runs = _lookup_runs(self.req.index, self.req.earlier, self.tail,
                            self.req.spec.lookup_min_ngram, self.depth - j,
                            self.row[0] if self.clone is not None else None, tok)
        if runs:
            self.branches.append(BranchPoint(
                j, self.clone.deep_copy() if self.clone is not None else None,
                [Branch(r[0], self.rate[s], s, r[1:]) for s, r in runs], self.reach))

    def _draft(self, j: int) -> Generator[Ask, Any, TokenId | None]:
        """The draft model's pick at position j (a target id), its other likeliest tokens
        noted as branches; None: it has none (every legal token is outside what it can
        propose) or the gate ends the chain (`SpecConfig.draft_min_prob`)."""
        logits = yield Forward(self.feed)
        self.fed, self.feed = len(self.tokens), []
        choice, picked, p_pick, alts = self._pick(logits, j)
        yield Evaluate((choice, picked, p_pick, *alts))
        if picked.item() == -np.inf:
            return None
        tok = int(choice.item())
        gated = p_pick.item() < self.req.spec.draft_min_prob
        if alts:
            space = self.draft.space
            opts = [Branch(int(t if space is None else space[t]), float(q), DRAFTED, ())
                    for t, q in zip(alts[0].tolist(), alts[1].tolist())
                    if q > 0 and (gated or t != tok)]
            if opts:
                self.branches.append(BranchPoint(
                    j, self.clone.deep_copy() if self.clone is not None else None, opts,
                    self.reach))
        if gated:
            return None  # unlikely to be accepted: verify what we have
        self.reach *= p_pick.item()
        return tok if self.draft.space is None else int(self.draft.space[tok])

    def _pick(self, logits: mx.array, j: int
              ) -> tuple[mx.array, mx.array, mx.array, tuple[mx.array, ...]]:
        """The draft's pick at position j from its logits (lazy): (its index, its logit,
        its probability, and for a tree the top `TREE_WIDTH` candidates' (indices,
        probabilities)), under the clone's mask and the (seed, position) noise."""
        spec, params, space = self.req.spec, self.req.params, self.draft.space
        if space is not None:
            if self.clone is not None and spec.draft_masking:
                logits = apply_mask(logits, mx.array(space_mask(self.row[0], space)))
        elif self.clone is not None and spec.draft_masking:
            logits = apply_mask(logits, unpack_bitmask(mx.array(self.row[0]), self.draft.vocab))
        noise = None
        if not params.greedy:
            noise = position_noise(params.seed or 0, self.req.emitted + j, self.draft.vocab)
            noise = mx.array(noise if space is None else noise[space])
        scores = pick_scores(logits, params, noise)
        choice = mx.argmax(scores, axis=-1)  # = `pick(logits, params, noise)`
        # In one sync: the pick's logit (-inf: every legal token is outside what the draft
        # can propose, e.g. a pruned draft vocabulary; the target decides) and, when gated
        # or branching, the pick's own probability (and the candidates').
        scale = 1.0 if params.greedy else params.temperature
        tree = self.bounds.tree > 0
        probs = (mx.softmax(logits / scale, axis=-1)
                 if spec.draft_min_prob > 0 or tree else None)
        p_pick = probs[choice] if probs is not None else mx.array(1.0)
        alts: tuple[mx.array, ...] = ()
        if tree:
            w = min(TREE_WIDTH, scores.shape[-1])
            ids = mx.argpartition(-scores, w - 1)[:w] if w < scores.shape[-1] \
                else mx.arange(w)
            alts = (ids, probs[ids])
        return choice, logits[choice], p_pick, alts

    def _take(self, tok: TokenId, src: ProposalSource) -> bool:
        """Propose `tok` next on the chain; False: nothing may follow it (an EOS, or an
        unmasked illegal proposal: the backstop will cut it)."""
        self.tokens.append(tok)
        self.sources.append(src)
        self.req.stats.propose(src)
        if tok in self.req.eos:
            return False
        self.feed.append(tok)
        if self.cursor is not None:
            self.cursor.advance(tok)
        if self.suffix is not None:
            self.suffix.advance(tok)
        self.tail = (self.tail + [tok])[-self.max_n:]
        if self.clone is not None:
            self.clone.consume_token(tok)
            if self.clone.is_error():
                return False
        return True

    def _finish(self) -> Proposals:
        """The chain, and the tree grown on it where there are branch candidates."""
        if not self.branches:
            return Proposals(self.tokens, self.sources, self.fed)
        chain = len(self.tokens)
        self.parents = list(range(-1, chain - 1))
        self._grow_tree()
        return Proposals(self.tokens, self.sources, self.fed,
                         self.parents if len(self.tokens) > chain else None, chain,
                         self.score)

    @property
    def min_score(self) -> float:
        """A branch token's least score (the spec's, else the round's)."""
        spec = self.req.spec
        return spec.tree_min_score if spec.tree_min_score is not None \
            else self.bounds.min_score

    def _grow_tree(self) -> None:
        """Add the best branches to the chain, in place, up to `room` tokens: each
        candidate at chain position j hangs under proposal j - 1, followed by what its
        grammar state forces and the rest of its run (`_follow`). Their scores add up in
        `score` (a forced token's is its branch's)."""
        cands = sorted(((reach * b.q, j, b, st) for j, st, opts, reach in self.branches
                        for b in opts), key=lambda c: -c[0])
        row = llnp.allocate_token_bitmask(1, self.req.vocab_size)
        forced_drafting = self.req.spec.forced_drafting
        for score, j, b, st in cands:
            if self.room <= 0 or score < self.min_score:
                break
            self._add_branch(b.token, b.source, j - 1, score)
            if b.token in self.req.eos:
                continue
            if not b.follow and (st is None or not forced_drafting):
                continue  # nothing can follow it
            look = st.deep_copy() if st is not None else None
            if look is not None and not look.consume_token(b.token):
                continue
            self._follow(b, score, j + 1, look, row)

    def _follow(self, b: Branch, score: float, depth: int, look: GrammarState | None,
                row: np.ndarray) -> None:
        """Extend the branch just added (`b`, its head at chain depth `depth`) up to the
        round's depth: with the tokens its grammar state (`look`, advanced) then forces,
        and for a lookup run the rest of the run while legal and its score stays over the
        threshold (each token multiplying it by the run's rate)."""
        rest = list(b.follow)
        stats, forced_drafting = self.req.stats, self.req.spec.forced_drafting
        while self.room > 0 and depth < self.depth \
                and not over_round_budget(stats, self.bounds.budget_s):
            f = None
            if look is not None:
                fill_row(look, row, 0, stats)
                if look.is_error():
                    break
                f = single_allowed(row[0]) if forced_drafting else None
            if f is not None:  # forced: the run goes on only where it agrees
                nxt, how = f, FORCED
                rest = rest[1:] if rest and rest[0] == f else []
            elif rest and score * b.q >= self.min_score and \
                    (look is None or mask_allows(row[0], rest[0])):
                nxt, how, rest = rest[0], b.source, rest[1:]
                score *= b.q
            else:
                break
            self._add_branch(nxt, how, len(self.tokens) - 1, score)
            depth += 1
            if nxt in self.req.eos or (look is not None and not look.consume_token(nxt)):
                break

    def _add_branch(self, tok: TokenId, src: ProposalSource, parent: int, score: float
                    ) -> None:
        """Propose `tok` under proposal `parent`, off the chain."""
        self.score += score
        self.tokens.append(tok)
        self.sources.append(src)
        self.parents.append(parent)
        self.req.stats.propose(src, branch=True)
        self.room -= 1


def _lookup_runs(index: NgramIndex | None, earlier: Sequence[NgramIndex], tail: list[TokenId],
                 min_n: int, depth: int, row: np.ndarray | None, chosen: TokenId
                 ) -> list[tuple[ProposalSource, list[TokenId]]]:
    """(source, run) for each run the prompt's index and the earlier answers' hold after
    `tail` (`NgramIndex.continuations`) whose first token is legal here (`row`: the mask,
    None: unconstrained) and not `chosen` or another run's."""
    runs, seen = [], {chosen}
    for src, indexes in ((LOOKED_UP, [index] if index is not None else []),
                         (SUFFIXED, earlier)):
        for ix in indexes:
            for run in ix.continuations(tail, min_n, depth):
                if run[0] in seen or (row is not None and not mask_allows(row, run[0])):
                    continue
                seen.add(run[0])
                runs.append((src, run))
    return runs


def space_mask(row: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Whether a packed mask row allows each of `ids` (bool, like `ids`)."""
    words = ids >> 5
    ok = words < row.shape[0]
    bits = (row[np.minimum(words, row.shape[0] - 1)] >> (ids & 31)) & 1
    return ok & (bits != 0)


def mask_allows(row: np.ndarray, token: TokenId) -> bool:
    """Whether a packed mask row allows `token`."""
    return token >> 5 < row.shape[0] and bool((int(row[token >> 5]) >> (token & 31)) & 1)


def verify_masks(matcher: GrammarState, props: Sequence[TokenId], eos: set[int], vocab_size: int,
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
            raise failure_of(look, "grammar error while verifying",
                             None if position is None else position + j)
        if j == len(props):
            break
        t = props[j]
        if not mask_allows(bitmask[j], t):
            return bitmask, j
        if t in eos:
            return bitmask, j + 1  # nothing follows EOS
        if not look.consume_token(t):
            raise failure_of(look, f"the grammar rejected token {t} its own mask allowed",
                             None if position is None else position + j)
    return bitmask, len(props)


def tree_masks(matcher: GrammarState, props: Sequence[TokenId], parents: Sequence[int],
               eos: set[int], vocab_size: int, position: int | None = None,
               row0: np.ndarray | None = None, stats: StepTimings | None = None,
               budget_s: float | None = None) -> tuple[np.ndarray, list[bool], int]:
    """`verify_masks` for a token tree (`Proposals.parents`): row 0 is the mask at the
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
        raise failure_of(root, "grammar error while verifying", position)
    states: dict[int, GrammarState] = {-1: root}
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
            raise failure_of(look, f"the grammar rejected token {t} its own mask allowed", at)
        fill_row(look, bitmask, i + 1, stats)
        if look.is_error():
            raise failure_of(look, "grammar error while verifying", at)
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
