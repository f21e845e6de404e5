"""The compare tool (`python -m bench compare REV`, bench/compare.py): this checkout's server
against a commit's, built in a worktree with a venv of its own. Its smoke run compares two
builds of the same code (this checkout and its HEAD, built anew or from the tool's cache),
one request at a time (c1 structured, a 2-turn agent loop: the same batch shapes on both
sides, so the same answers on any BLAS): every answer is the same on both sides and the
speed ratios are near 1 (smoke sizes: one request a cell, so the bound is loose)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.compare import Cell, rows

ROOT = Path(__file__).resolve().parents[1]


def test_a_cell_counts_differing_answers_and_reports_each_round():
    c = Cell("c8")
    c.add("head", 10.0, [(0, "a"), (1, "b")])
    c.add("base", 8.0, [(0, "a"), (1, "c")])
    c.add("head", 9.0, [(0, "a")])
    c.add("base", 10.0, [(0, "a"), (1, "b")])
    assert c.differ("head", "base") == (2, 4)  # one text differs, one answer is missing
    (row,) = rows({"c8": c}, "head", "base", "f" * 40, 2)
    assert row["name"] == "compare_c8" and row["rounds"] == [1.25, 0.9]
    assert row["value"] == (1.25 + 0.9) / 2 and row["differ"] == 2
    assert "1.250 / 0.900" in row["note"] and "differing: 2 of 4" in row["note"]


def test_two_builds_of_one_commit_give_the_same_answers_at_about_the_same_speed(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("SPECDEC_BLAS", "SPECDEC_BLAS_REEXEC")
           and not k.startswith(("PYTEST_", "SPECDEC_BENCH_"))}
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "-m", "bench", "compare", "HEAD", "--smoke",
                           "--only", "c1,agent", "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = {r["name"]: r for r in json.loads(out.read_text())}
    assert set(got) == {"compare_c1", "compare_agent"}, got
    for name, r in got.items():
        assert r["answers"] > 0 and r["differ"] == 0, (name, r["note"])
        assert 0.5 < r["value"] < 2.0, (name, r["note"])
    assert "compare_c1 " in proc.stdout  # the printed table
