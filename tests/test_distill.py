"""`specdec distill` on a tiny target (the whole recipe in seconds: sample, vocabulary, train,
checkpoint, resume, export, load), and the properties of the draft shipped for the embedded
model."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from specdec.distill import DistillConfig, distill
from specdec.distill_data import make_prompts
from specdec.engine import check_draft
from specdec.models import LoadedModel, MappedDraft, default_draft_dir, load
from tests.tiny import EOS, WIDTH, tiny_llama

TINY = replace(DistillConfig(), prompts=6, gen_batch=3, max_new=6, epochs=2,
               batch_tokens=256, ckpt_every=3, draft_vocab=700, keep_first_ids=300, layers=1,
               warmup=2)


@pytest.fixture(scope="module")
def tiny_target(hf_tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_target")
    hf_tokenizer.save_pretrained(path)
    model = tiny_llama(1234)
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-5, "vocab_size": WIDTH, "tie_word_embeddings": False,
              "max_position_embeddings": 512}
    return LoadedModel(model=model, tokenizer=hf_tokenizer, path=path, name="tiny",
                       eos_token_ids=EOS, vocab_size=WIDTH, config=config)


def test_prompts_are_seeded_and_mixed():
    a, b = make_prompts(40, 3), make_prompts(40, 3)
    assert a == b and a != make_prompts(40, 4)
    kinds = {p.constraint.kind if p.constraint else None for p in a}
    assert None in kinds and "json_schema" in kinds


def test_distill_runs_resumes_and_exports_a_loadable_draft(tiny_target, tmp_path, capsys):
    out = tmp_path / "draft"
    rep = distill(tiny_target, out, TINY)
    assert rep["samples"] == TINY.prompts and rep["steps"] > TINY.ckpt_every
    meta = json.loads((out / "work" / "ckpt.json").read_text())
    assert meta["step"] == meta["total"] == rep["steps"]
    weights = mx.load(str(out / "model.safetensors"))
    assert all(v.dtype == mx.float16 for v in weights.values())

    # A rerun finds every stage done: no sampling, training resumes at the end.
    shards = sorted((out / "work" / "gen").glob("*.npz"))
    stamps = [s.stat().st_mtime_ns for s in shards]
    capsys.readouterr()
    again = distill(tiny_target, out, TINY)
    assert f"resumed training at step {rep['steps']}/{rep['steps']}" in capsys.readouterr().err
    assert [s.stat().st_mtime_ns for s in shards] == stamps
    assert again["val_agreement"] == pytest.approx(rep["val_agreement"], abs=1e-6)

    # Resuming under other settings would mix two recipes: refused, naming the setting.
    with pytest.raises(ValueError, match="max_new"):
        distill(tiny_target, out, replace(TINY, max_new=7))

    # The export is an mlx-lm directory the loader maps back to the target's ids.
    d = load(out)
    assert isinstance(d.model, MappedDraft) and d.vocab_size == WIDTH
    check_draft(tiny_target, d)
    tm = json.loads((out / "token_map.json").read_text())
    logits = d.model(mx.array([[5, 48000, 7]]))  # 48000: outside the draft vocabulary
    assert logits.shape == (1, 3, WIDTH)
    finite = np.isfinite(np.array(logits[0, -1]))
    assert set(np.flatnonzero(finite).tolist()) == set(tm["draft_to_target"])


def test_sampling_is_reproducible_for_a_seed(tiny_target, tmp_path):
    from specdec.distill import generate_data

    cfg = replace(TINY, prompts=3)
    a = generate_data(tiny_target, tmp_path / "a", cfg)
    b = generate_data(tiny_target, tmp_path / "b", cfg)
    for x, y in zip(a, b):
        za, zb = np.load(x), np.load(y)
        assert all(np.array_equal(za[k], zb[k]) for k in za.files)


def test_shipped_draft_fits_and_serves_the_embedded_model(embedded):
    path = default_draft_dir()
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert size <= 32 * 2**20, f"shipped draft weights are {size / 2**20:.1f} MiB"
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["specdec_draft"]["target"] == embedded.name
    d = load("default-draft")
    assert isinstance(d.model, MappedDraft) and d.vocab_size == embedded.vocab_size
    check_draft(embedded, d)
    assert Path(d.path) == path
