"""One target sharded over MLX's distributed backend: `specdec serve` under `mlx.launch`.

Every rank loads the target with mlx-lm's tensor-parallel sharding (`Model.shard`: each rank
holds a slice of every layer's heads and MLP; the layers' own all-sums join them, so every
rank computes the same logits) and the draft model whole. Rank 0 serves HTTP and runs the
scheduler; each round it first broadcasts the round's decisions that depend on time and
clients (`scheduler.Decisions`: requests admitted, requests late or cancelled). The other
ranks (`follow`) apply them to a scheduler of their own and replay the round: the same
grammars, proposers, forwards (their all-sums meet rank 0's) and cache trims, because
everything else in a round follows from the requests themselves.

A lost rank makes the collectives fail: rank 0 fails every request with a clear error, stops
taking new ones, and exits non-zero; a follower that loses rank 0 exits non-zero.
`mlx.launch` reports a rank's failure but exits 0, so `specdec launch` wraps it and exits
non-zero when any rank failed.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np

from .scheduler import Decisions

log = logging.getLogger("specdec.distributed")

EXIT_LOST_RANK = 3  # a rank's exit status when the group lost a member
STOP_GRACE_S = 45.0  # after a stop signal, how long `launch` waits before killing the ranks


def group() -> Any:
    """The distributed group when this process was started by `mlx.launch` with more than
    one rank, else None."""
    if "MLX_RANK" not in os.environ or not mx.distributed.is_available():
        return None
    g = mx.distributed.init()
    return g if g.size() > 1 else None


class Channel:
    """Rank 0 → every rank: Python objects over the group's all-sum (the only collective
    every backend has): the length, then the bytes, with the other ranks adding zeros."""

    def __init__(self, g: Any) -> None:
        self.group = g
        self.rank = g.rank()
        self.collective_s = 0.0  # time spent in broadcasts (a bench figure)

    def _all_sum(self, x: np.ndarray) -> np.ndarray:
        out = mx.distributed.all_sum(mx.array(x), group=self.group, stream=mx.cpu)
        mx.eval(out)
        return np.array(out)

    def send(self, obj: Any) -> None:
        """Rank 0: broadcast `obj` (every other rank is in `recv`)."""
        t0 = time.perf_counter()
        if obj is None:  # the usual round: nothing to say, one collective
            self._all_sum(np.zeros(1, dtype=np.int32))
        else:
            data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
            self._all_sum(np.array([data.size], dtype=np.int32))
            self._all_sum(data.astype(np.int32))
        self.collective_s += time.perf_counter() - t0

    def recv(self) -> Any:
        """Other ranks: the object rank 0 sends next (None: nothing)."""
        n = int(self._all_sum(np.zeros(1, dtype=np.int32))[0])
        if n == 0:
            return None
        data = self._all_sum(np.zeros(n, dtype=np.int32)).astype(np.uint8)
        return pickle.loads(data.tobytes())

    def publish(self, d: Any) -> None:
        """The scheduler's `publish`: a round's decisions (nothing when there are none)."""
        self.send(None if d == Decisions() else d)


def for_replicas(request: Any) -> Any:
    """A request as replicas receive it: without its compiled grammar and its budget rule's
    closing order (they compile and build them: `Engine.new_state`)."""
    closing = request.closing
    return replace(request, grammar=None,
                   closing=None if closing is None else replace(closing, order=None))


def follow(engine: Any, channel: Channel, max_batch: int, chunk: int = 512) -> int:
    """A follower rank: replay rank 0's rounds (`Engine.follower`) until it stops. Returns
    the exit status (0: rank 0 stopped; EXIT_LOST_RANK: the group lost a rank)."""
    replay = engine.follower(max_batch, chunk)
    log.info("rank %d (pid %d) following rank 0", channel.rank, os.getpid())
    while True:
        try:
            d = channel.recv() or Decisions()
        except Exception as e:  # rank 0 (or another rank) is gone
            log.error("rank %d lost the group: %s", channel.rank, e)
            return EXIT_LOST_RANK
        if d.stop:
            return 0
        try:
            replay(d)
        except Exception as e:
            log.error("rank %d: round failed: %s", channel.rank, e)
            return EXIT_LOST_RANK


# -- the launcher ---------------------------------------------------------------------------
_FAILED = re.compile(r"Node with rank (\d+) (exited with code|was killed)")
_RANK0 = re.compile(r"rank 0 \(pid (\d+)\)")


def launch(n: int, args: Sequence[str], launcher_args: Sequence[str] = ()) -> int:
    """Run `specdec ARGS` on `n` local ranks with `mlx.launch` (ring backend over loopback
    unless `launcher_args`, which go to mlx.launch, name another: `--backend=mpi`; or give
    hosts: `--hostfile=FILE`). Passes the output through and
    returns non-zero when any rank failed (mlx.launch itself exits 0 then)."""
    exe = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    cmd = [exe if os.path.exists(exe) else "mlx.launch"]
    if not any(a.startswith("--backend") for a in launcher_args):
        cmd += ["--backend", "ring"]  # works everywhere; e.g. --backend=mpi where present
    if not any(a in ("--hosts", "--hostfile") or a.startswith("--host")
               for a in launcher_args):
        cmd += ["-n", str(n)]
    cmd += [*launcher_args, sys.executable, "-m", "specdec", *args]
    # Its own process group: a signal to this launcher reaches every rank.
    proc = subprocess.Popen(cmd, stdout=sys.stdout, stderr=subprocess.PIPE, text=True,
                            errors="replace", start_new_session=True)
    failed: list[str] = []

    signalled: list[float] = []
    rank0: list[int] = []  # rank 0's pid, from its log line

    def forward(signum: int, _frame: Any) -> None:
        """To rank 0, which stops the group gracefully (finishing what it has); to every
        rank when rank 0 is not known (mlx.launch's children: it reports their exits)."""
        signalled.append(time.monotonic())
        pids = rank0 or [int(p) for p in subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            m = _FAILED.search(line)
            if m:
                failed.append(line.strip())
            m = _RANK0.search(line)
            if m and not rank0:
                rank0.append(int(m.group(1)))

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    while True:
        try:
            rc = proc.wait(timeout=1)
            break
        except subprocess.TimeoutExpired:
            if signalled and time.monotonic() - signalled[0] > STOP_GRACE_S:
                os.killpg(proc.pid, signal.SIGKILL)  # a rank that would not stop
    t.join(timeout=5)
    if failed:
        print(f"specdec launch: {len(failed)} rank(s) failed", file=sys.stderr)
        return rc or 1
    return rc
