"""The round-based decode core: per-request state objects stepped together in rounds.

A round over a set of requests:
1. Propose, per request: grammar-forced tokens, prompt lookup, the draft model (the
   request's `speculative.Proposer`); a plain request (`spec is None`) proposes nothing.
2. Verify: one target forward over every request's rows ([last token, proposals...];
   ragged: each request its own length, its own KV cache; `ragged.forward`), queued
   asynchronously while the host fills every request's mask rows on a matcher copy
   (`speculative.verify_masks`: backstop included).
3. Pick: each request's rows masked and picked with its own sampling parameters and
   (seed, position) noise; one device sync for the whole round.
4. Accept, per request: the agreeing prefix of its proposals and the target's own next pick;
   the request's matcher consumes them; caches are trimmed to the accepted length.

Plain decoding is the round with no proposer, so a request decoded alone, plainly,
speculatively or inside any batch emits the same tokens: every path computes each output
position's logits over the same cache with the same shapes (bitwise on the reference BLAS,
see `ragged`), masks them with the same grammar state and picks with the same noise.
New requests join between rounds; their prompt is prefilled in chunks (`prefill_arrivals`), so
running requests stall for at most one chunk per round. No I/O; each request's next mask
fills between rounds on its grammar's workers (`request_grammar.RequestGrammar`), and
`scheduler.py` drives rounds for the server.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

from collections.abc import Generator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import ragged
from .budget import BudgetRule, Spend, ranked_ids, spending
from .decode import PREFILL_CHUNK, PromptKVCache
from .decode import prefill as prefill_tokens
from .lookup import NgramIndex, SuffixStore
from .sampling import (SamplingParams, apply_mask, bias_vector, pick, pick_scores,
                       position_noise, unpack_bitmask)
from .errors import (GrammarRefused, GrammarStateError, GrammarTooComplex, InternalError,
                     Overspent, SpecdecError)
from .config import MaskBudget
from .events import TokenLogprob, TokenSource
from .prepare import Request
from .request_grammar import GrammarClock, RequestGrammar
from .types import DecodeFinish, GrammarState, TokenId
from .speculative import (TREE_MIN_SCORE, Ask, DraftSide, Evaluate, Forward, Proposals,
                          Proposer, RequestView, RoundBounds, SpecConfig, SpecStats, TreeCosts,
                          mask_allows, trim_cache, tree_masks, tree_path, verify_masks)

log = logging.getLogger("specdec")
_SAID: set[str] = set()  # reasons for limited speculation already logged



@dataclass(frozen=True)
class Models:
    """The target (and draft) a set of requests decodes with.

    Attributes:
        target: mlx-lm model; vocab_size: its logits width V.
        draft: a model with the target's token ids (may be the target), or None.
        draft_vocab_size: the draft's logits width (<= V).
        draft_max_batch: the draft model runs in rounds where at most this many requests
            would draft (None: any number); a larger round proposes grammar-forced and
            looked-up tokens only. Where the target's forward is compute-bound (a CPU), a
            large batch's extra verify rows and draft steps cost more than they save.
        trees: what branch rows cost now, learned from the rounds (`TreeCosts`); None: the
            threshold is `TREE_MIN_SCORE` where a spec leaves it open.
    """

    target: nn.Module
    vocab_size: int
    draft: nn.Module | None = None
    draft_vocab_size: int = 0
    draft_max_batch: int | None = None
    masks: MaskBudget = MaskBudget()
    trees: TreeCosts | None = None


@dataclass
class Reported:
    """What a request reports beside each token the last round emitted (the caller drains
    it with `new_tokens`): its logprob, where the request asks for them
    (`DecodeState.logprobs`), and its source and allowed-set size (`events.TokenSource`),
    where it asks for those (`sources` None: not asked)."""

    logprobs: list[TokenLogprob] = field(default_factory=list)
    sources: list[TokenSource] | None = None

    def next_round(self) -> None:
        self.logprobs = []
        if self.sources is not None:
            self.sources = []


@dataclass(frozen=True)
class Reuse:
    """What a request reuses and adds to: its partition of the prompt store (`scope`,
    `Request.scope`), and the earlier answers it proposes from where `SpecConfig.suffix`
    asks (`suffixes`; None: not), under its grammar's key there (`key`,
    `lookup.grammar_key`)."""

    scope: str = ""
    suffixes: SuffixStore | None = None
    key: str | None = None


@dataclass(eq=False)
class DecodeState:
    """One request in flight: everything a round needs, nothing in generator locals.

    Invariant between rounds (once prefilled): the target cache holds `seq[:-1]`; the draft
    cache a prefix of `seq`.

    Attributes:
        seq: prompt + emitted tokens; emitted: how many were emitted.
        new_tokens: what the last round emitted (the caller drains it); reported: what
            it reports beside each of them (logprobs, sources).
        finish: set when the request is done ("stop" or "length"); error: the
            grammar error that ended it (nothing past it is emitted).
        grammar: its grammar's state, budget rule and next mask, filling off the round
            (`request_grammar.RequestGrammar`, `MaskBudget`).
    """

    prompt: tuple[TokenId, ...]
    max_tokens: int
    eos: frozenset[int]
    params: SamplingParams = SamplingParams()
    spec: SpecConfig | None = None
    grammar: RequestGrammar | None = None  # its grammar (None: unconstrained)
    stats: SpecStats = field(default_factory=SpecStats)
    t_cache: list = field(default_factory=list)
    d_cache: list = field(default_factory=list)
    seq: list[TokenId] = field(default_factory=list)
    emitted: int = 0
    index: NgramIndex | None = None
    reuse: Reuse = field(default_factory=lambda: Reuse())  # what it reuses and adds to
    to_prefill: int = 0
    new_tokens: list[TokenId] = field(default_factory=list)
    bias: mx.array | None = None  # the request's logit bias, dense (V,)
    logprobs: int | None = None  # None: off; n: the chosen token's logprob and the top n
    reported: Reported = field(default_factory=Reported)
    finish: DecodeFinish | None = None
    error: SpecdecError | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None or self.error is not None

    def release(self) -> None:
        """Drop the caches (a finished request gives its slab slots back)."""
        self.t_cache, self.d_cache = [], []
        if self.grammar is not None:
            self.grammar.drop_next_mask()

    def ask_next_mask(self, vocab_size: int) -> None:
        """Start filling the mask at the grammar's current state, off the round (copying
        the state counts in the grammar budget; the fill counts when it is taken)."""
        if self.grammar is not None and not self.done:
            with GrammarClock(self.stats):
                self.grammar.ask_next_mask(vocab_size, self.emitted)

    @property
    def ready(self) -> bool:
        """Prefilled: it can take part in rounds."""
        return self.to_prefill == 0 and not self.done


def new_state(models: Models, req: Request, eos_token_ids: Sequence[TokenId], *,
              matcher: GrammarState | None = None, stats: SpecStats | None = None,
              suffixes: SuffixStore | None = None, suffix_key: str | None = None
              ) -> DecodeState:
    """A request's state with empty caches (prefill with `prefill` or `prefill_arrivals`):
    its prompt, output budget, sampling, speculative settings and logprobs come from the
    prepared `req`; `matcher` is a fresh state of its grammar (None: unconstrained), made
    its `RequestGrammar` with the budget rule `req.closing` asks for. `suffixes`: earlier
    answers, where `spec.suffix` asks for their proposals; the output joins them under
    `suffix_key` once it finishes (`scheduler.Scheduler`).

    Raises:
        ValueError: empty prompt, max_tokens < 1, sampling without a seed, a draft vocabulary
            wider than the target's.
        GrammarStateError: the matcher is already in an error state.
    """
    prompt, max_tokens, params, spec = req.prompt_ids, req.max_tokens, req.sampling, req.spec
    _check_request(models, prompt, max_tokens, params)
    eos = frozenset(eos_token_ids)
    grammar = None
    if matcher is not None:
        grammar = RequestGrammar(matcher)  # (raises where the state already failed)
        if req.closing is not None:
            assert req.closing.order is not None, \
                "a replica's request: Engine.new_state builds it"
            grammar.rule = BudgetRule(req.closing.order, max_tokens, req.closing.minimum, eos,
                                      req.closing.hints)
    # The most positions it can hold: a slab slot, or storage of its own when that is more
    # than a slot holds (`ragged.SLOT_POSITIONS`), so one long request sizes no other's.
    horizon = len(prompt) + max_tokens + (spec.cheap_k + spec.tree + 1 if spec is not None
                                          else 1)
    s = DecodeState(tuple(prompt), max_tokens, eos, params, spec, grammar,
                    stats if stats is not None else SpecStats(),
                    ragged.make_cache(models.target, horizon), [], list(prompt))
    if spec is not None:
        _fit_speculation(models, s, horizon)
    s.bias = bias_vector(params, models.vocab_size)
    # (token sources carry their tokens' logprobs and top alternatives too)
    sources = getattr(req, "token_sources", None)
    s.logprobs = req.logprobs if sources is None else max(req.logprobs or 0, sources)
    s.reported.sources = [] if sources is not None else None
    s.to_prefill = len(prompt) - 1  # the caches hold seq[:-1]; the last token opens round 1
    if req.prefill_only:
        s.max_tokens = 0  # a history prefill: it generates nothing (`prefill_arrivals`)
    if s.spec is not None and s.spec.lookup:
        s.index = NgramIndex(s.seq)
    s.reuse = Reuse(getattr(req, "scope", ""),
                    suffixes if s.spec is not None and s.spec.suffix else None, suffix_key)
    s.ask_next_mask(models.vocab_size)  # fills while the prompt is prefilled
    return s


def _check_request(models: Models, prompt: Sequence[TokenId], max_tokens: int,
                   params: SamplingParams) -> None:
    """Raise ValueError for what no request may ask (`new_state`)."""
    if not prompt:
        raise ValueError("prompt must contain at least one token")
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: must be >= 1")
    if not params.greedy and params.seed is None:
        raise ValueError("sampling (temperature > 0) needs a seed")
    if models.draft is not None and models.draft_vocab_size > models.vocab_size:
        raise ValueError(f"draft vocabulary {models.draft_vocab_size} exceeds the target's "
                         f"{models.vocab_size}")


def _fit_speculation(models: Models, s: DecodeState, horizon: int) -> None:
    """Give a speculative request its draft cache. Speculation needs caches that drop
    rejected proposals exactly; where one cannot, the request decodes plainly (or without
    the draft model), and says why (`SpecStats.spec_off`)."""
    stats = s.stats
    why = ragged.untrimmable(s.t_cache, horizon)
    if why is not None:
        stats.spec_off = f"plain decoding: target {why}"
        s.spec = None
    elif models.draft is not None:
        s.d_cache = ragged.make_cache(models.draft, horizon)
        why = ragged.untrimmable(s.d_cache, horizon)
        if why is not None:
            stats.spec_off = f"no draft model: draft {why}"
            s.d_cache = []
    if stats.spec_off:
        level = logging.DEBUG if stats.spec_off in _SAID else logging.WARNING
        _SAID.add(stats.spec_off)
        log.log(level, "speculation limited: %s (said once per reason)", stats.spec_off)


def prefill(models: Models, s: DecodeState, kv_store: PromptKVCache | None = None) -> None:
    """Prefill a state's whole prompt now (reusing a stored prompt state when there is one)."""
    if s.to_prefill == 0:
        return
    t0 = time.perf_counter()
    head = list(s.prompt[:-1])
    if kv_store is not None and kv_store.has(models.target, head, s.reuse.scope):
        s.stats.prompt_cached = len(head)
    for model, cache in ((models.target, s.t_cache), (models.draft, s.d_cache)):
        if cache and kv_store is not None:
            kv_store.prefill(model, head, cache, s.reuse.scope)
        elif cache:
            prefill_tokens(model, head, cache)
    mx.eval([c.state for c in s.t_cache + s.d_cache])
    s.to_prefill = 0
    s.stats.prefill_s += time.perf_counter() - t0


