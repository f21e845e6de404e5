"""Token-tree sizing by what rows cost now (`speculative.TreeCosts`): the fit of round
seconds on verify rows, the price of a branch row against what a row's time buys, the
calibration of branch scores, and the core's rounds following the price (chains when rows
are dear, trees when they are cheap), output unchanged either way."""

from __future__ import annotations

import random

import pytest

from specdec.speculative import TREE_MIN_FLOOR, TREE_MIN_SCORE, SpecConfig, TreeCosts


def _feed(costs: TreeCosts, n: int, *, fixed=0.10, row=0.004, extra=0.0, draft=0.01,
          per_round=2, hit_rate=1.0, branchy=0.5, seed=0) -> None:
    """n rounds timed seconds = fixed + row * rows + extra * branch_rows + draft * draft
    forwards; a branch token scored s is accepted s * hit_rate of the time."""
    rng = random.Random(seed)
    for _ in range(n):
        chain = rng.randint(0, 8)
        drafts = rng.randint(0, chain)  # the rest forced or looked up
        branch = rng.randint(1, 6) if rng.random() < branchy else 0
        rows = 1 + chain + branch
        scored = 0.3 * branch
        costs.observe(fixed + row * rows + extra * branch + draft * drafts, rows, branch,
                      drafts, per_round, scored, round(scored * hit_rate * 4) / 4)


def test_until_rows_are_priced_the_threshold_is_the_fixed_one():
    costs = TreeCosts()
    assert costs.threshold() == TREE_MIN_SCORE
    _feed(costs, 3)
    assert costs.prices() is None and costs.threshold() == TREE_MIN_SCORE


def test_a_branch_row_is_priced_from_the_fit_against_the_seconds_a_token_costs():
    costs = TreeCosts(decay=1.0)
    _feed(costs, 400)
    row_s, token_s, kappa = costs.prices()
    assert row_s == pytest.approx(0.004, rel=1e-3)
    # The mean round here has 1 + 4 chain rows + 3.5 * 0.5 branch rows, 2 draft forwards.
    assert token_s == pytest.approx((0.10 + 0.004 * 6.75 + 0.01 * 2) / 2, rel=0.05)
    assert kappa == pytest.approx(1.0, abs=0.05)
    assert costs.threshold() == pytest.approx(0.004 / token_s, rel=0.03)


def test_dear_branch_rows_give_chains_and_cheap_rows_wide_trees():
    dear = TreeCosts(decay=1.0)
    _feed(dear, 400, extra=0.08, per_round=4)  # a branch row costs 20x a chain row
    assert dear.threshold() > 1.0
    cheap = TreeCosts(decay=1.0)
    _feed(cheap, 400, row=0.0001)  # a memory-bound forward: rows nearly free
    assert cheap.threshold() == pytest.approx(TREE_MIN_FLOOR, abs=0.01)
    # Under load (eight times the tokens a round for the same row price) it rises eightfold.
    alone, loaded = TreeCosts(decay=1.0), TreeCosts(decay=1.0)
    _feed(alone, 400)
    _feed(loaded, 400, per_round=16)
    assert loaded.threshold() == pytest.approx(8 * alone.threshold(), rel=0.05)


def test_overconfident_scores_raise_the_threshold_by_their_measured_ratio():
    honest, bold = TreeCosts(decay=1.0), TreeCosts(decay=1.0)
    _feed(honest, 400)
    _feed(bold, 400, hit_rate=0.25)  # a quarter of the score's worth is accepted
    assert bold.prices()[2] == pytest.approx(0.25, abs=0.03)
    assert bold.threshold() == pytest.approx(4 * honest.threshold(), rel=0.15)


def test_the_price_follows_the_machine_as_it_changes():
    costs = TreeCosts()  # decay 0.97: the last ~30 rounds weigh most
    _feed(costs, 200, row=0.02)
    dear = costs.threshold()
    _feed(costs, 200, row=0.0005, seed=1)
    assert costs.threshold() < dear / 10


def test_without_branches_for_a_while_one_round_measures_them_again():
    costs = TreeCosts(decay=1.0, explore=16)
    _feed(costs, 400, extra=0.08, per_round=4)
    costs.observe(0.3, 8, 2, 2, 4, 0.6, 0)  # a round with branches
    for _ in range(15):
        assert costs.threshold() > 1.0
        costs.observe(0.12, 5, 0, 2, 2, 0.0, 0)
    costs.observe(0.12, 5, 0, 2, 2, 0.0, 0)
    assert costs.threshold() == TREE_MIN_SCORE  # the 16th round without a branch
    costs.observe(0.12, 5, 0, 2, 2, 0.0, 0)  # it found none worth a row either
    assert costs.threshold() > 1.0  # back to the price


