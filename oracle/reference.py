"""One token per target forward, everything after the logits done in numpy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import llguidance.numpy as llnp
import mlx.core as mx
import numpy as np
from llguidance import LLMatcher
from mlx_lm.models.cache import make_prompt_cache

from .closing import BudgetOracle
from .sampler import decision_scores, gumbel, log_probs, top_logprobs, unpack_mask
from .unique import UniqueOracle

SPOT_CHECKS = 6  # tokens per step whose mask bit is re-derived with validate_tokens
# How far below the n-th logprob the oracle still lists tokens (`OracleStep.near_cut`), for
# a comparison to find a server's near-tie at the cut: above `compare.SHAPE_TOL`.
NEAR_TIE = 1e-4


class OracleError(AssertionError):
    """The reference found an inconsistency (mask bit vs validate_tokens, forced EOS missing)."""


@dataclass(frozen=True)
class ThinkingRule:
    """A thinking budget as the contract states it: from `budget` tokens after the think
    block opened (`opened(output tokens)`: how many leading tokens opened it, None while it
    has not), unless `ended(output tokens)` (the end marker is complete), the end marker's
    tokens `close_ids` are the only ones allowed, one by one, starting at the first such
    position where the grammar allows the first of them."""

    budget: int
    close_ids: tuple[int, ...]
    ended: Callable[[Sequence[int]], bool]
    opened: Callable[[Sequence[int]], int | None] = lambda tokens: 0


@dataclass(frozen=True)
class OracleStep:
    """One decided position: the pick, the runner-up, and their score margin; with logprobs
    asked for, the pick's logprob, the top n (id, logprob) (value descending, then id), and
    the further tokens within `NEAR_TIE` of the n-th (`top_logprobs`); whether the budget's
    closing rule put the token in place of the decision rule's pick (`steered`)."""

    token: int
    runner_up: int
    margin: float
    allowed: int  # how many tokens the mask allowed
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    near_cut: tuple[tuple[int, float], ...] = ()
    steered: bool = False


@dataclass(frozen=True)
class OracleResult:
    tokens: tuple[int, ...]  # generated ids, EOS excluded
    finish_reason: str
    steps: tuple[OracleStep, ...]


def _logits_np(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32), dtype=np.float32, copy=True)


