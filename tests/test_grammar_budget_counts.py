"""Every kind of grammar work a request causes counts in its grammar budget
(`config.MaskBudget`, `request_grammar.GrammarClock`): the verify rows' look-ahead, the
proposer's draft masks, the budget rule's walk and its closing search, forced tokens, and
consuming what the round emitted. Each test injects slowness into one kind of work (a
matcher whose operations sleep when called from that kind's code: `SlowIn`), so what it sees
is the accounting, not the machine's speed: the request's counted grammar time covers every
injected sleep, and a request whose injected work passes its budget ends with its 4xx
within the budget and one round."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import pytest

from specdec.events import Failed, Finished
from specdec.grammar import Constraint
from specdec.request import GenerateRequest, Message

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
DELAY = 0.004  # one injected sleep (s)

# Each kind of grammar work, by the code that does it: (function names, their module).
KINDS = {
    "verify": ({"verify_masks", "tree_masks"}, "speculative"),
    "draft_masks": ({"steps", "_fill", "_take", "_grow_tree", "_branch_runs"}, "speculative"),
    "budget_walk": ({"closing_after", "replays"}, "budget"),
    "closing_search": ({"closing", "search", "_closing"}, "budget"),
    "forced_tokens": ({"_forced"}, "budget"),
    "emit": ({"_emit"}, "core"),
}


def _kind(depth: int = 2) -> str | None:
    """Which kind of grammar work is calling (the innermost frame of one), or None."""
    f = sys._getframe(depth)
    while f is not None:
        name, mod = f.f_code.co_name, f.f_code.co_filename
        for kind, (names, module) in KINDS.items():
            if name in names and mod.endswith(f"specdec/{module}.py"):
                return kind
        f = f.f_back
    return None


class SlowIn:
    """A grammar state (its copies too) whose operations sleep `DELAY` when made by the
    scheduler's thread from the code of kind `kind`; `slept` adds up those sleeps."""

    OPS = ("consume_token", "try_consume_tokens", "compute_ff_tokens", "is_accepting",
           "validate_tokens", "unsafe_compute_mask_ptr")

    def __init__(self, inner: Any, kind: str, slept: list[float], delay: float = DELAY
                 ) -> None:
        self.inner, self.kind, self.slept, self.delay = inner, kind, slept, delay

    def _sleep(self) -> None:
        if threading.current_thread().name == "specdec-scheduler" and _kind(3) == self.kind:
            t0 = time.perf_counter()
            time.sleep(self.delay)
            self.slept.append(time.perf_counter() - t0)

    def deep_copy(self) -> "SlowIn":
        return SlowIn(self.inner.deep_copy(), self.kind, self.slept, self.delay)

    def __getattr__(self, name: str) -> Any:
        got = getattr(self.inner, name)
        if name not in self.OPS:
            return got

        def op(*args: Any) -> Any:
            self._sleep()
            return got(*args)

        return op


def slow_in(engine: Any, kind: str, delay: float = DELAY) -> list[float]:
    """Make every constrained request's grammar slow in `kind` (`SlowIn`); returns the
    sleeps."""
    slept: list[float] = []
    plain = engine.matcher

    def matcher(req: Any) -> Any:
        m = plain(req)
        return SlowIn(m, kind, slept, delay) if m is not None else m

    engine.matcher = matcher
    return slept


@pytest.fixture
def make_engine(embedded, distilled):
    """Engines with the serving defaults' draft (draft masking, forced drafting, lookup) and
    a grammar budget (`total_s`), closed after the test."""
    from specdec.config import MaskBudget
    from specdec.engine import Engine
    from specdec.speculative import SpecConfig

    made = []

    def make(total_s: float = 60.0, tree: int = 0) -> Any:
        e = Engine(embedded, distilled, SpecConfig(4, lookup=True, draft_min_prob=0.0,
                                                   tree=tree),
                   masks=MaskBudget(slow_s=min(1.0, total_s), mask_s=min(5.0, total_s),
                                    total_s=total_s))
        e.start(max_batch=4)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def _request(e: Any, max_tokens: int | None = None) -> Any:
    """A JSON answer whose budget is its minimum and a few (the budget rule checks every
    position, so its walk and closing search run)."""
    greq = GenerateRequest(messages=(Message("user", "A person as JSON"),),
                           constraint=Constraint.json_schema(PERSON), max_tokens=64)
    req = e.prepare(greq)
    if max_tokens is None:
        max_tokens = req.closing.minimum + 3
    return e.prepare(GenerateRequest(messages=greq.messages, constraint=greq.constraint,
                                     max_tokens=max_tokens))


def _run(e: Any, req: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    for ev in e.submit(req):
        if isinstance(ev, (Finished, Failed)):
            return ev, time.perf_counter() - t0
    raise AssertionError("no end")


@pytest.mark.parametrize("kind,tree", [("verify", 0), ("verify", 4), ("draft_masks", 0),
                                       ("budget_walk", 0), ("closing_search", 0),
                                       ("forced_tokens", 0), ("emit", 0)])
def test_each_kind_of_grammar_work_counts_in_the_request_budget(make_engine, kind, tree):
    e = make_engine(tree=tree)
    req = _request(e)
    clean, _ = _run(e, req)  # (warm, and its counted time without injected sleeps)
    assert isinstance(clean, Finished), clean
    slept = slow_in(e, kind)
    ev, _ = _run(e, _request(e))
    assert isinstance(ev, Finished), ev
    assert ev.tokens == clean.tokens  # slowness changes no token
    assert len(slept) >= 2, f"the {kind} work was not exercised ({len(slept)} sleeps)"
    counted = ev.stats.counters.mask_s
    # every injected sleep is in the request's counted grammar time
    assert counted >= sum(slept), (kind, counted, sum(slept), len(slept))


def test_a_request_over_its_budget_in_uncounted_work_ends_within_it_and_one_round(
        make_engine):
    """Before every kind counted, this request's verify look-ahead (sleeping) ran far past
    its budget; now it ends with its 4xx once its counted time passes the budget, within
    one round of it."""
    budget = 0.6
    e = make_engine(total_s=budget)
    _run(e, _request(e))  # warm
    delay = 0.02
    slept = slow_in(e, "verify", delay)
    ev, took = _run(e, _request(e, max_tokens=60))
    assert isinstance(ev, Failed) and ev.error.code == "grammar_too_complex", ev
    assert "in all" in str(ev.error), ev.error
    # One round's injected work at most past the budget: a round's verify rows are at most
    # 5 (4 proposals), each a fill and a consume that sleep. (The forwards are not grammar
    # work, and their time is the machine's: not asserted here.)
    assert budget < sum(slept) <= budget + 10 * delay, (sum(slept), len(slept), took)
