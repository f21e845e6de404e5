"""KV memory (specdec.ragged's storage): one long request does not size the others' slots,
and what it used is given back when it leaves.

A model's shared slab holds slots of up to `SLOT_POSITIONS` positions, its capacity
following the longest live slot; a request whose horizon is longer, or that grows past the
limit, has storage of its own. These tests run tiny random llamas with a 512-position limit
(each test a fresh model, so a fresh slab with that limit) and check capacities and bytes,
the memory the process really holds (MLX's active memory, RSS), and that a request's logits
are bitwise the same whichever storage its neighbours use (on the reference BLAS).
"""

from __future__ import annotations

import ctypes
import gc
import os
import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from oracle import reference_decode
from specdec import blas, ragged
from specdec.core import Models, new_state, prefill_arrivals, run_round
from specdec.prepare import Request
from specdec.sampling import SamplingParams
from specdec.speculative import SpecConfig
from tests import tally
from tests.tiny import EOS, WIDTH, tiny_llama

LIMIT = 512  # positions a slab slot may hold in these tests
# tiny_llama: 2 layers x 2 kv heads x (16 + 16) dims x 4 bytes (float32)
TINY_BYTES_PER_POSITION = 2 * 2 * (16 + 16) * 4


@pytest.fixture
def model(monkeypatch):
    """A fresh tiny llama: its slab is made on first use, with the test's limit."""
    monkeypatch.setattr(ragged, "SLOT_POSITIONS", LIMIT)
    return tiny_llama(7)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 9000) for _ in range(n)]


def _shorts(model, rng: random.Random, n: int = 3) -> list[list]:
    """n short requests' caches, prompts prefilled (20 tokens each)."""
    caches = [ragged.make_cache(model, horizon=64) for _ in range(n)]
    ragged.forward(model, [(_tokens(rng, 20), c) for c in caches], rows=[0] * n)
    return caches


def _round(model, rng: random.Random, shorts: list[list], seg=None) -> None:
    """One forward: a decode row for every short request and `seg` (tokens, cache), if any."""
    batch = [([rng.randrange(300, 9000)], c) for c in shorts] + ([seg] if seg else [])
    mx.eval(ragged.forward(model, batch, [1] * len(batch)))  # (one row of logits each)


def _rss() -> int:
    """Resident bytes of this process (/proc/self/statm: pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim_heap() -> None:
    """Hand the C heap's free pages back (glibc's malloc_trim). Buffers under glibc's mmap
    threshold (raised up to 32 MiB by earlier frees) come from the heap, whose freed pages
    stay resident until trimmed: without this, a baseline taken after other tests counts
    free pages a new buffer then reuses, and RSS shows less than the buffer's storage."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS): nothing to trim
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def _settled_rss() -> int:
    gc.collect()
    mx.clear_cache()  # MLX keeps freed buffers for reuse; hand them back first
    _trim_heap()
    return _rss()


def test_kv_bytes_per_position_is_what_a_position_of_storage_takes(model):
    assert ragged.kv_bytes_per_position(model) == TINY_BYTES_PER_POSITION
    cache = ragged.make_cache(model, horizon=1024)  # storage of its own: one slot
    ragged.forward(model, [(_tokens(random.Random(1), 300), cache)], rows=[0])
    own = cache[0].slot.slab
    assert own.own and own.slots == 1
    assert own.nbytes == own.cap * TINY_BYTES_PER_POSITION
    assert ragged.kv_nbytes(model) == own.nbytes


def test_a_long_request_with_a_long_horizon_does_not_grow_the_short_ones_slots(model):
    # The long request's horizon is over the limit: it gets storage of its own from the
    # start, its prompt prefilled in chunks that share forwards with the short ones' decode
    # rows (the shorts batched, the chunk alone, in one pass).
    rng = random.Random(0)
    shorts = _shorts(model, rng)
    slab = ragged.slab_of(model)
    before = (slab.cap, slab.slots, slab.nbytes)
    assert before[0] == ragged.Slab.STEP
    long = ragged.make_cache(model, horizon=1400)
    for _ in range(5):  # 1280 positions
        _round(model, rng, shorts, (_tokens(rng, 256), long))
        assert (slab.cap, slab.slots, slab.nbytes) == before
    for _ in range(3):
        _round(model, rng, shorts, (_tokens(rng, 1), long))
    own = long[0].slot.slab
    assert own.own and own.cap <= 1536  # grown in steps, never past its horizon (rounded)
    assert ragged.kv_nbytes(model) == before[2] + own.nbytes
    assert own.nbytes >= 1283 * TINY_BYTES_PER_POSITION
    during = ragged.kv_nbytes(model)
    del long, own
    gc.collect()
    assert ragged.kv_nbytes(model) == slab.nbytes == before[2]
    tally.NOTES.append(f"KV memory, long horizon: slab {before[1]} slots x {before[0]} "
                       f"positions ({before[2]} B) before, during and after; all KV "
                       f"{during} B during, {ragged.kv_nbytes(model)} B after")


