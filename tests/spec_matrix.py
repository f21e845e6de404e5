"""Short-prompt workload for the embedded speculative tests, and the OpenBLAS matrix runner.

`python -m tests.spec_matrix OUT.json` (under SPECDEC_BLAS=openblas) decodes a small matrix
{plain, spec k=2,4 with draft masking on/off} x greedy x a few schemas with the embedded
model, alone and all together in one batch, compares every cell with the oracle, and writes
the divergences with the oracle's top-2 margin at the diverging position.
"""

from __future__ import annotations

import json
import sys

from bench.workloads import CASES, Case

SHORT_SYSTEM = "Reply with JSON."
SHORT_CASES = [c for c in CASES if c.name in ("flat", "enums")]
NEAR_TIE = 0.05  # logit units; a flip beyond this would be a real bug


def short_prompt(engine, case: Case) -> list[int]:
    return engine.chat_prompt([{"role": "system", "content": SHORT_SYSTEM},
                               {"role": "user", "content": case.user}], constrained=True)


def main(out_path: str) -> int:
    from specdec.blas import active, ensure_blas

    ensure_blas("openblas")
    import specdec
    from oracle import BudgetOracle, reference_decode, report
    from specdec.engine import Engine
    from specdec.grammar import Constraint
    from specdec.speculative import SpecConfig

    m = specdec.load()
    engine = Engine(m, m)
    cases = [c for c in CASES if c.name in ("flat", "nested", "enums")]
    cells, same, divergences = 0, 0, []
    oracles: dict = {}  # case name -> the oracle's decode (one each, alone and batched)
    for case in cases:
        ids = short_prompt(engine, case)
        c = Constraint(case.kind, case.value)  # type: ignore[arg-type]
        oracle = oracles[case.name] = reference_decode(
            m.model, ids, vocab_size=m.vocab_size, eos_token_ids=m.eos_token_ids,
            max_tokens=32, matcher=engine.compiler.compile(c).matcher(),
            budget=BudgetOracle.of(engine.compiler.tokenizer, m.vocab_size, m.eos_token_ids, 32))
        for spec in (None, SpecConfig(2, True), SpecConfig(4, True), SpecConfig(4, False)):
            r = engine.generate(engine.prepare(ids, constraint=c, max_tokens=32, spec=spec))
            cells += 1
            d = report(oracle, r.tokens)
            if d is None:
                same += 1
            else:
                divergences.append({"case": case.name, "k": spec.k if spec else 0,
                                    "draft_masking": spec.draft_masking if spec else None,
                                    "index": d.index, "margin": d.margin})
    # The same requests decoded together, one batch (continuous-batching rounds): on a BLAS
    # that is not batch-invariant a request's logits move with its neighbours, so only
    # near-ties may flip.
    from specdec.core import new_state, prefill, run_round
    from specdec.prepare import Request

    batch = []
    for case in cases:
        ids = short_prompt(engine, case)
        c = Constraint(case.kind, case.value)  # type: ignore[arg-type]
        g = engine.compiler.compile(c)
        for spec in (None, SpecConfig(4, True)):
            batch.append((case.name, spec, new_state(
                engine.models, Request(tuple(ids), max_tokens=32, spec=spec),
                m.eos_token_ids, matcher=g.matcher())))
    for _, _, st in batch:
        prefill(engine.models, st)
    outs: list[list[int]] = [[] for _ in batch]
    while not all(st.done for _, _, st in batch):
        run_round(engine.models, [st for _, _, st in batch])
        for o, (_, _, st) in zip(outs, batch):
            o += st.new_tokens
    for o, (name, spec, st) in zip(outs, batch):
        cells += 1
        d = report(oracles[name], o)
        if d is None:
            same += 1
        else:
            divergences.append({"case": name, "k": spec.k if spec else 0, "batched": True,
                                "index": d.index, "margin": d.margin})
    res = {"blas": active(), "cells": cells, "identical": same, "near_tie": NEAR_TIE,
           "divergences": divergences}
    with open(out_path, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
