"""Which BLAS MLX's CPU backend uses, and switching to a fast one on Linux.

MLX's Linux wheel links a reference BLAS (~2.5 GFLOP/s here). Debian's OpenBLAS, preloaded,
makes a decode step ~2x faster, but its results depend on the batch shape, so the exactness
gate keeps the reference BLAS (bitwise batch-invariant). `SPECDEC_BLAS`, or the launcher's
`--blas` (which sets it, for this process and the ones it starts), selects:

    auto       OpenBLAS when installed (default for the CLI, server and benchmarks)
    openblas   OpenBLAS, an error if it is not installed
    reference  MLX's bundled reference BLAS (the batch-invariant configuration)

The choice must be made before the process loads MLX, so the launchers re-exec themselves
with `LD_PRELOAD` (see `ensure_blas`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Literal

from .errors import BlasError  # noqa: F401

BlasChoice = Literal["auto", "openblas", "reference"]
CHOICES: tuple[BlasChoice, ...] = ("auto", "openblas", "reference")
# Whether a request's logits are independent of the other requests in its batch, as the suite
# measures it (tests/test_batching.py and its OpenBLAS control).
BATCH_INVARIANT = {
    "reference": "yes: bitwise, whatever the batch",
    "openblas": "no: logits move with the batch (by up to ~1e-4), so tokens at near-ties can",
}

# Debian's packages: libopenblas0-pthread (preferred) or libopenblas0-openmp.
OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-openmp/libblas.so.3",
)
_REEXEC_MARK = "SPECDEC_BLAS_REEXEC"


def openblas_path() -> str | None:
    """Path of Debian's OpenBLAS `libblas.so.3`, or None when it is not installed."""
    for p in OPENBLAS_CANDIDATES:
        if Path(p).exists():
            return p
    return None


def requested() -> BlasChoice:
    """The BLAS asked for by `SPECDEC_BLAS` (default `auto`)."""
    v = os.environ.get("SPECDEC_BLAS", "auto").strip().lower() or "auto"
    if v not in CHOICES:
        raise BlasError(f"SPECDEC_BLAS={v!r}: expected one of {', '.join(CHOICES)}")
    return v  # type: ignore[return-value]


def request(choice: BlasChoice) -> None:
    """Ask for `choice` as `SPECDEC_BLAS={choice}` would (the launcher's `--blas`): the
    `ensure_blas` that follows, the re-exec'd process and every process it starts see it."""
    if choice not in CHOICES:
        raise BlasError(f"--blas {choice!r}: expected one of {', '.join(CHOICES)}")
    os.environ["SPECDEC_BLAS"] = choice


def active() -> str:
    """The BLAS this process actually runs with: 'openblas', 'reference' or 'accelerate'."""
    if sys.platform == "darwin":
        return "accelerate"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    # numpy's wheel bundles its own `libscipy_openblas`; only a system OpenBLAS serving the
    # `libblas` interface (what the preload provides) counts for MLX.
    paths = {line.split()[-1] for line in maps.splitlines() if "/" in line}
    return "openblas" if any("openblas" in p and "scipy_openblas" not in p for p in paths) \
        else "reference"


def _preload_env(choice: BlasChoice) -> dict[str, str] | None:
    """The environment to re-exec with, or None when this process already fits `choice`."""
    if sys.platform != "linux":
        return None
    lib = openblas_path()
    preload = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    has_openblas = any("openblas" in p for p in preload)
    env = dict(os.environ)
    if choice == "reference":
        if not has_openblas:
            return None
        env["LD_PRELOAD"] = ":".join(p for p in preload if "openblas" not in p)
        return env
    if lib is None:
        if choice == "openblas":
            raise BlasError(
                "SPECDEC_BLAS=openblas but OpenBLAS is not installed: "
                "apt-get install libopenblas0-pthread"
            )
        return None
    if has_openblas:
        return None
    env["LD_PRELOAD"] = ":".join([lib, *preload])
    return env


def ensure_blas(choice: BlasChoice | None = None,
                before_exec: Callable[[], object] | None = None) -> None:
    """Re-exec the current command line under the requested BLAS, if it differs.

    Call this first thing in a launcher, before MLX is imported. Returns normally when the
    process already runs with the right BLAS (or the platform has only one); otherwise it
    does not return. A second re-exec is never attempted.

    Args:
        choice: the BLAS wanted (default: `SPECDEC_BLAS`, else auto).
        before_exec: called just before exec (e.g. to give pytest's captured fds back).
    """
    choice = choice or requested()
    if os.environ.get(_REEXEC_MARK):
        return
    env = _preload_env(choice)
    if env is None:
        return
    env[_REEXEC_MARK] = "1"
    argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    if before_exec is not None:
        before_exec()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], env)