def test_a_request_that_outgrows_its_slot_moves_to_storage_of_its_own(model):
    # No horizon given: the request starts in a slot and moves out when it would pass the
    # limit; the slab grows to the limit at most and shrinks back at the next forward.
    rng = random.Random(2)
    shorts = _shorts(model, rng)
    slab = ragged.slab_of(model)
    base_cap, base_bytes = slab.cap, slab.nbytes
    long = ragged.make_cache(model)
    caps = []
    for _ in range(6):  # 1200 positions, 200 a chunk
        _round(model, rng, shorts, (_tokens(rng, 200), long))
        caps.append(slab.cap)
    assert max(caps) == LIMIT and long[0].slot.slab.own
    assert caps[-1] == base_cap and slab.nbytes == base_bytes
    assert long[0].offset == 1200
    tally.NOTES.append(f"KV memory, a request outgrowing its slot: slab capacity per chunk "
                       f"{caps} (limit {LIMIT})")
    del long
    gc.collect()
    assert ragged.kv_nbytes(model) == base_bytes


def test_the_slab_gives_back_capacity_and_slots_its_live_requests_no_longer_need(model):
    # Eight requests (slots doubled from 7 to 14); the last one's 480 positions size every
    # slot to 512. When it and five others leave, the next forward shrinks the slab to the
    # two left (slots 0 and 1, at 256 positions), and MLX really frees the old arrays
    # (active memory drops by the difference: what stays is a copy, not a view that keeps
    # them alive).
    rng = random.Random(3)
    caches = _shorts(model, rng, 7)
    medium = ragged.make_cache(model, horizon=500)
    ragged.forward(model, [(_tokens(rng, 480), medium)], rows=[0])
    slab = ragged.slab_of(model)
    assert (slab.slots, slab.cap) == (14, LIMIT) and medium[0].slot.i == 7  # 7, doubled
    full = slab.nbytes
    del medium, caches[2:]
    gc.collect()
    mx.clear_cache()
    active = mx.get_active_memory()
    ragged.forward(model, [([5], c) for c in caches], rows=[0, 0])
    gc.collect()
    mx.clear_cache()
    assert (slab.slots, slab.cap) == (2, ragged.Slab.STEP)
    assert slab.nbytes == 2 * ragged.Slab.STEP * TINY_BYTES_PER_POSITION
    assert active - mx.get_active_memory() >= 0.9 * (full - slab.nbytes)
    # A newcomer takes a free low slot; the slab grows again as it needs.
    again = ragged.make_cache(model)
    ragged.forward(model, [(_tokens(rng, 300), again)], rows=[0])
    assert again[0].slot.i == 2 and (slab.slots, slab.cap) == (4, 512)


def _alone(model, prompt, steps):
    """mlx-lm's forward alone: the prompt's last 8 rows, then every row of each step."""
    c = make_prompt_cache(model)
    outs = [model.lm_head(model.model(mx.array([prompt]), cache=c)[:, -8:])[0]]  # (the head
    # over 8 rows, not 500: a row's logits do not depend on the others on this BLAS)
    outs += [model(mx.array([s]), cache=c)[0] for s in steps]
    mx.eval(outs)
    return [np.array(o) for o in outs]