def prefill_arrivals(models: Models, states: Sequence[DecodeState],
                     budget: int = PREFILL_CHUNK, kv_store: PromptKVCache | None = None
                     ) -> None:
    """Advance arriving requests' prefill, in order: an arrival first loads the longest
    stored target state its prompt starts with (`PromptKVCache.restore_prefix`: the whole
    prompt, or a shared system prompt or earlier turns; the draft's cache is brought to the
    same position, from the store or prefilled at once: a draft is the cheap part); the
    rest takes chunks until `budget` tokens in all, prefilled in one ragged target forward
    (so running requests stall for at most `budget` tokens per round)."""
    todo: list[tuple[DecodeState, list[TokenId]]] = []
    used = 0
    for s in states:
        if s.to_prefill == 0:
            continue
        head = list(s.prompt[:-1])
        at = len(head) - s.to_prefill
        if at == 0 and kv_store is not None:
            t0 = time.perf_counter()
            at = _restore_prefix(models, s, head, kv_store)
            s.stats.prompt_cached = at
            s.to_prefill = len(head) - at
            s.stats.prefill_s += time.perf_counter() - t0
            if s.to_prefill == 0:
                continue
        n = min(s.to_prefill, budget - used)
        if n <= 0:
            break
        todo.append((s, head[at:at + n]))
        used += n
    if not todo:
        return
    t0 = time.perf_counter()
    ragged.forward(models.target, [(part, s.t_cache) for s, part in todo], rows=[0] * len(todo))
    for s, part in todo:
        if s.d_cache:
            models.draft(mx.array([part], dtype=mx.int32), cache=s.d_cache)
    mx.eval([c.state for s, _ in todo for c in s.t_cache + s.d_cache])
    spent = (time.perf_counter() - t0) / len(todo)
    for s, part in todo:
        s.to_prefill -= len(part)
        s.stats.prefill_s += spent
        if s.to_prefill == 0 and kv_store is not None:
            head = list(s.prompt[:-1])
            kv_store.store(models.target, head, s.t_cache, s.reuse.scope)
            if s.d_cache:
                kv_store.store(models.draft, head, s.d_cache, s.reuse.scope)


