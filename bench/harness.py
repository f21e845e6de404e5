"""Interleaved A/B measurement: every arm runs on every prompt back to back, the order
rotating, so machine noise hits the arms alike; figures are medians."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench import results
from bench.workloads import Case
from specdec.errors import RequestError
from specdec.grammar import Constraint


@dataclass
class ArmResult:
    """Per-arm measurements: one entry per (round, prompt)."""

    tok_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    stats: list[Any] = field(default_factory=list)

    @property
    def median_tok_s(self) -> float:
        """Aggregate speed: total tokens / total decode seconds, median over rounds."""
        return statistics.median(self._per_round())

    def _per_round(self) -> list[float]:
        n = self.rounds_items
        out = []
        for r in range(len(self.tokens) // n):
            sl = slice(r * n, (r + 1) * n)
            out.append(sum(self.tokens[sl]) / sum(self.seconds[sl]))
        return out

    rounds_items: int = 1

    def total(self, counter: str) -> float:
        """A counter summed over the arm's requests, by its wire name (`SpecStats.as_dict`:
        `proposed`, `drafted_accepted`, ...)."""
        return float(sum(s.counters.as_dict()[counter] for s in self.stats))


Arm = Callable[[Any, list[int], Constraint, int], Any]  # (engine, ids, constraint, n) -> result


class BudgetTooSmall(AssertionError):
    """A budget a suite states is below what a workload's constraint needs (the engine would
    refuse it with `max_tokens_too_small`): the suite's budget is to be raised."""


def minimum_budget(engine: Any, name: str, ids: list[int], constraint: Constraint | None,
                   budget: int) -> int:
    """The least max_tokens the engine takes for `ids` under `constraint` (its budget rule's
    minimum, `Request.closing`; 1 where the rule does not apply), checked against the
    `budget` the suite states for workload `name`.

    Raises:
        BudgetTooSmall: naming the workload, where `budget` is below the minimum.
    """
    if constraint is None:
        return 1
    try:
        req = engine.prepare(ids, constraint=constraint, max_tokens=budget, spec=None)
    except RequestError as e:
        if e.code != "max_tokens_too_small":
            raise
        raise BudgetTooSmall(f"workload {name!r}: the suite's budget of {budget} tokens is "
                             f"below its constraint's minimum: {e}") from e
    return 1 if req.closing is None else req.closing.minimum


@dataclass(frozen=True)
class Item:
    """One workload prompt as every arm decodes it.

    Attributes:
        name: the workload's name (`Case.name`).
        ids: the chat prompt's token ids.
        constraint: the workload's constraint.
        budget: the max_tokens every arm gets: `generated`, raised to `minimum` where below.
        generated: the tokens plain constrained decoding generated within the suite's budget.
        minimum: the constraint's minimum budget (`minimum_budget`).
    """

    name: str
    ids: list[int]
    constraint: Constraint
    budget: int
    generated: int
    minimum: int


def workload_items(engine: Any, cases: Sequence[Case], max_tokens: int) -> list[Item]:
    """One `Item` per case (the first few in smoke mode, `results.prompts`; every case's
    budget is checked all the same). Its budget is what plain constrained decoding generates
    within `max_tokens` (checked against each constraint's minimum), so every arm decodes
    about the same number of tokens; where that is below the constraint's minimum budget (an
    answer shorter than the constraint's closing walk), the minimum, which the engine
    requires."""
    checked = []
    for case in cases:
        c = Constraint(case.kind, case.value)  # type: ignore[arg-type]
        ids = engine.chat_prompt(case.messages(), constrained=True)
        checked.append((case.name, ids, c, minimum_budget(engine, case.name, ids, c, max_tokens)))
    items = []
    for name, ids, c, least in results.prompts(checked):
        r = engine.generate(engine.prepare(ids, constraint=c, max_tokens=max_tokens, spec=None))
        n = max(len(r.tokens), 1)
        items.append(Item(name, ids, c, max(n, least), n, least))
    return items


def budgets_note(items: Sequence[Item], max_tokens: int) -> str:
    """What the items' budgets were, for a row's note."""
    raised = [f"{i.name} {i.generated}->{i.budget}" for i in items if i.budget > i.generated]
    return (f"max_tokens per prompt {min(i.budget for i in items)}-"
            f"{max(i.budget for i in items)}: plain decoding's length within {max_tokens}"
            + (f", raised to the constraint's minimum for {', '.join(raised)}" if raised else ""))


def interleaved(engine: Any, items: Sequence[Item], arms: dict[str, Arm], rounds: int
                ) -> dict[str, ArmResult]:
    """Run every arm on every item, `rounds` times, rotating the arm order per item."""
    names = list(arms)
    res = {n: ArmResult(rounds_items=len(items)) for n in names}
    for r in range(rounds):
        for i, item in enumerate(items):
            shift = (r + i) % len(names)
            for name in names[shift:] + names[:shift]:
                out = arms[name](engine, item.ids, item.constraint, item.budget)
                st = out.stats
                res[name].tokens.append(st.completion_tokens)
                res[name].seconds.append(st.decode_s)
                res[name].tok_s.append(st.completion_tokens / st.decode_s)
                res[name].stats.append(st)
    return res


def paired_ratio(a: ArmResult, b: ArmResult) -> float:
    """Median over (round, prompt) of a's speed over b's, measured back to back."""
    return statistics.median(x / y for x, y in zip(a.tok_s, b.tok_s))


def arm(constrained: bool, spec: Any = None) -> Arm:
    """An arm decoding each item with or without its constraint; `spec` None = plain."""
    def run(engine: Any, ids: list[int], c: Constraint, n: int) -> Any:
        return engine.generate(engine.prepare(ids, constraint=c if constrained else None,
                                              max_tokens=n, spec=spec))
    return run


def plain_answers(engine: Any, items: Sequence[Item]) -> dict[tuple[int, ...], list[int]]:
    """Each item's tokens decoded plainly within its budget, by prompt: what every arm must
    give."""
    return {tuple(i.ids): engine.generate(engine.prepare(i.ids, constraint=i.constraint,
                                                         max_tokens=i.budget,
                                                         spec=None)).tokens
            for i in items}


def checked_arm(want: dict[tuple[int, ...], list[int]], spec: Any) -> Arm:
    """An arm decoding with `spec` that asserts each answer equals plain decoding's (`want`,
    from `plain_answers`)."""
    def run(engine: Any, ids: list[int], c: Constraint, n: int) -> Any:
        out = engine.generate(engine.prepare(ids, constraint=c, max_tokens=n, spec=spec))
        assert out.tokens == want[tuple(ids)], "tokens differ from plain decoding"
        return out
    return run
