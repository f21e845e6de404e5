"""The launcher's `--blas`: the same choice as `SPECDEC_BLAS` (which it overrides), made
before MLX is loaded (a re-exec), for every subcommand, and shown by `specdec info`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specdec import blas
from specdec.cli import build_parser

needs_openblas = pytest.mark.skipif(
    blas.openblas_path() is None,
    reason="OpenBLAS not installed (apt-get install libopenblas0-pthread)")


def info(*args: str, env: dict[str, str]) -> dict[str, str]:
    """`specdec info ARGS` in a fresh process (as a user starts it: no re-exec done yet)."""
    e = dict(os.environ, **env)
    e.pop("SPECDEC_BLAS_REEXEC", None)
    out = subprocess.run([sys.executable, "-m", "specdec", "info", *args], env=e,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return dict(line.split(None, 1) for line in out.stdout.splitlines() if line.strip())


def test_every_subcommand_takes_blas_with_the_env_var_choices():
    p = build_parser()
    for cmd in ("generate --prompt x", "info", "serve", "distill --out d", "launch"):
        args = p.parse_args([*cmd.split(), "--blas", "reference"])
        assert args.blas == "reference", cmd
        assert p.parse_args(cmd.split()).blas is None  # unset: SPECDEC_BLAS decides
    with pytest.raises(SystemExit) as e:
        p.parse_args(["serve", "--blas", "mkl"])
    assert e.value.code == 2


@needs_openblas
def test_blas_reference_overrides_the_env_and_info_shows_it_batch_invariant():
    got = info("--blas", "reference", env={"SPECDEC_BLAS": "openblas"})
    assert got["blas_active"] == "reference" and got["blas_requested"] == "reference"
    assert got["batch_invariant"].startswith("yes")


@needs_openblas
def test_blas_openblas_re_execs_onto_openblas_and_info_says_it_is_not_batch_invariant():
    # From the suite's process (reference BLAS, no preload): the flag alone switches.
    got = info("--blas", "openblas", env={"SPECDEC_BLAS": "reference"})
    assert got["blas_active"] == "openblas" and got["blas_requested"] == "openblas"
    assert got["batch_invariant"].startswith("no")