def keep_answer(models: Models, s: DecodeState, kv_store: PromptKVCache
                ) -> tuple[tuple[str, tuple[TokenId, ...]], ...]:
    """Keep a finished request's KV state, prompt and answer (the positions its caches
    hold: `seq`'s first ones), in the prompt store, target and draft: a conversation's next
    turn sends them back (the answer as its template renders it in the history) and
    restores them rather than computing them again (`PromptKVCache.restore_prefix`, up to
    where the rendered history and the generated tokens part). Only caches of plain
    per-position keys and values (`ragged.exact_prefix`), which restore any prefix of it;
    the state of the prompt alone, stored at its prefill, is then dropped (a prefix of
    this one). Returns what it stored: ("target" or "draft", key) each."""
    kept = []
    for role, model, cache in (("target", models.target, s.t_cache),
                               ("draft", models.draft, s.d_cache)):
        if not cache or not ragged.exact_prefix(cache):
            continue
        n = min(int(cache[0].offset), len(s.seq))
        if n < len(s.prompt):
            continue  # nothing past the prompt's own state
        for c in cache:  # rows past the output (a last round's unaccepted proposals) go
            if c.offset > n:
                c.trim(c.offset - n)
        kv_store.store(model, s.seq[:n], cache, s.reuse.scope)
        kv_store.drop(model, s.prompt[:-1], s.reuse.scope)
        kept.append((role, tuple(s.seq[:n])))
    return tuple(kept)