def test_rounds_follow_the_price_and_emit_the_same_tokens():
    """The core's rounds with an open threshold (`tree_min_score` None): priced dear, chains
    only; priced cheap, branches; a pinned threshold ignores the price. Output is plain
    decoding's in every case."""
    from specdec.core import Models
    from specdec.speculative import SpecStats
    from tests.tiny import WIDTH, drain, plain_steps, rounds, tiny_llama

    target, draft = tiny_llama(1), tiny_llama(2, head_scale=8)  # an unsure, unrelated draft
    prompt = [5, 17, 99, 301, 7, 17, 99]
    want = drain(plain_steps(target, prompt, max_tokens=24))

    def run(costs, spec):
        stats = SpecStats()
        got = drain(rounds(Models(target, WIDTH, draft, WIDTH, trees=costs), prompt,
                           max_tokens=24, spec=spec, timings=stats))
        return got, stats

    open_spec = SpecConfig(4, tree=8)
    dear, cheap = TreeCosts(decay=1.0), TreeCosts(decay=1.0)
    _feed(dear, 2000, extra=0.08, per_round=4)
    _feed(cheap, 2000, row=0.0001)
    got, st = run(dear, open_spec)
    assert got == want and st.branched == 0 and st.rounds > 0
    got, st = run(cheap, open_spec)
    assert got == want and st.branched > 0
    got, st = run(dear, SpecConfig(4, tree=8, tree_min_score=0.02))
    assert got == want and st.branched > 0


def test_a_sharded_targets_replicas_branch_at_rank_0s_price_not_their_own():
    """Rank 0 prices branch rows by its clock; a replica replaying its rounds must branch
    exactly as rank 0 did (else the ranks' forwards differ and their all-sums never meet).
    Here rank 0's price swings between wide trees and chains round by round, and the
    replica's own price would give chains only: the replica follows the published
    threshold, branch for branch, token for token."""
    import dataclasses
    from types import SimpleNamespace

    from specdec import distributed
    from specdec.config import MaskBudget
    from specdec.core import Models, new_state
    from specdec.prepare import Request
    from specdec.scheduler import Decisions, Scheduler, Ticket, follower
    from tests.tiny import EOS, WIDTH, tiny_llama

    class Price:
        def __init__(self, *levels: float) -> None:
            self.levels, self.calls = levels, 0

        def threshold(self) -> float:
            self.calls += 1
            return self.levels[self.calls % len(self.levels)]

        def observe(self, *_: object) -> None:
            pass

    class Out:
        def __init__(self) -> None:
            self.tokens: list[int] = []
            self.stats = None

        def feed(self, tok: int, _lp: object, _src: object = None) -> bool:
            self.tokens.append(tok)
            return False

        def finish(self, _why: str, stats: object, _s: float) -> None:
            self.stats = stats

        def fail(self, e: Exception) -> None:
            raise AssertionError(e)

    target, draft = tiny_llama(1), tiny_llama(2, head_scale=8)  # an unsure draft: it branches
    prompts = [[5, 17, 99, 301, 7, 17, 99], [3, 1, 4, 1, 5, 9, 2, 6], [42, 7, 7, 42]]
    spec = SpecConfig(4, tree=8)
    budget = MaskBudget(in_round=False)

    def models(price: Price) -> Models:
        return Models(target, WIDTH, draft, WIDTH, masks=budget, trees=price)

    def start(m: Models):
        return lambda req: new_state(m, dataclasses.replace(req, spec=spec), EOS)

    published: list[Decisions] = []
    lead = models(Price(0.0, 5.0, 0.02))
    leader = Scheduler(lead, start(lead), max_batch=4, thread=False, publish=published.append)
    outs = {}
    for p in prompts:
        req = Request(tuple(p), max_tokens=20)
        t = Ticket(req, Out(), replica=req)
        leader.submit(t)
        outs[t.key] = t.output
    while leader.active or leader.queue_depth:
        assert leader.pump()
    assert sum(o.stats.branched for o in outs.values()) > 0  # rank 0 branched
    assert any(d.tree_min_score is not None for d in published[1:])  # and said when

    copies: dict[int, Out] = {}

    def output(req: object) -> Out:
        copies[len(copies) + 1] = out = Out()
        return out

    mine = models(Price(5.0))  # this rank's own price: chains only
    # an engine's follower (`Engine.follower`) over this rank's models and price
    replica = SimpleNamespace(follower=lambda max_batch, chunk: follower(
        mine, start(mine), output, max_batch, chunk))
    sent = iter([*published, Decisions(stop=True)])
    channel = SimpleNamespace(rank=1, recv=lambda: next(sent))
    assert distributed.follow(replica, channel, max_batch=4) == 0
    assert {k: o.tokens for k, o in copies.items()} == {k: o.tokens for k, o in outs.items()}
    assert ({k: o.stats.branched for k, o in copies.items()}
            == {k: o.stats.branched for k, o in outs.items()})
