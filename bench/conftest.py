"""Benchmarks run in the fast-BLAS configuration (OpenBLAS when installed)."""

from __future__ import annotations

from specdec.blas import ensure_blas

ensure_blas()  # re-exec with OpenBLAS preloaded, before MLX loads

import pytest  # noqa: E402

from bench import results  # noqa: E402


@pytest.fixture(scope="session")
def engine():
    import specdec
    from specdec.engine import Engine

    return Engine(specdec.load())


def pytest_terminal_summary(terminalreporter):
    if results.ROWS:
        terminalreporter.section("specdec benchmark figures")
        for line in results.table():
            terminalreporter.write_line(line)