def _restore_prefix(models: Models, s: DecodeState, head: list[TokenId],
                    kv_store: PromptKVCache) -> int:
    """Load the longest stored target state `head` starts with, and bring the draft's cache
    to the same position; returns that position (0: nothing stored, caches untouched)."""
    at = kv_store.restore_prefix(models.target, head, s.t_cache,
                                 trims=ragged.exact_prefix(s.t_cache), scope=s.reuse.scope)
    if at and s.d_cache:
        d_at = kv_store.restore_prefix(models.draft, head[:at], s.d_cache,
                                       trims=ragged.exact_prefix(s.d_cache), scope=s.reuse.scope)
        s.stats.draft_cached = d_at
        if d_at < at:
            prefill_tokens(models.draft, head[d_at:at], s.d_cache)
            if at == len(head):  # a whole prompt: stored for the next one as the target's is
                kv_store.store(models.draft, head, s.d_cache, s.reuse.scope)
        mx.eval([c.state for c in s.d_cache])
    return at


@dataclass(frozen=True)
class MaskVerdicts:
    """What the grammar budget says before a round (`mask_decisions`): the requests that sit
    it out, those that decode plainly from now on, and those stopped (with their errors)."""

    idle: tuple[DecodeState, ...] = ()
    plain: tuple[DecodeState, ...] = ()
    over: tuple[tuple[DecodeState, GrammarTooComplex], ...] = ()


def mask_decisions(budget: MaskBudget, states: Sequence[DecodeState]) -> MaskVerdicts:
    """Apply the grammar budget to the ready requests of the next round: wait (at most
    `budget.slow_s`, for fills that started less than that ago) for their next masks; a
    request whose mask is still filling sits the round out, one whose slowest fill since the
    last call took over `slow_s` decodes plainly, one over `mask_s` or `total_s` is stopped.
    Time-dependent: a sharded target's rank 0 decides and the others apply (`Decisions`)."""
    now = time.perf_counter()
    pending = [(s.grammar.next_mask, s.grammar.started) for s in states
               if s.grammar is not None and s.grammar.next_mask is not None]
    young = [(f, t) for f, t in pending if not f.done() and now - t < budget.slow_s]
    if young:
        wait_futures([f for f, _ in young],
                     timeout=budget.slow_s - min(now - t for _, t in young))
    now = time.perf_counter()
    idle, plain, over = [], [], []
    for s in states:
        f = s.grammar.next_mask if s.grammar is not None else None
        if s.grammar is not None and f is not None and not f.done():
            if now - s.grammar.started > budget.mask_s:
                over.append((s, GrammarTooComplex(f"one mask took over {budget.mask_s:g}s",
                                                  position=s.emitted)))
            else:
                idle.append(s)
            continue
        done = f.result().seconds if f is not None else 0.0
        worst, total = max(s.stats.mask_max_s, done), s.stats.mask_s + done
        s.stats.mask_max_s = 0.0
        if worst > budget.mask_s:
            over.append((s, GrammarTooComplex(f"one mask took {worst:.2f}s (at most "
                                              f"{budget.mask_s:g}s)", position=s.emitted)))
        elif total > budget.total_s:
            over.append((s, GrammarTooComplex(f"its grammar work took {total:.1f}s in all (at "
                                              f"most {budget.total_s:g}s)",
                                              position=s.emitted)))
        elif worst > budget.slow_s and s.grammar is not None and not s.grammar.slow:
            plain.append(s)
    return MaskVerdicts(tuple(idle), tuple(plain), tuple(over))


def decode_plainly(s: DecodeState, why: str) -> None:
    """From now on the request proposes nothing (its output does not change: plain decoding
    emits what speculation does); its draft cache is dropped."""
    if s.spec is not None:
        s.spec, s.index, s.d_cache = None, None, []
        s.stats.spec_off = why
    if s.grammar is not None:
        s.grammar.slow = True


