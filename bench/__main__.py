"""`python -m bench report [--quick | --smoke] [--json FILE] [--plots DIR]`: run the benchmark
suites (in a subprocess, so the fast BLAS is picked before MLX loads), print one table and
write the same rows as JSON `[{"name", "value", "unit", "note"}]`. Exits 1 when a suite
fails or a required row is missing; `--smoke` (CI, tests/test_bench.py) runs every suite
once at its smallest sizes, which checks exactly that, and measures nothing."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# Rows every report must carry, so reports stay comparable over time.
REQUIRED = (
    "replicas_cached_share_affinity", "replicas_cached_share_round_robin",
    "plain_constrained_over_unconstrained", "spec_constrained_over_unconstrained",
    "spec_over_plain_constrained", "draft_masking_on_over_off", "draft_masking_acceptance_on",
    "draft_masking_acceptance_off", "grammar_cuts_on", "grammar_cuts_off", "mask_fill_us_p50",
    "mask_fill_us_p99", "visible_mask_overhead_ms_per_token", "compile_ms_p50_unique",
    "ttft_unique_over_cached", "ours_over_peer_plain_constrained",
    "ours_over_peer_spec_constrained", "server_tok_s_c1", "server_tok_s_c8",
    "server_p99_latency_s_c8", "draft_acceptance_distilled", "draft_cost_over_target_step",
    "spec_over_plain_constrained_distilled", "spec_over_plain_constrained_lookup",
    "server_tok_s_c4", "server_tok_s_c16", "server_c8_over_c1", "server_p99_latency_c8_over_c1",
    "batched_spec_over_batched_plain_c8", "ours_constrained_c8_over_mlxlm_unconstrained_c8",
    "load_requests", "load_5xx", "load_lost", "load_rss_growth_mb",
    "sharded2_over_single_tok_s", "sharded2_broadcast_ms_per_round", "draft_left_out_over_kept_c8",
    "tree_over_chain_c1", "tree_over_chain_c8", "accepted_per_round_chain",
    "accepted_per_round_tree", "serving_tree_over_chain_c1", "serving_tree_over_chain_c8",
    "budget_on_over_off", "budget_closing_p50_ms", "budget_closing_p99_ms",
    "models_ttft_cold_s", "models_ttft_loaded_s", "models_tok_s_each_alone",
    "models_tok_s_two_together", "gguf_q4_over_float32_decode",
    "budget_search_minimum_ms_p50", "budget_search_minimum_ms_p99",
    "budget_search_closing_ms_p50", "budget_search_closing_ms_p99", "budget_rule_share_c1",
    "budget_rule_share_c8", "budget_rule_on_over_off_c1", "budget_rule_on_over_off_c8",
    *(f"agent_loop_{row}_{shape}" for shape in ("plain", "reasoning_dropped",
                                                 "calls_reserialized")
      for row in ("computed_over_new", "history_computed", "ttft_last_over_cold",
                  "draft_cached")),
    "agent_loop_by_id_over_resend_computed", "agent_loop_served_ttft_over_bound",
    "agent_loop_served_last_over_cold", "store_bytes_per_unique_50_turns",
    "store_gap_p99_loaded_over_idle", "store_health_p99_ms_loaded",
    "keywords_compile_over_llguidance_p50", "keywords_mask_fill_over_bare_p50",
    "keywords_mask_fill_over_bare_p99", "unique_mask_fill_us_p50", "unique_mask_fill_us_p99",
)


def plots(rows: list[dict], out: Path) -> list[Path]:
    """tok/s per arm, and acceptance vs k (matplotlib, bench-only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    by = {r["name"]: r["value"] for r in rows}
    made = []
    arms = [(r["name"].removesuffix("_tok_s"), r["value"]) for r in rows
            if r["unit"] == "tok/s" and not r["name"].startswith("server_")]
    if arms:
        fig, ax = plt.subplots(figsize=(9, 0.4 * len(arms) + 1.5))
        ax.barh([a for a, _ in arms], [v for _, v in arms])
        ax.set_xlabel("tokens / s")
        ax.set_title("decode speed per arm (embedded model)")
        fig.tight_layout()
        made.append(out / "tok_s_per_arm.png")
        fig.savefig(made[-1], dpi=110)
    ks = [k for k in (1, 2, 4, 8) if f"spec_constrained_k{k}_acceptance" in by]
    if ks:
        fig, ax1 = plt.subplots(figsize=(6, 4))
        ax1.plot(ks, [by[f"spec_constrained_k{k}_acceptance"] for k in ks], "o-",
                 label="acceptance")
        ax1.set_xlabel("k (tokens proposed per round)")
        ax1.set_ylabel("acceptance")
        ax1.set_ylim(0, 1.05)
        ax2 = ax1.twinx()
        ax2.plot(ks, [by[f"spec_constrained_k{k}_tok_s"] for k in ks], "s--", color="C1",
                 label="tok/s")
        ax2.set_ylabel("tokens / s")
        ax1.set_title("constrained speculative decoding vs k (draft = target)")
        fig.tight_layout()
        made.append(out / "acceptance_vs_k.png")
        fig.savefig(made[-1], dpi=110)
    return made


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:  # this checkout's server against a commit's (bench/compare.py)
        from bench import compare

        return compare.main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m bench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    rp = sub.add_parser("report", help="run the suites and print the figures")
    sub.add_parser("compare", help="this checkout's server against REV's, side by side "
                   "(python -m bench compare --help)")
    size = rp.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer rounds (under 10 minutes)")
    size.add_argument("--smoke", action="store_true",
                      help="every suite once at its smallest sizes: the rows are written, "
                      "their figures measure nothing (a few minutes)")
    rp.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    rp.add_argument("--plots", metavar="DIR", help="write PNG plots")
    rp.add_argument("pytest_args", nargs="*", help="extra pytest arguments")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = dict(os.environ, SPECDEC_BENCH_OUT=str(out))
        if args.quick:
            env["SPECDEC_BENCH_QUICK"] = "1"
        if args.smoke:
            env["SPECDEC_BENCH_SMOKE"] = "1"
        cmd = [sys.executable, "-m", "pytest", str(Path(__file__).parent), "-q",
               "-p", "no:cacheprovider", "--benchmark-disable-gc", *args.pytest_args]
        proc = subprocess.run(cmd, env=env)
        if not out.exists():
            print("bench: the suites wrote no figures", file=sys.stderr)
            return proc.returncode or 1
        data = json.loads(out.read_text())
    rows = data["rows"]
    print(f"\n{data['machine']}")
    if args.smoke:
        print("smoke run: every suite at its smallest sizes; the figures measure nothing")
    print(f"{'figure':44} {'value':>10} {'unit':9} how measured")
    for r in rows:
        print(f"{r['name']:44} {r['value']:10.3f} {r['unit']:9} {r['note']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    if args.plots:
        for p in plots(rows, Path(args.plots)):
            print(f"plot: {p}")
    missing = [n for n in REQUIRED if n not in {r["name"] for r in rows}]
    if missing:
        print(f"bench: missing rows: {missing}", file=sys.stderr)
        return 1
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
