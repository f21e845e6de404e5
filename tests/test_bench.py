"""The benchmark report (bench/): every suite runs and writes its rows. The report is run
at smoke size (`python -m bench report --smoke`: each suite once, at its smallest), so a
change that breaks a suite, or leaves a required row unwritten, fails here rather than in
the next full report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.__main__ import REQUIRED

ROOT = Path(__file__).resolve().parents[1]


def test_every_bench_suite_runs_and_writes_the_required_rows(tmp_path):
    # The report picks its own BLAS (the fast one) before MLX loads: neither this suite's
    # choice (the reference BLAS) nor its re-exec marker follow it, nor pytest's variables,
    # nor a developer's bench settings (SPECDEC_BENCH_ROUNDS would resize the smoke).
    env = {k: v for k, v in os.environ.items()
           if k not in ("SPECDEC_BLAS", "SPECDEC_BLAS_REEXEC")
           and not k.startswith(("PYTEST_", "SPECDEC_BENCH_"))}
    rows, plots = tmp_path / "rows.json", tmp_path / "plots"
    proc = subprocess.run([sys.executable, "-m", "bench", "report", "--smoke", "--json",
                           str(rows), "--plots", str(plots)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    print(proc.stdout)  # the whole report, shown with a failure
    # What failed: the suites' failures and errors (the table of rows follows them), and
    # the report's own complaints (missing rows).
    failed = [line for line in proc.stdout.splitlines()
              if line.startswith(("FAILED", "ERROR", "E  "))]
    out = "\n".join(failed[-80:]) + "\n" + proc.stderr[-4000:]
    assert proc.returncode == 0, out
    names = {r["name"] for r in json.loads(rows.read_text())}
    assert not [n for n in REQUIRED if n not in names], out
    assert sorted(p.name for p in plots.iterdir()) == ["acceptance_vs_k.png",
                                                       "tok_s_per_arm.png"], out