def run_round(models: Models, states: Sequence[DecodeState],
              min_score: float | None = None) -> None:
    """One round over every ready state (see the module docstring). A request's grammar
    error ends that request only (`state.error`); the others carry on. `min_score`: the
    round's token-tree branch threshold where a spec leaves it open (None: priced now,
    `models.trees`; the scheduler passes it, so a sharded target's ranks use rank 0's)."""
    for s in states:
        s.new_tokens = []  # what this round emits (nothing for a finished request)
        s.reported.next_round()
    live = [s for s in states if s.ready]
    # 0. Each request's mask at its current state, filled between rounds (`MaskBudget`).
    rows: dict[int, np.ndarray] = {}
    for s in live:
        m = s.grammar.take_next_mask(s.stats) if s.grammar is not None else None
        if m is not None and m.error is not None:
            s.error = m.error
        elif m is not None:
            rows[id(s)] = m.row
    live = [s for s in live if s.error is None]
    if not live:
        return
    for s in live:
        s.stats.rounds += s.spec is not None
        s.stats.round_mask_s = 0.0
    in_round = models.masks.slow_s if models.masks.in_round else None
    t_round = time.perf_counter()
    # 1. Propose: every request's proposers in lock-step, one batched draft forward per step.
    if min_score is None:
        min_score = models.trees.threshold() if models.trees is not None else TREE_MIN_SCORE
    proposed, draft_forwards = _propose_all(models, live, rows, in_round, min_score)
    if any(s.error is not None for s in live):  # a request's proposer failed: it leaves
        keep = [i for i, s in enumerate(live) if s.error is None]
        live, proposed = [live[i] for i in keep], [proposed[i] for i in keep]
        if not live:
            return
    props = [list(p.tokens) for p in proposed]
    trees = [p.parents for p in proposed]
    # 2. Verify forward, queued; the host fills the mask rows meanwhile.
    t0 = time.perf_counter()
    segments = [([s.seq[-1], *p], s.t_cache) for s, p in zip(live, props)]
    widths = [len(p) for p in props]  # what each target cache is advanced by, cuts or not
    # A tree's rows: the last token, then each proposal under its parent's row.
    row_trees = [None if t is None else [-1, *(q + 1 for q in t)] for t in trees]
    logits = ragged.forward(models.target, segments, trees=row_trees)  # each (m_i+1, V)
    mx.async_eval([x for x in logits if x is not None])
    masks: list[np.ndarray | None] = []
    oks: list[list[bool] | None] = [None] * len(live)
    for i, s in enumerate(live):
        masks.append(None)
        if s.grammar is None:
            continue
        try:
            with GrammarClock(s.stats):  # (the copies' consumes count with the fills)
                if trees[i] is not None:
                    bitmask, oks[i], cuts = tree_masks(s.grammar.state, props[i], trees[i],
                                                       s.eos, models.vocab_size, s.emitted,
                                                       rows.get(id(s)), s.stats, in_round)
                    s.stats.grammar_cuts += cuts > 0
                    masks[i] = bitmask
                    continue
                bitmask, n_ok = verify_masks(s.grammar.state, props[i], s.eos,
                                             models.vocab_size, s.emitted, rows.get(id(s)),
                                             s.stats, in_round)
        except (GrammarStateError, GrammarRefused) as e:
            s.error = e
            continue
        if n_ok < len(props[i]):
            # a cut where the grammar forbade a proposal; fewer verified for the round's
            # budget (`over_round_budget`: every proposal kept was allowed) is not one
            s.stats.grammar_cuts += not mask_allows(bitmask[n_ok], props[i][n_ok])
            props[i] = props[i][:n_ok]
            proposed[i] = proposed[i]._replace(tokens=props[i],
                                               sources=proposed[i].sources[:n_ok])
            bitmask = bitmask[:n_ok + 1]
        masks[i] = bitmask
    # 3. Pick: every request's rows under its own mask, parameters and noise; one sync.
    picks: list[mx.array | None] = []
    lps: dict[int, tuple[mx.array, ...]] = {}
    allowed: dict[int, list[int]] = {}  # each verify row's allowed-set size, where asked
    rows_of: dict[int, RowScores] = {}
    for i, s in enumerate(live):
        if s.error is not None:
            picks.append(None)
            continue
        x = logits[i][:len(props[i]) + 1]
        if s.bias is not None:  # before the mask: a bias never lets a banned token out
            x = x + s.bias
        if masks[i] is not None:
            x = apply_mask(x, unpack_bitmask(mx.array(masks[i]), models.vocab_size))
            if s.reported.sources is not None:
                allowed[i] = allowed_counts(masks[i], models.vocab_size)
        noise = None
        if not s.params.greedy:  # each row's noise is its output position's
            depths = (range(len(props[i]) + 1) if row_trees[i] is None
                      else ragged.depths(row_trees[i]).tolist())
            noise = mx.array(np.stack([position_noise(s.params.seed or 0, s.emitted + d,
                                                      models.vocab_size)
                                       for d in depths]))
        picks.append(pick(x, s.params, noise))
        if s.logprobs is not None:
            lps[i] = _logprobs(x, picks[-1], s.params, s.logprobs)
        rule = s.grammar.rule if s.grammar is not None else None
        if rule is not None and rule.active(s.emitted + len(props[i])):
            rows_of[i] = RowScores(x, s.params, noise)
    tw = time.perf_counter()
    mx.eval([p for p in picks if p is not None], list(lps.values()))
    wait = time.perf_counter() - tw
    verify_s = time.perf_counter() - t0
    # 4. Accept and trim, per request.
    hits = sum(s.stats.branched_accepted for s in live)
    for i, s in enumerate(live):
        s.stats.wait_s += wait
        s.stats.verify_s += verify_s
        s.stats.steps += 1
        if s.error is None:
            try:
                # consuming the output and the budget rule's walks: grammar work (the rule's
                # `Spend` counts its own fills)
                with GrammarClock(s.stats if s.grammar is not None else None):
                    _accept(s, proposed[i], Verdict(picks[i].tolist(), widths[i], oks[i],
                                                    lps.get(i), rows_of.get(i), allowed.get(i)),
                            models.masks)
            except Exception as e:  # this request's fault, not the round's
                log.exception("accepting a request's tokens failed")
                s.error = InternalError(f"accepting the round's tokens failed: {e}")
        s.ask_next_mask(models.vocab_size)  # fills while the others' rounds go on
    if models.trees is not None:
        models.trees.observe(time.perf_counter() - t_round, sum(w + 1 for w in widths),
                             sum(len(p.tokens) - p.chain for p in proposed
                                 if p.parents is not None), draft_forwards,
                             sum(len(s.new_tokens) for s in live),
                             sum(p.score for p in proposed),
                             sum(s.stats.branched_accepted for s in live) - hits)


