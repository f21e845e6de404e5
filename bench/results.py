"""Figures the benchmarks report: one row each (name, value, unit, how measured)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar


@dataclass(frozen=True)
class Row:
    name: str
    value: float
    unit: str
    note: str


ROWS: list[Row] = []
# Smoke mode (CI): every suite runs once at its smallest sizes, to show that it runs and
# writes its rows; its figures measure nothing. It counts as quick mode too (`QUICK`).
SMOKE = os.environ.get("SPECDEC_BENCH_SMOKE") == "1"
QUICK = SMOKE or os.environ.get("SPECDEC_BENCH_QUICK") == "1"
SMOKE_PROMPTS = 1  # the workload prompts a suite decodes in smoke mode

T = TypeVar("T")


def size(quick: int, full: int, smoke: int = 1) -> int:
    """A suite's count (prompts, clients, steps, pairs): `smoke` in smoke mode, `quick` in
    quick mode, else `full`."""
    return smoke if SMOKE else quick if QUICK else full


def rounds(quick: int, full: int = 3) -> int:
    """Repeats for a suite: `SPECDEC_BENCH_ROUNDS`, else 1 in smoke mode, `quick` in quick
    mode, else `full`."""
    return int(os.environ.get("SPECDEC_BENCH_ROUNDS", size(quick, full)))


def prompts(workloads: Sequence[T], smoke: int = SMOKE_PROMPTS) -> list[T]:
    """The workloads a suite decodes: all of them, the first `smoke` in smoke mode."""
    return list(workloads[:smoke] if SMOKE else workloads)


def add(name: str, value: float, unit: str, note: str) -> None:
    ROWS.append(Row(name, value, unit, note))


def machine() -> str:
    import mlx.core as mx

    from specdec import blas

    return (f"nproc={os.cpu_count()} BLAS={blas.active()} MLX={mx.__version__} "
            f"device={mx.default_device()}")


def table() -> list[str]:
    lines = [machine(), f"{'figure':44} {'value':>10} {'unit':10} how measured"]
    for r in ROWS:
        lines.append(f"{r.name:44} {r.value:10.3f} {r.unit:10} {r.note}")
    return lines


def as_json() -> list[dict]:
    return [asdict(r) for r in ROWS]
