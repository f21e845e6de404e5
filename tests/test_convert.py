"""GGUF → mlx-lm directory conversion, on a tiny llama GGUF written by the test."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from specdec import convert
from specdec.convert import ConversionError, convert_gguf, hf_name

HIDDEN, LAYERS, FFN, HEADS, KV = 64, 2, 128, 4, 2


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte → printable-unicode table, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def write_tiny_gguf(path: Path) -> dict[str, mx.array]:
    """Write a float32 tiny llama GGUF; returns its arrays."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = byte_level_alphabet()
    merges = ["h e", "l l", "he ll"]
    tokens = specials + alphabet + ["he", "ll", "hell"]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    rng = np.random.default_rng(0)

    def w(*shape: int) -> mx.array:
        return mx.array((rng.standard_normal(shape) * 0.05).astype(np.float32))

    arrays: dict[str, mx.array] = {"output_norm.weight": mx.ones((HIDDEN,))}
    head = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV * head, HIDDEN),
              "attn_v": (KV * head, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}

    arrays["token_embd.weight"] = w(len(tokens), HIDDEN)
    for i in range(LAYERS):
        arrays[f"blk.{i}.attn_norm.weight"] = mx.ones((HIDDEN,))
        arrays[f"blk.{i}.ffn_norm.weight"] = mx.ones((HIDDEN,))
        for k, shape in shapes.items():
            arrays[f"blk.{i}.{k}.weight"] = w(*shape)
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": mx.array(HIDDEN, dtype=mx.uint32),
        "llama.block_count": mx.array(LAYERS, dtype=mx.uint32),
        "llama.feed_forward_length": mx.array(FFN, dtype=mx.uint32),
        "llama.attention.head_count": mx.array(HEADS, dtype=mx.uint32),
        "llama.attention.head_count_kv": mx.array(KV, dtype=mx.uint32),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        "llama.context_length": mx.array(256, dtype=mx.uint32),
        "llama.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": mx.array(1, dtype=mx.uint32),
        "tokenizer.ggml.eos_token_id": mx.array(2, dtype=mx.uint32),
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                                   "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                                   "{% if add_generation_prompt %}<|im_start|>assistant\n"
                                   "{% endif %}",
    }
    mx.save_gguf(str(path), arrays, meta)
    return arrays


def as_gguf_quantized(arrays: dict[str, mx.array]) -> dict[str, mx.array]:
    """What mx.load returns for a Q4_1 GGUF with a Q8_0 embedding: MLX affine, group 32."""
    out: dict[str, mx.array] = {}
    for name, value in arrays.items():
        if value.ndim != 2:
            out[name] = value
            continue
        stem = name.rpartition(".")[0]
        bits = 8 if stem == "token_embd" else 4
        q, s, b = mx.quantize(value, group_size=32, bits=bits)
        out[f"{stem}.weight"], out[f"{stem}.scales"], out[f"{stem}.biases"] = (
            q, s.astype(mx.float16), b.astype(mx.float16))
    return out


def quantized_loader(monkeypatch, arrays: dict[str, mx.array]) -> dict[str, mx.array]:
    """Make the converter read quantized tensors (MLX cannot write a quantized GGUF)."""
    quant = as_gguf_quantized(arrays)
    real_load = mx.load

    def load(path, return_metadata=False):
        _, meta = real_load(path, return_metadata=True)
        return (quant, meta) if return_metadata else quant

    monkeypatch.setattr(convert.mx, "load", load)
    return quant


@pytest.mark.parametrize("fmt", ["float32", "q4"])
def test_tiny_gguf_converts_into_a_directory_mlx_lm_loads(tmp_path, monkeypatch, fmt):
    from mlx_lm.utils import load

    gguf = tmp_path / "tiny.gguf"
    quantized_loader(monkeypatch, write_tiny_gguf(gguf))
    out = convert_gguf(gguf, tmp_path / "model", fmt, progress=False)
    monkeypatch.undo()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_traditional"] is True and cfg["eos_token_id"] == [0, 2]
    if fmt == "q4":
        assert cfg["quantization"]["model.embed_tokens"]["bits"] == 8
    model, tok = load(str(out))[:2]
    ids = tok.encode("hello <|im_end|>", add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("hell") and ids[-1] == 2
    assert tok.decode(ids) == "hello <|im_end|>"
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), 3 + 256 + 3)
    assert bool(mx.all(mx.isfinite(logits)))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def test_float32_conversion_dequantizes_to_the_same_weights(tmp_path, monkeypatch):
    gguf = tmp_path / "tiny.gguf"
    arrays = quantized_loader(monkeypatch, write_tiny_gguf(gguf))
    out = convert_gguf(gguf, tmp_path / "m", "float32", progress=False)
    monkeypatch.undo()
    w = mx.load(str(out / "model.safetensors"))
    want = mx.dequantize(arrays["blk.1.attn_k.weight"], arrays["blk.1.attn_k.scales"],
                         arrays["blk.1.attn_k.biases"], group_size=32, bits=4)
    assert w["model.layers.1.self_attn.k_proj.weight"].dtype == mx.float32
    assert mx.array_equal(w["model.layers.1.self_attn.k_proj.weight"], want)


def test_crash_mid_conversion_leaves_no_directory_that_later_loads(tmp_path, monkeypatch):
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(convert.mx, "save_safetensors", boom)
    with pytest.raises(OSError, match="disk full"):
        convert_gguf(gguf, tmp_path / "model", progress=False)
    assert not (tmp_path / "model").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.gguf"]  # no temp leftovers
    monkeypatch.undo()
    assert (convert_gguf(gguf, tmp_path / "model", progress=False) / "config.json").exists()


@pytest.mark.parametrize("gguf,hf", [
    ("blk.12.attn_q.weight", "model.layers.12.self_attn.q_proj.weight"),
    ("blk.0.ffn_down.scales", "model.layers.0.mlp.down_proj.scales"),
    ("blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
    ("token_embd.biases", "model.embed_tokens.biases"),
    ("output_norm.weight", "model.norm.weight"),
])
def test_gguf_tensor_names_map_to_hf_llama_names(gguf, hf):
    assert hf_name(gguf) == hf


def test_unknown_tensor_and_architecture_are_refused():
    with pytest.raises(ConversionError):
        hf_name("blk.0.attn_qkv.weight")
    with pytest.raises(ConversionError, match="architecture"):
        convert.build_config({"general.architecture": "mamba"}, "float32")