def _logsumexp(x: mx.array, block: int = 256) -> mx.array:
    """log(sum(exp(x))) over the last axis, keepdims: summed in blocks of `block` and then
    over the blocks, so a float32 sum over a whole vocabulary keeps its small terms (one
    flat float32 reduction on the CPU was measured 1.5e-4 off on a 49k row)."""
    m = mx.max(x, axis=-1, keepdims=True)
    e = mx.exp(x - m)  # (rows, V); masked -inf entries are 0
    pad = -e.shape[-1] % block
    if pad:
        e = mx.concatenate([e, mx.zeros((*e.shape[:-1], pad), e.dtype)], axis=-1)
    total = e.reshape(*e.shape[:-1], -1, block).sum(axis=-1).sum(axis=-1, keepdims=True)
    return m + mx.log(total)


def _logprobs(x: mx.array, picks: mx.array, params: SamplingParams, n: int
              ) -> tuple[mx.array, ...]:
    """Rows' log-probabilities of their picks, and their top-n (ids, values), from masked
    logits x (rows, V): log_softmax(x / T) with T the temperature (1 when greedy)."""
    t = 1.0 if params.greedy else params.temperature
    lp = x / mx.array(t, dtype=mx.float32)
    lp = lp - _logsumexp(lp)
    chosen = mx.take_along_axis(lp, picks[:, None].astype(mx.int32), axis=-1)[:, 0]
    if n <= 0:
        return (chosen,)
    ids = mx.argpartition(-lp, n - 1, axis=-1)[:, :n]
    vals = mx.take_along_axis(lp, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return (chosen, mx.take_along_axis(ids, order, axis=-1),
            mx.take_along_axis(vals, order, axis=-1))


def _propose_all(models: Models, live: Sequence[DecodeState],
                 rows: dict[int, np.ndarray] | None = None, budget_s: float | None = None,
                 min_score: float = TREE_MIN_SCORE) -> tuple[list[Proposals], int]:
    """Run every request's `speculative.Proposer` side by side (`_lockstep`). Returns each
    request's `Proposals` (a request whose proposer raised proposes nothing and gets its
    `error`) and how many draft forwards ran. `rows`: each request's mask at its current
    state (by `id` of its state), where filled already.

    Token trees (`SpecConfig.tree`) need the target's batched layout; a round's requests
    share them out: n proposing requests get tree // n branch tokens each, so verify rows
    stay few as the batch grows, and none when the draft model is left out (the batch is
    past `draft_max_batch`). `min_score`: the round's branch threshold where a spec leaves it
    open (`TreeCosts.threshold`; over 1: those requests propose chains)."""
    rows = rows or {}
    t0 = time.perf_counter()
    proposing = [s for s in live if s.spec is not None and s.max_tokens - s.emitted > 1]
    with_draft = models.draft_max_batch is None or \
        sum(bool(s.d_cache) for s in proposing) <= models.draft_max_batch
    trees_ok = with_draft and ragged.supports(models.target)
    gens: dict[int, Generator[Ask, object, Proposals]] = {}
    for i, s in enumerate(live):
        if s.spec is None or s.max_tokens - s.emitted <= 1:
            continue
        tree = s.spec.tree // len(proposing) if trees_ok and (
            s.spec.tree_min_score is not None or min_score <= 1.0) else 0
        # Batched, no forced/looked-up run-on past k (`RoundBounds.run_on`).
        bounds = RoundBounds(s.max_tokens - s.emitted - 1, run_on=len(live) == 1, tree=tree,
                             min_score=min_score, row0=rows.get(id(s)), budget_s=budget_s)
        with GrammarClock(s.stats if s.grammar is not None else None):  # (its clone)
            gens[i] = Proposer(_request_view(models, s), _draft_side(models, s, with_draft),
                               bounds).steps()
    out, forwards = _lockstep(models, live, gens)
    spent = (time.perf_counter() - t0) / max(1, sum(s.spec is not None for s in live))
    for s, p in zip(live, out):
        if s.spec is not None:
            s.stats.draft_s += spent
            s.stats.proposed += len(p.tokens)
    return out, forwards


def _request_view(models: Models, s: DecodeState) -> RequestView:
    """A proposing request as its proposer reads it (its prompt-lookup index brought up to
    date first)."""
    assert s.spec is not None
    if s.index is not None:
        s.index.extend(s.seq[len(s.index.tokens):])
    earlier = s.reuse.suffixes.indexes(s.reuse.key) if s.reuse.suffixes is not None else ()
    return RequestView(s.seq, s.emitted, s.eos, s.params, s.spec, s.stats, models.vocab_size,
                       s.grammar.state if s.grammar is not None else None, s.index, earlier)


def _draft_side(models: Models, s: DecodeState, with_draft: bool) -> DraftSide:
    """The draft model as `s`'s proposer sees it this round. Left out (`with_draft` False),
    the draft cache catches up with the next draft forward (it feeds what the cache lacks)."""
    if s.d_cache and not with_draft:
        s.stats.draft_load_skips += 1
    draft = models.draft if s.d_cache and with_draft else None
    return DraftSide(draft, s.d_cache,
                     models.draft_vocab_size if draft is not None else models.vocab_size,
                     getattr(models.draft, "space", None))