def reference_decode(model: Callable, prompt: Sequence[int], *, vocab_size: int,
                     eos_token_ids: Sequence[int], max_tokens: int,
                     matcher: LLMatcher | None = None, temperature: float = 0.0,
                     top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                     logit_bias: Sequence[tuple[int, float]] = (),
                     thinking: ThinkingRule | None = None,
                     logprobs: int | None = None, cache: list | None = None,
                     budget: BudgetOracle | None = None,
                     unique: UniqueOracle | None = None) -> OracleResult:
    """Decode like the contract says, one forward per token, checking masks as it goes.

    Args:
        model: mlx-lm model called as a black box: `model(ids (1, T), cache) -> (1, T, V)`.
        prompt: prompt token ids.
        vocab_size: logits width.
        eos_token_ids: ids that end the output.
        max_tokens: most tokens to generate.
        matcher: a fresh llguidance matcher for the request's grammar (advanced here).
        temperature, top_k, top_p, seed: the documented decision rule's parameters.
        logit_bias: (token id, value) added to the logits before the grammar mask.
        thinking: the thinking budget: while thinking, from output position `budget` on,
            only the end marker's next token is allowed.
        logprobs: None, or each step's logprob and top `logprobs` alternatives, computed
            here from the masked, biased logits (`sampler.log_probs`).
        cache: an mlx-lm prompt cache already holding a proper prefix of the prompt (its
            `offset` tokens), advanced here (pass a copy to reuse it); None: a fresh one.
        budget: the token-budget rule (`closing.BudgetOracle`, its `max_tokens` this one's):
            near the end, the pick is the first token whose closing walk fits; a request
            it steered finishes "length".
    Returns:
        Tokens, finish reason ("stop" / "length") and per-step margins (and logprobs).
    Raises:
        OracleError: llguidance's mask and its own validate_tokens disagree, or the grammar
            completed and the mask did not force EOS.
    """
    eos = set(int(e) for e in eos_token_ids)
    done = 0
    if cache is None:
        cache = make_prompt_cache(model)
    else:
        done = cache[0].offset
        assert done < len(prompt), "the cache must leave the prompt's last token to feed"
    out = model(mx.array([list(prompt[done:])], dtype=mx.int32), cache=cache)
    logits = _logits_np(out[0, -1])
    rng = np.random.default_rng(12345)  # only chooses which tokens to spot-check
    bitmask = llnp.allocate_token_bitmask(1, vocab_size)
    tokens: list[int] = []
    steps: list[OracleStep] = []
    finish = "length"
    bias = np.zeros(vocab_size, dtype=np.float32)
    for t, v in logit_bias:
        if t < vocab_size:
            bias[t] += np.float32(v)
    forced = 0  # end-marker tokens the thinking budget has forced
    if unique is not None and (budget is not None or thinking is not None):
        raise ValueError("the oracle's uniqueItems rule runs without a budget or thinking")
    if budget is not None and matcher is not None:
        budget.thinking = thinking
        budget.start(matcher)
    for i in range(max_tokens):
        forced_before = forced
        x = logits.copy()
        if len(logit_bias):
            x = x + bias
        if matcher is not None:
            llnp.fill_next_token_bitmask(matcher, bitmask, 0)
            if matcher.is_error():
                raise OracleError(f"matcher error: {matcher.get_error()}")
            allowed = unpack_mask(bitmask[0], vocab_size)
            start = thinking.opened(tokens) if thinking is not None else None
            if start is not None and i - start >= thinking.budget and \
                    not thinking.ended(tokens) and forced < len(thinking.close_ids):
                only = thinking.close_ids[forced]
                if allowed[only]:
                    allowed = np.zeros_like(allowed)
                    allowed[only] = True
                    forced += 1
                elif forced:
                    raise OracleError(f"step {i}: the grammar bans the end marker's "
                                      f"token {only} the budget forces")
                # else: not here (mid-character, say); the marker starts where allowed
            _spot_check(matcher, allowed, x, rng, eos)
            x[~allowed] = -np.inf
        noise = None if temperature == 0.0 else gumbel(seed, i, vocab_size)
        scores = decision_scores(x, temperature=temperature, top_k=top_k, top_p=top_p,
                                 noise=noise)
        if unique is not None and matcher is not None:
            if top_k or top_p < 1.0 or logprobs is not None:  # the whole mask
                for t in np.flatnonzero(np.isfinite(x)).tolist():
                    if unique.refuses(matcher, t):
                        x[t] = -np.inf
                scores = decision_scores(x, temperature=temperature, top_k=top_k,
                                         top_p=top_p, noise=noise)
            else:  # the best two it takes
                kept = 0
                for t in np.argsort(-scores, kind="stable").tolist():
                    if kept == 2 or not np.isfinite(scores[t]):
                        break
                    if unique.refuses(matcher, t):
                        x[t] = scores[t] = -np.inf
                    else:
                        kept += 1
                if not kept:
                    raise OracleError(f"step {i}: the uniqueItems rule leaves no token")
        tok = picked = int(np.argmax(scores))
        if budget is not None and matcher is not None:
            tok = budget.choose(matcher, i, tok, scores, forced_before, forced)
        order = np.argsort(-scores, kind="stable")[:2]
        runner = int(order[1]) if order[0] == tok else int(order[0])
        lp_fields: dict[str, object] = {}
        if logprobs is not None:
            lp = log_probs(x, temperature=temperature)
            top, near = top_logprobs(lp, logprobs, NEAR_TIE)
            lp_fields = dict(logprob=float(lp[tok]), top=top, near_cut=near)
        steps.append(OracleStep(tok, runner, float(scores[tok] - scores[runner]),
                                int(np.isfinite(x).sum()), **lp_fields,  # type: ignore
                                steered=tok != picked))
        if matcher is not None:
            was_stopped = matcher.is_stopped()
            if not matcher.consume_token(tok):
                raise OracleError(f"step {i}: matcher refused its own allowed token {tok}")
            if was_stopped and tok not in eos:
                raise OracleError(f"step {i}: grammar complete but {tok} was allowed")
        if unique is not None:
            unique.took(tok)
        if tok in eos:
            finish = "stop"
            break
        tokens.append(tok)
        if budget is not None:
            budget.took(tok)
        if matcher is not None and matcher.is_stopped() and i + 1 == max_tokens:
            finish = "stop"  # complete exactly at the limit: only EOS could have followed
            break
        if i + 1 < max_tokens:
            logits = _logits_np(model(mx.array([[tok]], dtype=mx.int32), cache=cache)[0, -1])
    if finish == "stop" and budget is not None and budget.steered:
        finish = "length"  # the budget forced the close
    return OracleResult(tuple(tokens), finish, tuple(steps))


def _spot_check(matcher: LLMatcher, allowed: np.ndarray, logits: np.ndarray,
                rng: np.random.Generator, eos: set[int]) -> None:
    """Re-derive soundness of a few set mask bits with validate_tokens (no state change).

    Only one direction holds: llguidance bans some grammatical but non-canonical tokens
    (e.g. `{` where `{"` is forced), so a banned token may still validate.
    """
    ok_ids = np.flatnonzero(allowed)
    if ok_ids.size == 0:
        raise OracleError("mask allows no token at all")
    top = [int(t) for t in np.argsort(-np.where(allowed, logits, -np.inf))[:2]]
    picks = top + [int(t) for t in rng.choice(ok_ids, size=min(SPOT_CHECKS - 2, ok_ids.size),
                                              replace=False)]
    for t in picks:
        if t in eos:  # validate_tokens does not judge EOS; the grammar must be complete
            if allowed[t] and not matcher.is_accepting():
                raise OracleError(f"mask allows EOS {t} before the grammar can end")
            continue
        if allowed[t] and matcher.validate_tokens([t]) != 1:
            raise OracleError(f"mask allows token {t} but validate_tokens rejects it")
