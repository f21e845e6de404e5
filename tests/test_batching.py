"""Batch invariance: a request's output does not depend on which requests share its rounds.

As vLLM tests it: a "needle" request decoded alone, then inside random batches (sizes 2..8,
a random position, neighbours of every kind — greedy, seeded top-k and top-p, constrained and
free, plain and speculative with other k — joining and leaving mid-flight). On the reference
BLAS this suite runs on, the needle's tokens must be identical, and equal to the oracle's.
The control shows the logits comparison can fail: on OpenBLAS (not batch-invariant) the same
comparison finds differences.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import subprocess
import sys
import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from bench.workloads import CASES
from oracle import BudgetOracle, reference_decode
from specdec import blas, ragged
from specdec.budget import Closing, need
from specdec.core import Models, new_state, prefill, run_round
from specdec.grammar import Constraint
from specdec.lookup import SuffixStore
from specdec.prepare import Request
from specdec.sampling import SamplingParams
from specdec.speculative import SpecConfig
from tests import tally
from tests.tiny import EOS, WIDTH, drain, tiny_llama
from tests.tiny import rounds as decode_rounds

TREE_SPEC = SpecConfig(4, lookup=True, draft_min_prob=0.3, tree=8, tree_min_score=0.02)
SCHEMAS = [Constraint.json_schema(c.value) for c in CASES if c.kind == "json_schema"][:3]
NEEDLE_PARAMS = {"greedy": SamplingParams(), "top-k": SamplingParams(0.9, top_k=40, seed=5),
                 "top-p": SamplingParams(1.1, top_p=0.8, seed=9)}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(1234)


@pytest.fixture(scope="module")
def models(target):
    # An unrelated draft (many rejections), unsure enough that token trees branch.
    return Models(target, WIDTH, tiny_llama(99, head_scale=2), WIDTH)


def _request(rng: random.Random, compiler, prompt, kind: str | None = None,
             steered: bool = False) -> dict:
    """A random request of any kind (or the needle kind asked for; `steered`: a schema
    with a budget just above its minimum)."""
    kind = kind or rng.choice(sorted(NEEDLE_PARAMS))
    spec = rng.choice([None, SpecConfig(2), SpecConfig(4, draft_masking=False),
                       SpecConfig(8, lookup=True), SpecConfig(3, forced_drafting=False),
                       SpecConfig(4, lookup=True, suffix=True),
                       TREE_SPEC])
    constraint = rng.choice(SCHEMAS if steered else [None, *SCHEMAS])
    p = NEEDLE_PARAMS[kind]
    if p.seed is not None:
        p = SamplingParams(p.temperature, p.top_p, p.top_k, rng.randrange(1000))
    extra = [rng.randrange(300, 9000) for _ in range(rng.randrange(0, 6))]
    # Most constrained requests close in time for their budget (`budget`), a few tokens
    # above their minimum, so the rule steers their ends; the others are cut where it ends.
    closing = None
    max_tokens = rng.randrange(6, 24)
    if constraint is not None and (steered or rng.random() < 0.75):
        order = compiler.closing_order(WIDTH)
        closing = Closing(order, need(compiler.compile(constraint).matcher(), order))
        max_tokens = closing.minimum + rng.randrange(0, 3 if steered else 8)
    return {"prompt": list(prompt) + extra, "params": p, "spec": spec,
            "constraint": constraint, "max_tokens": max_tokens, "closing": closing}


# Earlier answers for suffix proposals: every request decoded alone adds its output, so the
# store differs between a needle's run alone and its runs in batches (proposals change; the
# tokens may not).
STORE = SuffixStore()


def _key(r) -> str | None:
    return r["constraint"] and json.dumps(r["constraint"].value, sort_keys=True)


def _state(models, compiler, r):
    m = compiler.compile(r["constraint"]).matcher() if r["constraint"] else None
    req = Request(tuple(r["prompt"]), sampling=r["params"], max_tokens=r["max_tokens"],
                  spec=r["spec"], closing=r["closing"])
    return new_state(models, req, EOS, matcher=m, suffixes=STORE, suffix_key=_key(r))


def _alone(models, compiler, r):
    m = compiler.compile(r["constraint"]).matcher() if r["constraint"] else None
    out = drain(decode_rounds(models, r["prompt"], max_tokens=r["max_tokens"],
                              eos_token_ids=EOS, params=r["params"], spec=r["spec"],
                              matcher=m, suffixes=STORE, suffix_key=_key(r),
                              closing=r["closing"] and r["closing"].order))
    STORE.add(_key(r), out[0], lead=r["prompt"])
    return out


LOAD_SKIPS: list[int] = []  # per batched needle run: rounds its draft model was left out
BRANCHED: list[int] = []  # per batched needle run: its token trees' branch proposals
STEERED: list[int] = []  # per batched needle run: positions the budget rule changed


def _in_batch(models, compiler, needle, rng: random.Random):
    """Run the needle inside a random batch; neighbours join and leave mid-flight. The
    draft model may be left out of rounds with more drafting requests than a random limit
    (its cache then catches up when it drafts again)."""
    models = dataclasses.replace(models, draft_max_batch=rng.choice([None, 1, 3]))
    size = rng.randrange(2, 9)
    pending = [_request(rng, compiler, needle["prompt"][:4]) for _ in range(size - 1)]
    joins = sorted(rng.randrange(0, 6) for _ in pending)  # the round each neighbour joins
    s = _state(models, compiler, needle)
    prefill(models, s)
    active = [s]
    out, rnd = [], 0
    while not s.done:
        while pending and joins[0] <= rnd:
            joins.pop(0)
            n = _state(models, compiler, pending.pop(0))
            prefill(models, n)
            active.insert(rng.randrange(len(active) + 1), n)  # at a random position
        run_round(models, active)
        out += s.new_tokens
        active = [a for a in active if not a.done or a is s]
        if rng.random() < 0.15 and len(active) > 1:  # a neighbour leaves early (cancelled)
            active.remove(rng.choice([a for a in active if a is not s]))
        rnd += 1
    assert s.error is None, s.error
    LOAD_SKIPS.append(s.stats.draft_load_skips)
    BRANCHED.append(s.stats.branched)
    STEERED.append(s.stats.budget_steered)
    tally.record_sources("tiny needle in a random batch", s.stats)
    return out, s.finish


@pytest.mark.parametrize("kind", sorted(NEEDLE_PARAMS))
def test_needle_alone_equals_needle_in_random_batches_and_the_oracle(models, compiler, prompt,
                                                                      kind):
    rng = random.Random(f"needle-{kind}")
    start = len(LOAD_SKIPS)
    for trial in range(4):
        needle = _request(rng, compiler, prompt, kind, steered=trial == 1)
        if trial == 0:  # one needle verifies token trees (its neighbours may too)
            needle["spec"] = TREE_SPEC
        want = _alone(models, compiler, needle)
        m = compiler.compile(needle["constraint"]).matcher() if needle["constraint"] else None
        p = needle["params"]
        oracle = reference_decode(models.target, needle["prompt"], vocab_size=WIDTH,
                                  eos_token_ids=EOS, max_tokens=needle["max_tokens"],
                                  matcher=m, temperature=p.temperature, top_k=p.top_k,
                                  top_p=p.top_p, seed=p.seed or 0,
                                  budget=needle["closing"] and BudgetOracle.of(
                                      compiler.tokenizer, WIDTH, EOS, needle["max_tokens"]))
        assert want[0] == list(oracle.tokens), f"alone vs oracle, trial {trial}"
        assert want[1] == oracle.finish_reason, f"alone vs oracle, trial {trial}"
        if needle["closing"] is not None:  # the budget closed its document
            done = compiler.compile(needle["constraint"]).matcher()
            assert done.try_consume_tokens(want[0]) == len(want[0]) and done.is_accepting()
        for b in range(3):
            got = _in_batch(models, compiler, needle, rng)
            same = got == want
            tally.record("tiny: needle in a random batch vs alone", same)
            assert same, f"trial {trial} batch {b}: {got} != {want} ({needle})"
    assert any(LOAD_SKIPS[start:]), "no batched run left the draft model out (path untested)"
    assert any(BRANCHED[start:]), "no batched run verified a token tree (path untested)"
    assert any(STEERED[start:]), "no batched needle was steered by its budget (path untested)"


def _segments_alone(model, prompt, steps):
    c = make_prompt_cache(model)
    outs = [model(mx.array([prompt]), cache=c)[0]]
    outs += [model(mx.array([s]), cache=c)[0] for s in steps]
    mx.eval(outs)
    return [np.array(o) for o in outs]


def _segments_batched(model, prompt, steps, rng: random.Random, horizons=(None,)):
    def cache():  # a slab slot, or storage of its own when the horizon drawn is past the limit
        return ragged.make_cache(model, rng.choice(horizons) if len(horizons) > 1 else None)

    c = cache()
    neighbours = [cache() for _ in range(rng.randrange(1, 8))]
    outs = []
    for seg in [prompt, *steps]:
        batch = [([rng.randrange(300, 9000) for _ in range(rng.randrange(1, 9))], nc)
                 for nc in neighbours]
        pos = rng.randrange(len(batch) + 1)
        batch.insert(pos, (seg, c))
        outs.append(ragged.forward(model, batch)[pos])
    mx.eval(outs)
    return [np.array(o) for o in outs]


def logits_invariance(model, seed: int = 0, trials: int = 3,
                      horizons=(None,)) -> tuple[int, float]:
    """Compare a needle's logits alone (mlx-lm's own forward) and inside ragged batches:
    (rows differing, max |diff|). Each cache is made with a horizon drawn from `horizons`."""
    rng = random.Random(seed)
    prompt = [rng.randrange(300, 9000) for _ in range(20)]
    steps = [[rng.randrange(300, 9000) for _ in range(n)] for n in (1, 3, 1, 5, 2)]
    want = _segments_alone(model, prompt, steps)
    rows, worst = 0, 0.0
    for _ in range(trials):
        got = _segments_batched(model, prompt, steps, rng, horizons)
        for a, b in zip(want, got):
            rows += int((a != b).any(axis=-1).sum())
            worst = max(worst, float(np.abs(a - b).max()))
    return rows, worst


def test_ragged_forward_is_bitwise_batch_invariant_on_the_reference_blas(embedded):
    assert blas.active() == "reference"
    assert ragged.supports(embedded.model)
    rows, worst = logits_invariance(embedded.model)
    tally.NOTES.append(f"ragged forward, embedded model, reference BLAS: {rows} rows differ "
                       f"(max |diff| {worst:g})")
    assert (rows, worst) == (0, 0.0)


def test_ragged_forward_is_bitwise_invariant_next_to_caches_of_their_own(embedded):
    # Needle and neighbours each a slab slot or storage of its own (a horizon past the
    # slot limit): a round batches the slab's short rows and runs the others alone, in one
    # pass; the needle's logits are still mlx-lm's alone, bit for bit.
    assert blas.active() == "reference"
    rows, worst = logits_invariance(embedded.model, seed=1, trials=1,
                                    horizons=(None, 64, 1 << 20))
    tally.NOTES.append(f"ragged forward, embedded model, slab and own storage: {rows} rows "
                       f"differ (max |diff| {worst:g})")
    assert (rows, worst) == (0, 0.0)


def test_attention_groups_split_by_length_at_the_least_padded_cost():
    rng = random.Random(3)
    for _ in range(300):
        n = rng.randrange(1, 7)
        lens = [rng.choice([1, 1, 2, 3, rng.randrange(4, 17)]) for _ in range(n)]
        ends = [rng.randrange(1, 300) + m for m in lens]
        groups = ragged._groups(lens, ends, 9)
        assert sorted(i for g in groups for i in g) == list(range(n))

        def cost(gs):
            return sum(9 * len(g) * max(lens[i] for i in g) * max(ends[i] for i in g)
                       + ragged.GROUP_OVERHEAD for g in gs)

        # Brute force over every split of the length order into runs: none is cheaper.
        order = sorted(range(n), key=lambda i: (lens[i], i))
        best = min(cost([order[a:b] for a, b in zip((0, *cuts), (*cuts, n))])
                   for r in range(n) for cuts in itertools.combinations(range(1, n), r))
        assert cost(groups) == best
    # One long run among short rows gets a group of its own; equal rows share one.
    assert ragged._groups([1, 9, 1, 1], [60, 60, 60, 60], 9) == [[0, 2, 3], [1]]
    assert ragged._groups([2, 2, 2], [50, 70, 60], 9) == [[0, 1, 2]]


def test_grouped_attention_over_gathered_slots_is_bitwise_invariant(embedded):
    """Long and short segments interleaved over the slab's slots: attention splits into
    groups whose slots are not contiguous (gathered); every request's logits still equal its
    own forward alone (mlx-lm's), bit for bit on the reference BLAS."""
    assert blas.active() == "reference"
    model = embedded.model
    rng = random.Random(1)
    lens = [1, 12, 2, 1, 9, 1]
    prompts = [[rng.randrange(300, 9000) for _ in range(rng.randrange(5, 30))] for _ in lens]
    steps = [[rng.randrange(300, 9000) for _ in range(n)] for n in lens]
    want = []
    for p, st in zip(prompts, steps):
        c = make_prompt_cache(model)
        model(mx.array([p]), cache=c)
        want.append(np.array(model(mx.array([st]), cache=c)[0]))
    caches = [ragged.make_cache(model) for _ in lens]
    for p, c in zip(prompts, caches):
        ragged.forward(model, [(p, c)], rows=[0])
    slots = [c[0].slot.i for c in caches]
    groups = ragged._groups(lens, [len(p) + n for p, n in zip(prompts, lens)],
                            model.args.num_attention_heads)
    gathered = [g for g in groups
                if sorted(slots[i] for i in g) != list(range(min(slots[i] for i in g),
                                                             min(slots[i] for i in g) + len(g)))]
    assert len(groups) >= 2 and gathered, (groups, slots)  # the layout this test is about
    got = ragged.forward(model, list(zip(steps, caches)))
    for i, (a, b) in enumerate(zip(want, got)):
        assert np.array_equal(a, np.array(b)), f"segment {i} (len {lens[i]}) differs"


@pytest.mark.skipif(blas.openblas_path() is None,
                    reason="OpenBLAS not installed (apt-get install libopenblas0-pthread)")
def test_control_openblas_is_not_batch_invariant_so_the_comparison_can_fail():
    # The same comparison under a BLAS whose results depend on the number of rows: it must
    # see differences, or the test above could not fail.
    env = dict(os.environ, SPECDEC_BLAS="openblas")
    env.pop("SPECDEC_BLAS_REEXEC", None)
    code = ("from specdec.blas import ensure_blas; ensure_blas('openblas')\n"
            "import json, specdec; from specdec import blas\n"
            "from tests.test_batching import logits_invariance\n"
            "rows, worst = logits_invariance(specdec.load().model)\n"
            "print(json.dumps([blas.active(), rows, worst]))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    active, rows, worst = json.loads(out.stdout.strip().splitlines()[-1])
    tally.NOTES.append(f"control, OpenBLAS: {rows} rows differ (max |diff| {worst:g})")
    assert active == "openblas" and rows > 0 and worst > 0


@pytest.mark.parametrize("stored", ["none", "target only", "both"])
def test_chunked_prefill_from_any_store_state_equals_decoding_alone(models, compiler, prompt,
                                                                    stored):
    # Arrivals are prefilled a chunk per round, or restored from a stored target state (the
    # draft's cache then restored too, or prefilled whole at once and stored).
    from specdec.core import prefill_arrivals
    from specdec.decode import PromptKVCache

    r = _request(random.Random(3), compiler, prompt, "greedy")
    r["spec"] = SpecConfig(4)  # uses the draft: two caches to prefill
    want = _alone(models, compiler, r)
    kv = PromptKVCache()
    head = r["prompt"][:-1]
    if stored != "none":
        seed = _state(models, compiler, r)
        prefill(models, seed)
        kv.store(models.target, head, seed.t_cache)
        if stored == "both":
            kv.store(models.draft, head, seed.d_cache)
    s = _state(models, compiler, r)
    chunks = 0
    while s.to_prefill:
        prefill_arrivals(models, [s], 3, kv)
        chunks += 1
    assert chunks == (-(-len(head) // 3) if stored == "none" else 1)
    assert [s.t_cache[0].offset, s.d_cache[0].offset] == [len(head), len(head)]
    assert kv.has(models.target, head) and kv.has(models.draft, head)  # kept for the next
    out = []
    while not s.done:
        run_round(models, [s])
        out += s.new_tokens
    assert (out, s.finish) == want


@pytest.mark.parametrize("stored", ["a longer prompt, both models", "a prefix, target only",
                                    "too little shared"])
def test_an_arrival_loads_the_longest_stored_prefix_and_decodes_as_alone(models, compiler,
                                                                          prompt, stored):
    # A shared system prompt or a conversation's earlier turns: the store holds another
    # prompt that starts as this one does. Its state, cut back to what is shared, is loaded
    # (the draft's brought to the same position), the rest prefilled in chunks, and the
    # request decodes exactly as alone.
    from specdec.core import prefill_arrivals
    from specdec.decode import PREFIX_MIN, PromptKVCache

    rng = random.Random(5)
    r = _request(rng, compiler, prompt, "greedy")
    r["spec"] = SpecConfig(4)  # uses the draft: two caches to bring to the shared position
    shared = list(prompt) + [rng.randrange(300, 9000) for _ in range(PREFIX_MIN + 4)]
    r["prompt"] = shared + [rng.randrange(300, 9000) for _ in range(7)]
    head = r["prompt"][:-1]
    want = _alone(models, compiler, r)
    if stored == "too little shared":
        shared = shared[:PREFIX_MIN - 1]
    other = dict(r, prompt=(shared + [5, 6, 7, 8, 9] if stored != "a prefix, target only"
                            else shared + [head[len(shared)]]))
    seed = _state(models, compiler, other)
    prefill(models, seed)  # the other prompt's caches hold its prompt but the last token
    kv = PromptKVCache()
    kv.store(models.target, other["prompt"][:-1], seed.t_cache)
    if stored.endswith("both models"):
        kv.store(models.draft, other["prompt"][:-1], seed.d_cache)
    loaded = len(shared) if stored != "too little shared" else 0
    s = _state(models, compiler, r)
    prefill_arrivals(models, [s], 3, kv)
    assert [s.t_cache[0].offset, s.d_cache[0].offset] == [loaded + 3] * 2
    chunks = 1
    while s.to_prefill:
        prefill_arrivals(models, [s], 3, kv)
        chunks += 1
    assert chunks == -(-(len(head) - loaded) // 3)
    out = []
    while not s.done:
        run_round(models, [s])
        out += s.new_tokens
    assert (out, s.finish) == want


def test_arrivals_prefilled_together_equal_each_prefilled_alone(models, compiler, prompt):
    # Several arrivals share one prefill forward per round (a token budget in all); each
    # cache ends holding exactly its prompt and each request decodes as it does alone.
    from specdec.core import prefill_arrivals

    rng = random.Random(17)
    reqs = [_request(rng, compiler, prompt) for _ in range(5)]
    want = [_alone(models, compiler, r) for r in reqs]
    states = [_state(models, compiler, r) for r in reqs]
    rounds = 0
    while any(s.to_prefill for s in states):
        prefill_arrivals(models, states, budget=7)
        rounds += 1
    assert rounds == -(-sum(len(r["prompt"]) - 1 for r in reqs) // 7)
    for s, r in zip(states, reqs):
        assert s.t_cache[0].offset == len(r["prompt"]) - 1
    got: list[list[int]] = [[] for _ in states]
    while not all(s.done for s in states):
        run_round(models, states)
        for g, s in zip(got, states):
            g += s.new_tokens
    assert [(g, s.finish) for g, s in zip(got, states)] == want


def test_the_scheduler_thread_releases_its_mlx_streams_when_it_stops(models, monkeypatch):
    # MLX keeps streams and a compile cache per thread; left to the thread's exit they can
    # abort the process while the interpreter finalizes (a server's SIGTERM then exits -6).
    from specdec.scheduler import Scheduler

    released: list[str] = []
    real = mx.clear_streams

    def clear_streams() -> None:
        released.append(threading.current_thread().name)
        real()

    monkeypatch.setattr(mx, "clear_streams", clear_streams)
    sched = Scheduler(models, lambda req: None, max_batch=2, max_queue=0)
    sched.stop(wait_s=10)
    assert released == ["specdec-scheduler"]


def _random_tree(rng: random.Random, n: int) -> list[int]:
    """Parents of n rows (row 0 the root, -1): each later row under a random earlier one."""
    return [-1] + [rng.randrange(r) for r in range(1, n)]


def _branch(tree: list[int], r: int) -> list[int]:
    out = []
    while r >= 0:
        out.append(r)
        r = tree[r]
    return out[::-1]


def tree_invariance(model, seed: int, trials: int) -> tuple[int, int]:
    """Token trees verified in one forward (alone, and inside ragged batches next to chains
    and other trees) against each branch decoded as a sequence by mlx-lm's own forward: rows
    compared, rows differing. After each tree, one branch is kept (`keep_rows`, then trimmed)
    and the next step's logits compared too."""
    rng = random.Random(seed)
    compared = differ = 0
    for _ in range(trials):
        prompt = [rng.randrange(300, 9000) for _ in range(rng.randrange(3, 30))]
        n = rng.randrange(2, 12)
        tree = _random_tree(rng, n)
        toks = [rng.randrange(300, 9000) for _ in range(n)]
        nxt = rng.randrange(300, 9000)
        c = ragged.make_cache(model)
        ragged.forward(model, [(prompt, c)], rows=[0])
        batch = [(toks, c)]
        others = []
        if rng.random() < 0.7:  # neighbours: chains and trees of their own
            for _ in range(rng.randrange(1, 5)):
                nc = ragged.make_cache(model)
                ragged.forward(model, [([rng.randrange(300, 9000) for _ in range(
                    rng.randrange(2, 20))], nc)], rows=[0])
                m = rng.randrange(1, 9)
                others.append((([rng.randrange(300, 9000) for _ in range(m)], nc),
                               _random_tree(rng, m) if rng.random() < 0.5 else None))
        pos = rng.randrange(len(others) + 1)
        segs = [s for s, _ in others]
        trees = [t for _, t in others]
        segs.insert(pos, (toks, c))
        trees.insert(pos, tree)
        got = np.array(ragged.forward(model, segs, trees=trees)[pos])
        keep = _branch(tree, rng.randrange(n))
        start = c[0].offset - n
        ragged.keep_rows(c, start, keep)
        for layer in c:
            layer.trim(n - len(keep))
        after = np.array(ragged.forward(model, [([nxt], c)])[0])
        for r in range(n):
            path = [toks[b] for b in _branch(tree, r)]
            # the branch's positions one token at a time (how plain decoding computes them)
            seq = make_prompt_cache(model)
            model(mx.array([prompt]), cache=seq)
            for t in path[:-1]:
                model(mx.array([[t]]), cache=seq)
            y = model(mx.array([[path[-1]]]), cache=seq)[0, -1]
            if r in keep and r == keep[-1]:
                z = model(mx.array([[nxt]]), cache=seq)[0, -1]
                compared += 1
                differ += int(not np.array_equal(np.array(z), after[0]))
            compared += 1
            differ += int(not np.array_equal(np.array(y), got[r]))
    return compared, differ


def test_token_trees_verify_each_branch_as_its_sequence_bitwise(target):
    # Each tree row's logits are its branch's, decoded one token at a time, bit for bit; a
    # kept branch moved together decodes on as the sequence does.
    assert blas.active() == "reference"
    compared, differ = tree_invariance(target, seed=0, trials=40)
    tally.NOTES.append(f"token trees, tiny llama, reference BLAS: {differ} of {compared} rows "
                       "differ from their branch decoded alone")
    assert compared > 200 and differ == 0


def test_token_trees_on_the_embedded_model_bitwise(embedded):
    compared, differ = tree_invariance(embedded.model, seed=1, trials=3)
    tally.NOTES.append(f"token trees, embedded model, reference BLAS: {differ} of {compared} "
                       "rows differ from their branch decoded alone")
    assert compared > 10 and differ == 0
