"""The shipped distilled draft and prompt lookup on the embedded model: draft cost, acceptance,
speculative vs plain constrained decoding, and lookup on an extraction workload. One process,
arms interleaved per prompt."""

from __future__ import annotations

import dataclasses
import statistics
import time

import mlx.core as mx
import pytest

from bench import results
from bench.harness import arm, budgets_note, interleaved, paired_ratio, workload_items
from bench.workloads import CASES, EXTRACTION
from specdec.speculative import SpecConfig

ROUNDS = results.rounds(1)
K = 4
MAX_TOKENS = 64
EXTRACTION_MAX_TOKENS = results.size(128, 128, 48)  # answers copy long spans
BENCH_CASES = [c for c in CASES if c.kind in ("json_schema", "regex")]
GATED = SpecConfig(K, draft_min_prob=0.3)  # drafting ends below p = 0.3 (serving default)
# the shipped defaults' chain (`SpecConfig.serving()` without earlier answers and trees)
SERVING = dataclasses.replace(SpecConfig.serving(), suffix=False, tree=0)


@pytest.fixture(scope="module")
def draft():
    import specdec

    return specdec.load("default-draft")


@pytest.fixture(scope="module")
def distilled(engine, draft):
    from specdec.engine import Engine

    return Engine(engine.target, draft, SpecConfig(K))


def _step_ms(model, n: int) -> list[float]:
    """ms per single-token forward with ~100 tokens of context, n samples."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(100, 200))]), cache=cache))
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        mx.eval(model(mx.array([[300 + i]]), cache=cache))
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def test_draft_cost_over_target_step(benchmark, engine, draft):
    n = results.size(20, 60, 8)
    def run():
        t, d = [], []
        for _ in range(4):  # alternate so load changes hit both alike
            t += _step_ms(engine.target.model, n // 4)
            d += _step_ms(draft.model, n // 4)
        return t, d
    t, d = benchmark.pedantic(run, rounds=1, iterations=1)
    tm, dm = statistics.median(t), statistics.median(d)
    results.add("target_step_ms", tm, "ms", f"single-token forward, ~100 context, median of {n}")
    results.add("draft_step_ms", dm, "ms", f"distilled draft, same method, median of {n}")
    results.add("draft_cost_over_target_step", dm / tm, "ratio", "draft step / target step")


def test_distilled_spec_vs_plain(benchmark, distilled):
    items = workload_items(distilled, BENCH_CASES, MAX_TOKENS)
    arms = {"plain_constrained": arm(True, None),
            "spec_distilled_constrained": arm(True, GATED),
            "spec_distilled_ungated_constrained": arm(True, SpecConfig(K)),
            "spec_serving_defaults_constrained": arm(True, SERVING),
            "plain_unconstrained": arm(False, None),
            "spec_distilled_unconstrained": arm(False, GATED)}
    res = benchmark.pedantic(lambda: interleaved(distilled, items, arms, ROUNDS), rounds=1,
                             iterations=1)
    note = (f"distilled draft, k={K}, drafting gated at p=0.3; {ROUNDS} rounds x {len(items)} "
            f"prompts; {budgets_note(items, MAX_TOKENS)}")
    for name, r in res.items():
        results.add(f"{name}_tok_s", r.median_tok_s, "tok/s", note)
    sc, pc = res["spec_distilled_constrained"], res["plain_constrained"]
    results.add("spec_over_plain_constrained_distilled", paired_ratio(sc, pc), "ratio", note)
    results.add("spec_over_plain_unconstrained_distilled",
                paired_ratio(res["spec_distilled_unconstrained"], res["plain_unconstrained"]),
                "ratio", note)
    results.add("spec_over_plain_constrained_distilled_ungated",
                paired_ratio(res["spec_distilled_ungated_constrained"], pc), "ratio",
                "as above, the draft proposing all k every round")
    results.add("spec_over_plain_constrained_serving_defaults",
                paired_ratio(res["spec_serving_defaults_constrained"], pc), "ratio",
                note + "; + prompt lookup (prompts that give little to copy)")
    results.add("draft_acceptance_distilled",
                sc.total("drafted_accepted") / max(sc.total("drafted"), 1), "fraction",
                "draft-model proposals accepted (forced ones excluded), constrained")
    ung = res["spec_distilled_ungated_constrained"]
    results.add("draft_acceptance_distilled_ungated",
                ung.total("drafted_accepted") / max(ung.total("drafted"), 1), "fraction",
                "draft-model proposals accepted when it drafts all k, constrained")
    results.add("draft_acceptance_distilled_unconstrained",
                res["spec_distilled_unconstrained"].total("drafted_accepted")
                / max(res["spec_distilled_unconstrained"].total("drafted"), 1), "fraction",
                "draft-model proposals accepted, unconstrained")
    results.add("spec_acceptance_distilled", sc.total("accepted") / max(sc.total("proposed"), 1),
                "fraction", "all proposals (forced + drafted), constrained")
    results.add("grammar_cuts_distilled", sc.total("grammar_cuts"), "cuts", note)
    assert sc.total("grammar_cuts") == 0


def test_lookup_on_extraction(benchmark, engine, distilled):
    from specdec.engine import Engine

    no_draft = Engine(engine.target, None, SpecConfig(K))
    items = workload_items(distilled, EXTRACTION, EXTRACTION_MAX_TOKENS)

    def on(e, spec):
        def run(_, ids, c, n):
            return e.generate(e.prepare(ids, constraint=c, max_tokens=n, spec=spec))
        return run

    arms = {"plain_constrained": arm(True, None),
            "spec_distilled_lookup": on(distilled, SERVING),
            "spec_distilled_no_lookup": on(distilled, GATED),
            "lookup_only": on(no_draft, SpecConfig(K, lookup=True))}
    res = benchmark.pedantic(lambda: interleaved(distilled, items, arms, ROUNDS), rounds=1,
                             iterations=1)
    note = (f"extraction, k={K}, gated at p=0.3; {ROUNDS} rounds x {len(items)} prompts; "
            f"{budgets_note(items, EXTRACTION_MAX_TOKENS)}")
    for name, r in res.items():
        results.add(f"extraction_{name}_tok_s", r.median_tok_s, "tok/s", note)
    pc, sl = res["plain_constrained"], res["spec_distilled_lookup"]
    results.add("spec_over_plain_constrained_lookup", paired_ratio(sl, pc), "ratio",
                note + "; forced, then lookup, then the distilled draft")
    results.add("spec_over_plain_constrained_lookup_only", paired_ratio(res["lookup_only"], pc),
                "ratio", note + "; no draft model: forced + lookup")
    results.add("spec_over_plain_constrained_extraction_no_lookup",
                paired_ratio(res["spec_distilled_no_lookup"], pc), "ratio", note)
    results.add("lookup_acceptance", sl.total("looked_up_accepted")
                / max(sl.total("looked_up"), 1), "fraction", "looked-up proposals accepted")
    results.add("lookup_fraction_of_tokens", sl.total("looked_up_accepted")
                / max(sum(sl.tokens), 1), "fraction", "output tokens that came from lookup")