def _lockstep(models: Models, live: Sequence[DecodeState],
              gens: dict[int, Generator[Ask, object, Proposals]]
              ) -> tuple[list[Proposals], int]:
    """Drive proposers (`gens`, by index into `live`) in lock-step: the draft forwards they
    ask for at the same step run as one ragged forward, and the arrays they ask evaluated
    are evaluated with one sync per step. Returns each one's `Proposals` (empty for a
    request without one) and how many draft forwards ran."""
    out: list[Proposals] = [Proposals([], [])] * len(live)
    asks: dict[int, Ask | None] = {i: None for i in gens}  # (None: not yet started)
    replies: dict[int, object] = {i: None for i in gens}
    forwards = 0
    while gens:
        for i in list(gens):
            try:  # (a proposer's clone, draft masks and forced tokens: grammar work)
                with GrammarClock(live[i].stats if live[i].grammar is not None else None):
                    asks[i] = gens[i].send(replies[i])
            except StopIteration as done:
                out[i] = done.value
                del gens[i]
            except Exception as e:  # this request's fault, not the round's
                log.exception("a request's proposer failed")
                live[i].error = InternalError(f"proposing tokens failed: {e}")
                del gens[i]
        replies = {i: None for i in gens}
        fwd = {i: a.tokens for i in gens if isinstance(a := asks[i], Forward)}
        if fwd:
            forwards += 1
            logits = ragged.forward(models.draft, [(t, live[i].d_cache)
                                                   for i, t in fwd.items()],
                                    rows=[1] * len(fwd), mapped=False)
            own = getattr(models.draft, "own_logits", None)  # a pruned-vocabulary draft
            for i, x in zip(fwd, logits):
                replies[i] = x[-1] if own is None else own(x[-1])
        evals = [x for i in gens if isinstance(a := asks[i], Evaluate) for x in a.arrays]
        if evals:
            mx.eval(evals)
    return out, forwards


@dataclass(frozen=True)
class RowScores:
    """A request's verify rows as the decision rule scored them (masked logits `x`, its
    sampling and the rows' noise), for the budget rule's candidates (`budget.BudgetRule`)."""

    x: mx.array
    params: SamplingParams
    noise: mx.array | None

    def ranked(self, row: int) -> list[TokenId]:
        """Row `row`'s best-scoring tokens (`budget.ranked_ids`)."""
        noise = None if self.noise is None else self.noise[row:row + 1]
        scores = pick_scores(self.x[row:row + 1], self.params, noise)
        return ranked_ids(np.array(scores[0].astype(mx.float32)))

    def logprob(self, row: int, token: TokenId) -> float:
        """`token`'s logprob at row `row` (`_logprobs`)."""
        (lp,) = _logprobs(self.x[row:row + 1], mx.array([token]), self.params, 0)
        return float(lp[0].item())


@dataclass(frozen=True)
class Verdict:
    """What the target made of one request's proposals in a round.

    Attributes:
        picks: its pick at every verify row.
        width: how many proposals its cache was advanced by (every one, cuts included).
        ok: of a tree, which proposals may be accepted (`tree_masks`); None: all.
        lps: the rows' logprobs (`_logprobs`), where the request asked for them.
        scores: the rows' scores, where the budget rule may change a pick this round.
        allowed: each row's allowed-set size under its grammar mask, where the request asks
            for its tokens' sources (None: not asked, or unconstrained).
    """

    picks: list[int]
    width: int
    ok: list[bool] | None = None
    lps: tuple[mx.array, ...] | None = None
    scores: RowScores | None = None
    allowed: list[int] | None = None


