"""What the token budget's closing costs (`specdec.budget`), by the work it does.

- `budget_search_minimum_ms_p50` / `_p99`: finding a request's minimum (the closing from
  the start: the walk, and the search where it stalls) on every schema kind the search is
  for (`workloads.CLOSING_KINDS`); once per grammar (the compiler keeps it).
- `budget_search_closing_ms_p50` / `_p99`: the rule's time in one request capped a few
  tokens above its minimum on those schemas (steered to close).
- `budget_rule_share_c{1,8,16}`: the rule's host time over the batch's wall time, the
  serving workloads with budgets 4 tokens above their answers (every position is in the
  rule's window; the answers end on their own, nothing steered), serving defaults, `c`
  requests at once.
- `budget_rule_on_over_off_c{1,8,16}`: the same batches' tok/s with the rule on over
  `close_at_budget` off, arms interleaved, both checked to give the same tokens.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from bench import results
from bench.workloads import CASES, CLOSING_KINDS
from specdec.budget import need
from specdec.grammar import Constraint
from specdec.request import GenerateRequest, Message

LEVELS = (1, 8, 16)
ROOM = 4  # a batch's budgets: each answer's own length and this many tokens
USER = "Fill in this record with realistic values, as JSON."


def _ms(values: list[float]) -> tuple[float, float]:
    a = np.array(values) * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def test_the_closing_search_cost_per_request(benchmark, served):
    e = served
    kinds = results.prompts(sorted(CLOSING_KINDS), smoke=2)
    order = e.compiler.closing_order(e.target.vocab_size)
    reps = results.rounds(2, 3)

    def measure():
        minimum_s, closing_s = [], []
        for _ in range(reps):
            for kind in kinds:
                g = e.compiler.compile(Constraint.json_schema(CLOSING_KINDS[kind]))
                t0 = time.perf_counter()
                assert need(g.matcher(), order) is not None, kind
                minimum_s.append(time.perf_counter() - t0)
        for kind in kinds:
            greq = GenerateRequest(messages=(Message("user", USER),),
                                   constraint=Constraint.json_schema(CLOSING_KINDS[kind]),
                                   max_tokens=400)
            minimum = e.prepare(greq).closing.minimum
            r = e.generate(e.prepare(GenerateRequest(
                messages=greq.messages, constraint=greq.constraint, max_tokens=minimum + 3)))
            closing_s.append(r.stats.counters.budget_s)
        return minimum_s, closing_s

    minimum_s, closing_s = benchmark.pedantic(measure, rounds=1, iterations=1)
    p50, p99 = _ms(minimum_s)
    note = f"{len(kinds)} schema kinds x {reps}, embedded model's tokenizer"
    results.add("budget_search_minimum_ms_p50", p50, "ms", note)
    results.add("budget_search_minimum_ms_p99", p99, "ms", note)
    p50, p99 = _ms(closing_s)
    note = f"per request capped 3 tokens above its minimum, {len(kinds)} schema kinds"
    results.add("budget_search_closing_ms_p50", p50, "ms", note)
    results.add("budget_search_closing_ms_p99", p99, "ms", note)


def test_the_rules_cost_by_batch_size(benchmark, served):
    e = served
    cases = [c for c in CASES if c.kind == "json_schema"]
    levels = LEVELS[:2] if results.SMOKE else LEVELS
    rounds = results.rounds(2, 4)

    prompts = [e.chat_prompt(c.messages(), constrained=True) for c in cases]
    constraints = [Constraint(c.kind, c.value) for c in cases]
    budgets = []  # each answer's own length and ROOM (also compiles and finds the minima)
    for ids, c in zip(prompts, constraints):
        r = e.generate(e.prepare(ids, constraint=c, max_tokens=200))
        assert r.finish_reason == "stop" and not r.stats.counters.budget_steered
        budgets.append(len(r.tokens) + ROOM)

    def batch(n: int, close: bool):
        reqs = [e.prepare(prompts[i % len(cases)], constraint=constraints[i % len(cases)],
                          max_tokens=budgets[i % len(cases)], close_at_budget=close)
                for i in range(n)]
        assert all(not close or r.closing is not None and r.closing.minimum + 64 >= r.max_tokens
                   for r in reqs), "a position outside the rule's window"
        t0 = time.perf_counter()
        streams = [e.submit(r) for r in reqs]
        done = [list(s)[-1] for s in streams]
        wall = time.perf_counter() - t0
        assert not any(r.stats.counters.budget_steered for r in done), "steered"
        return done, wall

    def measure():
        got: dict[int, dict[str, list[float]]] = {n: {"share": [], "ratio": []}
                                                  for n in levels}
        for rnd in range(rounds):
            for n in levels:
                arms = (True, False) if rnd % 2 == 0 else (False, True)
                runs = {arm: batch(n, arm) for arm in arms}
                (on, t_on), (off, t_off) = runs[True], runs[False]
                assert [r.tokens for r in on] == [r.tokens for r in off], n
                tokens = sum(r.usage.completion_tokens for r in on)
                got[n]["share"].append(sum(r.stats.counters.budget_s for r in on) / t_on)
                got[n]["ratio"].append((tokens / t_on) / (tokens / t_off))
        return got

    got = benchmark.pedantic(measure, rounds=1, iterations=1)
    for n in levels:
        note = (f"c{n}, budgets {ROOM} above the answers' (the rule checks every position), "
                f"serving defaults, median of {rounds}")
        results.add(f"budget_rule_share_c{n}", statistics.median(got[n]["share"]), "fraction",
                    note + "; the rule's host time over the batch's wall time")
        results.add(f"budget_rule_on_over_off_c{n}", statistics.median(got[n]["ratio"]),
                    "ratio", note + "; arms interleaved, same tokens")
