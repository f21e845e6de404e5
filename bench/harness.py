"""Interleaved A/B measurement: every arm runs on every prompt back to back, the order
rotating, so machine noise hits the arms alike; figures are medians."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.workloads import Case
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


def workload_items(engine: Any, cases: Sequence[Case], max_tokens: int
                   ) -> list[tuple[list[int], Constraint, int]]:
    """(prompt ids, constraint, token budget) per case; the budget is what plain constrained
    decoding generates, so every arm decodes about the same number of tokens."""
    items = []
    for case in cases:
        c = Constraint(case.kind, case.value)  # type: ignore[arg-type]
        ids = engine.chat_prompt(case.messages(), constrained=True)
        r = engine.generate(engine.prepare(ids, constraint=c, max_tokens=max_tokens, spec=None))
        items.append((ids, c, max(len(r.tokens), 1)))
    return items


def interleaved(engine: Any, items: list[tuple[list[int], Constraint, int]],
                arms: dict[str, Arm], rounds: int) -> dict[str, ArmResult]:
    """Run every arm on every item, `rounds` times, rotating the arm order per item."""
    names = list(arms)
    res = {n: ArmResult(rounds_items=len(items)) for n in names}
    for r in range(rounds):
        for i, (ids, c, n) in enumerate(items):
            shift = (r + i) % len(names)
            for name in names[shift:] + names[:shift]:
                out = arms[name](engine, ids, c, n)
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


def plain_answers(engine: Any, items: list[tuple[list[int], Constraint, int]]
                  ) -> dict[tuple[int, ...], list[int]]:
    """Each item's tokens decoded plainly, by prompt: what every arm must give."""
    return {tuple(ids): engine.generate(engine.prepare(ids, constraint=c, max_tokens=n,
                                                       spec=None)).tokens
            for ids, c, n in items}


def checked_arm(want: dict[tuple[int, ...], list[int]], spec: Any) -> Arm:
    """An arm decoding with `spec` that asserts each answer equals plain decoding's (`want`,
    from `plain_answers`)."""
    def run(engine: Any, ids: list[int], c: Constraint, n: int) -> Any:
        out = engine.generate(engine.prepare(ids, constraint=c, max_tokens=n, spec=spec))
        assert out.tokens == want[tuple(ids)], "tokens differ from plain decoding"
        return out
    return run
