"""Figures the benchmarks report: one row each (name, value, unit, how measured)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Row:
    name: str
    value: float
    unit: str
    note: str


ROWS: list[Row] = []
QUICK = os.environ.get("SPECDEC_BENCH_QUICK") == "1"


def rounds(quick: int, full: int = 3) -> int:
    """Repeats for a suite: `SPECDEC_BENCH_ROUNDS`, else `quick` in quick mode, else `full`."""
    return int(os.environ.get("SPECDEC_BENCH_ROUNDS", quick if QUICK else full))


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
