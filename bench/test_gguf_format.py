"""The weight format a GGUF file converts to on this platform: the embedded model's file in
float32 (what the CPU backend uses) and in `q4` (MLX's quantized kernels, what Metal/CUDA
use), decode steps per second over the same tokens (teacher-forced: both arms compute the
same positions of the same sequence), arms interleaved per round."""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

from bench import results

ROUNDS = results.rounds(3, 5)
STEPS = results.size(48, 48, 8)


def _decode_steps_per_s(model) -> float:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model.model)
    prompt = mx.array([list(range(200, 232))])
    mx.eval(model.model(prompt, cache=cache))
    t0 = time.perf_counter()
    for i in range(STEPS):
        mx.eval(model.model(mx.array([[300 + i]]), cache=cache))
    return STEPS / (time.perf_counter() - t0)


def test_float32_vs_q4_decode_on_this_backend(benchmark):
    from specdec.models import embedded_model_dir, load

    arms = {fmt: load(str(embedded_model_dir(fmt))) for fmt in ("float32", "q4")}
    for m in arms.values():  # warm
        _decode_steps_per_s(m)

    def run():
        got: dict[str, list[float]] = {fmt: [] for fmt in arms}
        for _ in range(ROUNDS):
            for fmt, m in arms.items():
                got[fmt].append(_decode_steps_per_s(m))
        return got

    got = benchmark.pedantic(run, rounds=1, iterations=1)
    f32, q4 = (statistics.median(got[f]) for f in ("float32", "q4"))
    note = f"{ROUNDS} rounds x {STEPS} teacher-forced steps, arms back to back"
    results.add("gguf_float32_decode_steps_s", f32, "steps/s", note)
    results.add("gguf_q4_decode_steps_s", q4, "steps/s", note)
    results.add("gguf_q4_over_float32_decode",
                statistics.median(q / f for q, f in zip(got["q4"], got["float32"])), "ratio",
                "median of per-round ratios; the CPU backend converts GGUF to float32, "
                "Metal/CUDA to q4")
    assert f32 > 0 and q4 > 0