@pytest.mark.parametrize("needle", ["slot", "own", "moves"])
def test_logits_are_the_same_whether_neighbours_use_the_slab_or_storage_of_their_own(
        model, needle):
    # The needle's logits alone (mlx-lm's own forward and cache) and inside rounds whose
    # neighbours mix slab slots, storage of their own and a prefill chunk (attending per
    # request in the same pass as the batched short rows): bitwise equal on the reference
    # BLAS. "moves": the needle starts in a slot and moves to storage of its own mid-run.
    assert blas.active() == "reference"
    rng = random.Random(f"needle-{needle}")
    prompt = _tokens(rng, LIMIT - 4 if needle == "moves" else 30)
    steps = [_tokens(rng, n) for n in (1, 3, 1, 5, 2, 1, 4)]
    want = _alone(model, prompt, steps)
    for trial in range(2):
        mine = ragged.make_cache(model, horizon=LIMIT + 100 if needle == "own" else None)
        kinds = [rng.choice(["slot", "own"]) for _ in range(rng.randrange(2, 6))]
        kinds += ["slot", "own", "chunk"]
        neigh = [(k, ragged.make_cache(model, horizon=LIMIT + 100 if k == "own" else 64))
                 for k in kinds]
        for _, c in neigh:
            ragged.forward(model, [(_tokens(rng, rng.randrange(5, 40)), c)], rows=[0])
        mixed = 0
        got = []
        for seg in [prompt, *steps]:
            batch = [(_tokens(rng, 40 if k == "chunk" else rng.randrange(1, 6)), c)
                     for k, c in neigh]
            pos = rng.randrange(len(batch) + 1)
            batch.insert(pos, (seg, mine))
            batched = ragged._batched(batch)
            mixed += bool(batched) and len(batched) < len(batch)
            rows = [1] * len(batch)  # (the head over the needle's rows only: cheaper)
            rows[pos] = min(len(seg), 8)
            got.append(np.array(ragged.forward(model, batch, rows)[pos]))
        assert mixed >= len(steps), "no pass mixed batched and per-request attention"
        assert mine[0].slot.slab.own == (needle != "slot")
        for i, (a, b) in enumerate(zip(want, got)):
            assert np.array_equal(a[-len(b):], b), f"trial {trial}, segment {i} differs"


def test_a_long_prompt_decodes_as_the_oracle_next_to_short_requests(model, prompt):
    # Through the core: a 600-token speculative request (past the limit: its target and
    # draft caches move out of their slabs while its prompt is prefilled in chunks) and
    # plain short ones, together; each one's tokens are the oracle's.
    models = Models(model, WIDTH, tiny_llama(99), WIDTH)
    rng = random.Random(4)
    reqs = [(list(prompt) + _tokens(rng, 600), SpecConfig(4))]
    reqs += [(list(prompt) + _tokens(rng, n), None) for n in (0, 3, 9)]
    states = [new_state(models, Request(tuple(p), sampling=SamplingParams(), max_tokens=12,
                                        spec=spec), EOS) for p, spec in reqs]
    got: list[list[int]] = [[] for _ in states]
    caps = []
    while not all(s.done for s in states):
        prefill_arrivals(models, states, budget=160)
        run_round(models, states)
        for g, s in zip(got, states):
            g += s.new_tokens
        caps.append(ragged.slab_of(model).cap)
    assert states[0].t_cache[0].slot.slab.own and states[0].d_cache[0].slot.slab.own
    assert max(caps) <= LIMIT
    for g, s, (p, _) in zip(got, states, reqs):
        want = reference_decode(model, p, vocab_size=WIDTH, eos_token_ids=EOS, max_tokens=12)
        assert s.error is None and g == list(want.tokens)


def test_rss_returns_near_its_baseline_after_a_long_request_leaves(model):
    # A 64 MiB request (131072 positions of the tiny model, restored as a prompt-cache hit
    # is: no prefill compute) next to three short ones for a few rounds, then gone. RSS rises
    # by about its storage while it is there and returns to within 8 MiB (1/8 of it) of the
    # baseline once it has left and MLX's buffer cache is cleared: the allowance covers
    # allocator fragmentation and Python's own growth, not the storage (which would be 64).
    rng = random.Random(5)
    shorts = _shorts(model, rng)
    n = 131072
    kv = n * TINY_BYTES_PER_POSITION

    def visit(positions: int) -> int:
        long = ragged.make_cache(model, horizon=positions + 64)
        for c in long:
            k = mx.random.normal((1, 2, positions, 16))
            c.state = (k, k + 1, positions)
        del k
        mx.eval([c.state for c in long])
        for _ in range(3):
            _round(model, rng, shorts, ([rng.randrange(300, 9000)], long))
        assert long[0].slot.slab.own
        during = _settled_rss()
        del long
        return during

    visit(4096)  # warm: the same code paths once, small
    slab = ragged.slab_of(model)
    base_bytes = slab.nbytes
    baseline = _settled_rss()
    during = visit(n)
    after = _settled_rss()
    mib = 1 << 20
    tally.NOTES.append(f"KV memory, RSS: baseline {baseline / mib:.1f} MiB, with a "
                       f"{kv / mib:.0f} MiB request {during / mib:.1f}, after it "
                       f"{after / mib:.1f}")
    assert during - baseline >= 0.9 * kv
    assert after - baseline <= kv / 8
    assert slab.nbytes == base_bytes and ragged.kv_nbytes(model) == base_bytes
