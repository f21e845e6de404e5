"""The peer way: what an mlx-lm user does today — `generate_step` /
`speculative_generate_step` with an llguidance logits processor — against ours, same model,
prompts and schemas, arms back to back per prompt."""

from __future__ import annotations

import statistics
import time

import llguidance.numpy as llnp
import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step, speculative_generate_step

from bench import results
from bench.workloads import CASES
from specdec.events import Finished
from specdec.grammar import Constraint
from specdec.speculative import SpecConfig

QUICK = results.QUICK
ROUNDS = results.rounds(1)
MAX_TOKENS = 48
K = 4


class LLGuidanceProcessor:
    """An mlx-lm logits processor: syncs the matcher to the token history it is shown (which
    shrinks after a speculative rejection), fills the mask, applies it with mx.where."""

    def __init__(self, matcher, prompt_len: int, vocab: int) -> None:
        self.m, self.prompt_len, self.vocab = matcher, prompt_len, vocab
        self.consumed: list[int] = []
        self.bitmask = llnp.allocate_token_bitmask(1, vocab)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        gen = tokens.tolist()[self.prompt_len:]
        common = 0
        while (common < len(gen) and common < len(self.consumed)
               and gen[common] == self.consumed[common]):
            common += 1
        if len(self.consumed) > common:
            self.m.rollback(len(self.consumed) - common)
            del self.consumed[common:]
        for t in gen[common:]:
            self.m.consume_token(t)
            self.consumed.append(t)
        llnp.fill_next_token_bitmask(self.m, self.bitmask, 0)
        bits = np.unpackbits(self.bitmask[0].view(np.uint8), bitorder="little")[:self.vocab]
        return mx.where(mx.array(bits.astype(bool)), logits, -mx.inf)


def timed(stream, eos: set[int], limit: int) -> tuple[int, float]:
    """Tokens after the first and the seconds they took (decode speed, prefill excluded)."""
    n, t_first = 0, None
    for tok in stream:
        tok = int(tok)
        if t_first is None:
            t_first = time.perf_counter()
        if tok in eos:
            break
        n += 1
        if n >= limit:
            break
    assert t_first is not None
    return max(n - 1, 1), time.perf_counter() - t_first


def ev_tokens(ev) -> tuple[int, ...]:
    """The output tokens an event carries (text deltas carry theirs; the end, none)."""
    return getattr(ev, "tokens", ()) if not isinstance(ev, Finished) else ()


def test_ours_vs_peer(benchmark, engine):
    from specdec.engine import Engine

    ours_spec = Engine(engine.target, engine.target, SpecConfig(K))
    model, V = engine.target.model, engine.target.vocab_size
    eos = set(engine.target.eos_token_ids)
    cases = [c for c in CASES if c.kind == "json_schema"][:4]
    ratios: dict[str, list[float]] = {"plain": [], "spec": [], "jump": []}
    jump = Engine(engine.target, None, SpecConfig(8))

    def one_round() -> None:
        for case in cases:
            c = Constraint(case.kind, case.value)  # type: ignore[arg-type]
            ids = engine.chat_prompt(case.messages(), constrained=True)
            g = engine.compiler.compile(c)
            for mode in ("plain", "spec", "jump"):
                eng = {"plain": engine, "spec": ours_spec, "jump": jump}[mode]
                spec = {"plain": None, "spec": SpecConfig(K), "jump": SpecConfig(8)}[mode]
                req = eng.prepare(ids, constraint=c, max_tokens=MAX_TOKENS, spec=spec)
                n_o, s_o = timed((t for ev in eng.submit(req) for t in ev_tokens(ev)), eos,
                                 MAX_TOKENS)
                proc = LLGuidanceProcessor(g.matcher(), len(ids), V)
                prompt = mx.array(ids)
                if mode in ("plain", "jump"):
                    peer = (t for t, _ in generate_step(prompt, model, max_tokens=MAX_TOKENS,
                                                        logits_processors=[proc]))
                else:
                    peer = (t for t, _, _ in speculative_generate_step(
                        prompt, model, model, num_draft_tokens=K, max_tokens=MAX_TOKENS,
                        logits_processors=[proc]))
                n_p, s_p = timed(peer, eos, MAX_TOKENS)
                ratios[mode].append((n_o / s_o) / (n_p / s_p))

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    note = f"decode tok/s ratio, {ROUNDS} rounds x {len(cases)} schemas, back to back"
    results.add("ours_over_peer_plain_constrained", statistics.median(ratios["plain"]), "ratio",
                note + "; peer: mlx_lm generate_step + llguidance processor")
    results.add("ours_over_peer_spec_constrained", statistics.median(ratios["spec"]), "ratio",
                note + f"; peer: speculative_generate_step (draft = target, k={K})")
    results.add("ours_jump_forward_over_peer_plain_constrained",
                statistics.median(ratios["jump"]), "ratio",
                note + "; ours: no draft model, forced-token runs in one forward (the "
                "default for constrained requests without a draft)")