def _accept(s: DecodeState, p: Proposals, v: Verdict, masks: MaskBudget = MaskBudget()
            ) -> None:
    """Emit the agreeing prefix of the proposals `p` (of a tree: the accepted branch,
    `tree_path`) and the bonus pick; count the accepted by source; trim the caches (the
    target's was advanced by `v.width` proposals; a tree's accepted branch is first moved
    together, `ragged.keep_rows`). The budget rule's grammar work counts in the request's
    grammar budget `masks` (past it, the request stops with `GrammarTooComplex`)."""
    props, picks = p.tokens, v.picks
    if p.parents is None:
        path = []
        for j, pk in enumerate(picks[:len(props)]):
            if pk != props[j]:
                break
            path.append(j)
    else:
        path = tree_path(props, p.parents, v.ok if v.ok is not None else [True] * len(props),
                         picks)
    rows = [0, *(j + 1 for j in path)]  # the verify row each emitted token is picked at
    out = [props[j] for j in path] + [int(picks[rows[-1]])]
    steered: dict[int, float] = {}  # emitted index -> its logprob, where the budget steered
    if v.scores is not None:
        t0 = time.perf_counter()
        # (a sharded target's ranks use no clock here: rank 0's decisions stop the request)
        spend = (Spend(t0 + max(0.0, masks.total_s - s.stats.mask_s), masks.mask_s)
                 if masks.in_round else Spend())
        try:
            with spending(spend):
                at = _steer(s, out, rows, v.scores)
        except Overspent as e:
            s.error = GrammarTooComplex(e.reason, position=s.emitted)
            return
        finally:
            took = time.perf_counter() - t0
            s.stats.budget_s += took
            s.stats.mask_s += took  # the rule's fills are the request's grammar work
            s.stats.mask_max_s = max(s.stats.mask_max_s, spend.slowest)
        if at is not None:
            k, t = at
            rule = s.grammar.rule if s.grammar is not None else None
            s.stats.budget_steered = rule.steered if rule is not None else 0
            path, rows, out = path[:k], rows[:k + 1], out[:k] + [t]
            if v.lps is not None:
                steered[k] = v.scores.logprob(rows[k], t)
    accepted = len(path)  # the last one emitted is the target's own (bonus) pick
    s.stats.accepted += accepted
    n_chain = len(props) if p.parents is None else p.chain
    sources = None
    if s.reported.sources is not None:  # (`events.SOURCES`)
        picked = ["branch" if j >= n_chain else p.sources[j].value for j in path]
        picked.append("budget" if steered else "target")
        allowed = [None if v.allowed is None else v.allowed[r] for r in rows]
        sources = [TokenSource("forced" if a == 1 and src != "budget" else src, a)
                   for src, a in zip(picked, allowed)]
    on_chain = next((k for k, j in enumerate(path) if j != k or j >= n_chain), accepted)
    for j in path:
        s.stats.accept(p.sources[j], branch=j >= n_chain)
    base = len(s.seq)
    _emit(s, out, rows, v.lps, steered, sources)
    # Target cache holds old seq[:-1] + [last] + props; keep up to the new seq[:-1] (also
    # where the request just ended: its caches may be kept for a next turn, `keep_answer`).
    if p.parents is not None:  # (nothing moves when the branch is where a sequence would be)
        ragged.keep_rows(s.t_cache, s.t_cache[0].offset - v.width, path)
    trim_cache(s.t_cache, v.width - accepted)
    # Draft cache holds a prefix of old seq + props[:fed] (the chain's); keep what agrees.
    if s.d_cache:
        d_len = s.d_cache[0].offset
        keep = min(d_len, base + min(p.fed, on_chain, n_chain))
        trim_cache(s.d_cache, d_len - keep)


def _steer(s: DecodeState, out: list[TokenId], rows: list[int], scores: RowScores
           ) -> tuple[int, TokenId] | None:
    """The first of the round's emitted tokens `out` the budget rule changes (its index and
    the token it takes instead), or None (`budget.BudgetRule.decide`, on a matcher copy)."""
    assert s.grammar is not None and s.grammar.rule is not None
    rule = s.grammar.rule
    m, at = s.grammar.clone(), rule.place
    for k, t in enumerate(out):
        n = s.emitted + k
        if n >= s.max_tokens:
            break
        if rule.active(n):
            row = rows[k]
            got = rule.decide(m, n, t, lambda: scores.ranked(row), at)
            if got != t:
                return k, got
        if t in s.eos or not m.consume_token(t) or m.is_error() or m.is_stopped():
            break
        at = rule.advance(t, at, m)
    return None


def _emit(s: DecodeState, out: list[TokenId], rows: list[int],
          lps: tuple[mx.array, ...] | None, steered: dict[int, float] | None = None,
          sources: list[TokenSource] | None = None) -> int | None:
    """Emit `out` (each picked at verify row `rows[n]`), consumed by the matcher, until the
    request ends; returns how many were emitted, None when it ended (finished or failed).
    `steered`: the logprobs of tokens the budget rule put in place of the pick (by index).
    A request the budget steered ends "length" (the budget forced its close). `sources`:
    each token's source, where the request asks for them."""
    n_emit = 0
    for t in out:
        if s.grammar is not None:
            try:
                s.grammar.consume(t, s.emitted)
            except (GrammarStateError, GrammarRefused) as e:
                s.error = e
                return None
        if t in s.eos:
            s.finish = _stopped(s)
            return None
        s.seq.append(t)
        s.new_tokens.append(t)
        if s.grammar is not None:
            s.grammar.advance_rule(t)
        if lps is not None:
            j = rows[n_emit]
            top = () if len(lps) == 1 else tuple(
                (int(a), float(b)) for a, b in zip(lps[1][j].tolist(), lps[2][j].tolist())
                if b != -np.inf)
            lp = (steered or {}).get(n_emit)
            s.reported.logprobs.append(TokenLogprob(t, float(lps[0][j].item()) if lp is None
                                               else lp, top))
        if sources is not None:
            assert s.reported.sources is not None
            s.reported.sources.append(sources[n_emit])
        n_emit += 1
        s.emitted += 1
        if s.grammar is not None and s.grammar.stopped():
            s.finish = _stopped(s)
            return None
        if s.emitted >= s.max_tokens:
            s.finish = "length"
            return None
    return n_emit


def allowed_counts(bitmask: np.ndarray, vocab_size: int) -> list[int]:
    """Each row's allowed-set size: the set bits of a packed (rows, words) int32 mask among
    the first `vocab_size` ids."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=-1,
                         bitorder="little")
    return bits[:, :vocab_size].sum(axis=-1).tolist()


def _stopped(s: DecodeState) -> DecodeFinish:
    """How a request that ended on its own finishes: "stop", or "length" where the budget
    rule steered it to close."""
    return "length" if s.stats.budget_steered else "stop"
