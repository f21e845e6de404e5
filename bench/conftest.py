"""Benchmarks run in the fast-BLAS configuration (OpenBLAS when installed)."""

from __future__ import annotations

import json
import os

import pytest

from bench import results
from specdec.blas import ensure_blas


def pytest_configure(config):
    # Re-exec with OpenBLAS preloaded when installed, with pytest's fd capture suspended so
    # the new process writes to the real terminal.
    capman = config.pluginmanager.getplugin("capturemanager")
    ensure_blas(before_exec=capman and capman.suspend_global_capture)


@pytest.fixture(scope="session")
def engine():
    import specdec
    from specdec.engine import Engine

    return Engine(specdec.load())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    # A benchmark exists for its rows: one that ends without writing any fails, so a suite
    # whose figures silently went missing shows as a failure in every mode (smoke included).
    before = len(results.ROWS)
    out = yield
    if len(results.ROWS) == before:
        raise AssertionError(f"{item.nodeid} wrote no rows")
    return out


@pytest.fixture(scope="module")
def served():
    """The engine `specdec serve` runs: the shipped settings and draft."""
    from specdec.engine import Engine

    e = Engine.load()
    yield e
    e.close()


def pytest_terminal_summary(terminalreporter):
    out = os.environ.get("SPECDEC_BENCH_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"machine": results.machine(), "rows": results.as_json()}, f, indent=2)
    if results.ROWS:
        terminalreporter.section("specdec benchmark figures")
        for line in results.table():
            terminalreporter.write_line(line)
