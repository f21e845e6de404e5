"""Masking and sampling: the MLX functions against the oracle's numpy ones, on hand-made
distributions and awkward vocabulary sizes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from oracle.sampler import decision_scores, gumbel, unpack_mask
from specdec.sampling import (SamplingError, SamplingParams, apply_mask, pick, position_noise,
                              unpack_bitmask)


def random_bitmask(rng: np.random.Generator, words: int, density: float) -> np.ndarray:
    bits = rng.random(words * 32) < density
    return np.packbits(bits, bitorder="little").view(np.int32).copy()


# Not multiples of 32; logits both narrower and wider than the mask's 32*W ids.
AWKWARD = [(v, w) for v in (32001, 32007, 32031, 32032, 32033) for w in (1000, 1001, 1002)]


@pytest.mark.parametrize("vocab,words", AWKWARD)
def test_device_unpack_equals_numpy_unpack_on_awkward_vocab_sizes(vocab, words):
    rng = np.random.default_rng(vocab * 7 + words)
    bm = random_bitmask(rng, words, 0.3)
    got = np.array(unpack_bitmask(mx.array(bm), vocab))
    want = unpack_mask(bm, vocab)
    assert got.shape == (vocab,)
    assert np.array_equal(got, want)
    if vocab > words * 32:
        assert not got[words * 32:].any()  # logits past the tokenizer are never allowed


def test_sign_bit_and_all_ones_words_unpack_correctly():
    bm = np.array([-1, np.int32(-2**31), 1, 0], dtype=np.int32)
    got = np.array(unpack_bitmask(mx.array(bm), 128))
    assert got[:32].all()
    assert got[63] and not got[32:63].any()
    assert got[64] and not got[65:].any()


def test_apply_mask_bans_exactly_the_unset_bits():
    logits = mx.array(np.linspace(-3, 3, 40, dtype=np.float32))
    allowed = mx.array(np.arange(40) % 3 == 0)
    out = np.array(apply_mask(logits, allowed))
    assert np.isneginf(out[np.arange(40) % 3 != 0]).all()
    assert np.array_equal(out[::3], np.array(logits)[::3])


def test_greedy_pick_breaks_ties_at_the_first_index_like_numpy():
    x = np.array([0.0, 2.0, 1.0, 2.0, 2.0], dtype=np.float32)
    assert int(pick(mx.array(x), SamplingParams(), None).item()) == int(np.argmax(x)) == 1


def test_greedy_never_picks_a_banned_token_even_if_it_has_the_top_logit():
    x = mx.array(np.array([9.0, 1.0, 5.0, 3.0], dtype=np.float32))
    masked = apply_mask(x, mx.array([False, True, False, True]))
    assert int(pick(masked, SamplingParams(), None).item()) == 3


def test_position_noise_depends_only_on_seed_and_position():
    a = position_noise(7, 3, 5000)
    assert a.dtype == np.float32 and a.shape == (5000,)
    assert np.array_equal(a, position_noise(7, 3, 5000))
    assert np.array_equal(a[:100], position_noise(7, 3, 100))  # prefix-stable in vocab
    assert not np.array_equal(a, position_noise(7, 4, 5000))
    assert not np.array_equal(a, position_noise(8, 3, 5000))


@pytest.mark.parametrize("seed,pos", [(0, 0), (1, 5), (2**63 - 1, 10_000), (123456789, 2)])
def test_noise_definition_matches_the_oracles_independent_implementation(seed, pos):
    assert np.array_equal(position_noise(seed, pos, 49152), gumbel(seed, pos, 49152))


def test_gumbel_noise_has_gumbel_moments():
    g = np.concatenate([position_noise(11, i, 20000) for i in range(5)]).astype(np.float64)
    assert abs(g.mean() - 0.5772) < 0.02
    assert abs(g.std() - np.pi / np.sqrt(6)) < 0.02


def test_seeded_sampling_frequencies_follow_the_softmax():
    # Over many positions, Gumbel-max picks token v with probability softmax(x / T)_v.
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    counts = np.zeros(4)
    for i in range(4000):
        counts[int(np.argmax(x + position_noise(99, i, 4)))] += 1
    freq = counts / counts.sum()
    assert np.allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)


@pytest.mark.parametrize("params", [
    SamplingParams(0.0),
    SamplingParams(0.8, seed=1),
    SamplingParams(0.8, top_k=40, seed=2),
    SamplingParams(1.3, top_k=5, seed=3),
    SamplingParams(0.7, top_p=0.9, seed=4),
    SamplingParams(1.0, top_p=0.5, top_k=20, seed=5),
])
def test_mlx_decision_equals_oracle_decision_on_random_masked_logits(params):
    rng = np.random.default_rng(params.seed or 0)
    vocab = 5003
    for pos in range(25):
        logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
        allowed = rng.random(vocab) < 0.2
        allowed[rng.integers(vocab)] = True
        masked = np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32)
        noise = None if params.greedy else position_noise(params.seed or 0, pos, vocab)
        got = int(pick(apply_mask(mx.array(logits), mx.array(allowed)), params,
                       None if noise is None else mx.array(noise)).item())
        scores = decision_scores(masked, temperature=params.temperature, top_k=params.top_k,
                                 top_p=params.top_p, noise=noise)
        assert got == int(np.argmax(scores))
        assert allowed[got]


def test_top_k_keeps_only_the_k_best():
    x = np.array([5.0, 4.0, 3.0, 2.0, 1.0], dtype=np.float32)
    picks = {int(pick(mx.array(x), SamplingParams(5.0, top_k=2, seed=0),
                      mx.array(position_noise(0, i, 5))).item()) for i in range(200)}
    assert picks == {0, 1}


def test_top_p_keeps_the_smallest_nucleus():
    x = np.log(np.array([0.6, 0.25, 0.1, 0.05], dtype=np.float32))
    picks = {int(pick(mx.array(x), SamplingParams(1.0, top_p=0.8, seed=0),
                      mx.array(position_noise(0, i, 4))).item()) for i in range(300)}
    assert picks == {0, 1}  # 0.6 < 0.8 <= 0.85


@pytest.mark.parametrize("kwargs,needle", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"seed": -5}, "seed"),
])
def test_out_of_range_sampling_params_raise_naming_the_value(kwargs, needle):
    with pytest.raises(SamplingError, match=needle):
        SamplingParams(**kwargs)


def test_noise_is_finite_for_every_hash_value_including_the_extremes():
    # u must stay strictly inside (0, 1): at u == 1 the noise is +inf and -inf + inf = nan
    # would let a banned token win.
    g = np.concatenate([position_noise(s, p, 49152) for s in range(4) for p in range(50)])
    assert np.isfinite(g).all()
    x = np.array([0, 0xFFFFFFFF], dtype=np.uint32)
    u = ((x >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-23)
    assert 0 < u[0] and u[1] < 1
