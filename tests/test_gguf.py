"""GGUF files as users have them, written here with llama.cpp's own `gguf` writer from the
random-weight mlx-lm families (tests/families.py): llama (Q/K permuted as llama.cpp writes
them), mistral (a llama GGUF with a SentencePiece vocabulary), qwen2, qwen3 (q/k norms),
phi3 (fused QKV and gate/up), gemma2 (soft-capping) and gemma3 (sliding-window layers, local
RoPE base), Gemma's norms written as llama.cpp writes them (1 + weight), in F16, Q8_0, Q4_0,
Q4_K and Q6_K, with byte-level BPE and SentencePiece-style vocabularies.

The converted model must compute what the source model computes with the file's weights
(the source's weights rounded through the file's type), its tokenizer must encode and decode
as the source tokenizer, its template (from the metadata) must render, and constrained
decoding and speculation must hold on it.

The `gguf` package quantizes only the legacy types in numpy; K-quant tensors are written as
random blocks of their layout (sane scales), so their reference is the dequantized block.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from specdec import blas
from specdec.convert import (ConversionError, build_config, build_tokenizer_files,
                             convert_gguf, llama3_divisors, read_metadata)
from specdec.engine import Engine
from specdec.models import load
from specdec.speculative import SpecConfig
from tests import tally
from tests.exactness import MODES, run_cells
from tests.families import FAMILIES, TOKENIZERS, make_family
from tests.test_families import CELLS, MAX_TOKENS, MESSAGES, SCHEMA

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

ARCH = {"llama3-tied": "llama", "llama3-untied": "llama", "mistral": "llama",
        "qwen2.5": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2",
        "gemma3": "gemma3"}
GEMMA = ("gemma2", "gemma3")
SIZES = {"hidden_size": 256, "intermediate_size": 256, "head_dim": 64}  # K-quant rows: 256
# Gemma's query scale is 1/sqrt(head_dim) below 27B (llama.cpp has no key for it); Gemma 3's
# global RoPE base differs from its local layers' (10000).
FAMILY_SIZES = {"gemma2": {"query_pre_attn_scalar": 64},
                "gemma3": {"query_pre_attn_scalar": 64, "rope_theta": 1_000_000.0}}
# Gemma 3 with Gemma's own tokenizer (no space prefix: llama.cpp writes add_space_prefix false).
TOKENIZER = {"gemma3": "gemma2"}
NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # phi3: fused
         "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# Byte offsets of the f16 super-block scales in a K-quant block (d, then dmin where it has one).
K_SCALES = {Q.Q2_K: ((80, 1e-4), (82, 1e-4)), Q.Q3_K: ((108, 3e-5),),
            Q.Q4_K: ((0, 1e-4), (2, 1e-4)), Q.Q5_K: ((0, 1e-4), (2, 1e-4)),
            Q.Q6_K: ((208, 3e-5),)}
TEXT = ("  Héllo wörld, naïve café — crème brûlée 東京の天気 数据 🙂👍🏽 안녕\n"
        "def f(x):\n    return {\"a\": x ** 2}  # 12345\n\t tabs   and  spaces ")


def gguf_name(hf: str, arch: str) -> str:
    stem, _, suffix = hf.rpartition(".")
    if stem in TOP:
        return f"{TOP[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{(NAMES | (GEMMA_NAMES if arch in GEMMA else {}))[rest]}.{suffix}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of llama Q/K rows."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def quantized(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """The file's bytes of `w` in `qtype` (K-quants: random blocks with small scales)."""
    if qtype not in K_SCALES:
        return gguf.quants.quantize(w, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
    for offset, scale in K_SCALES[qtype]:
        d = np.full(raw.shape[:2], scale, dtype=np.float16) * rng.uniform(0.5, 1.5, raw.shape[:2])
        raw[..., offset:offset + 2] = d.astype(np.float16).view(np.uint8).reshape(
            *raw.shape[:2], 2)
    return raw.reshape(w.shape[0], -1)


def write_gguf(src: Path, family: str, qtype: Q, path: Path, template: bool = True
               ) -> dict[str, mx.array]:
    """Write `src` (an mlx-lm directory) as a GGUF in `qtype` (with its chat template unless
    not `template`); returns the float32 weights the file holds, under HF names and in HF
    row order."""
    from tokenizers import Tokenizer

    cfg = json.loads((src / "config.json").read_text())
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    arch = ARCH[family]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    if arch == "gemma2":  # as llama.cpp's Gemma2Model: no RoPE keys (base 10000)
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    else:
        w.add_rope_freq_base(cfg["rope_theta"])
    if arch == "gemma3":  # the pattern, which llama.cpp otherwise takes as 6
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern(cfg["sliding_window_pattern"])
    elif arch != "gemma2":
        w.add_rope_dimension_count(cfg["head_dim"])

    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    added = {t.content: t.special for t in tok.get_added_tokens_decoder().values()}
    kind = TOKENIZERS[TOKENIZER.get(family) or FAMILIES[family][0]]
    if kind.byte_level:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        model = json.loads(tok.to_str())["model"]
        w.add_token_merges([" ".join(m) if isinstance(m, list) else m
                            for m in model["merges"]])
        types = [3 if added.get(t) else 4 if t in added else 1 for t in tokens]
    else:
        w.add_tokenizer_model("llama")
        w.add_token_scores([-float(i) for i in range(len(tokens))])
        types = [2 if t == "<unk>" else 6 if t.startswith("<0x") else
                 3 if added.get(t) else 4 if t in added else 1 for t in tokens]
        w.add_unk_token_id(vocab["<unk>"])
        w.add_add_space_prefix(kind.space_prefix)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if kind.bos:
        w.add_bos_token_id(vocab[kind.bos])
    w.add_eos_token_id(vocab[kind.eos])
    w.add_add_bos_token(kind.bos is not None)
    if template:
        w.add_chat_template(tok_cfg["chat_template"])

    rng = np.random.default_rng(0)
    held: dict[str, mx.array] = {}
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    for name, value in sorted(mx.load(str(src / "model.safetensors")).items()):
        x = np.array(value.astype(mx.float32))
        if arch in GEMMA and name.endswith("norm.weight"):  # llama.cpp: 1 + weight
            x = x + np.float32(1)
            held[name] = mx.array(x - np.float32(1))  # what the file holds, in mlx-lm terms
        if x.ndim == 1:
            data, dtype = x, Q.F32
            held.setdefault(name, mx.array(x))
        else:
            data = x.astype(np.float16) if qtype == Q.F16 else quantized(x, qtype, rng)
            dtype = qtype
            held[name] = mx.array(gguf.quants.dequantize(data, qtype).astype(np.float32))
            proj = name.split(".")[-2]
            if arch == "llama" and proj in heads:
                data = permute(data, heads[proj])
        w.add_tensor(gguf_name(name, arch), data, raw_dtype=dtype)
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "llama3":
        # Llama 3.1+: llama.cpp writes the scaling as per-frequency divisors, not parameters.
        w.add_tensor("rope_freqs.weight", llama3_divisors(
            cfg["rope_scaling"], cfg["rope_theta"], cfg["head_dim"]).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def vary_norms(src: Path, around: float) -> None:
    """Give every norm of `src` its own random weights around `around` (a new model's are
    all equal), so a norm read under another one's name changes the logits."""
    weights = mx.load(str(src / "model.safetensors"))
    rng = np.random.default_rng(1)
    for name, value in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = mx.array(rng.uniform(around - 0.5, around + 0.5, value.shape)
                                     .astype(np.float32))
    mx.save_safetensors(str(src / "model.safetensors"), weights)


def source_with(src: Path, weights: dict[str, mx.array]):
    """The source model (mlx-lm's class and config) holding `weights`."""
    target = load(str(src))
    target.model.load_weights(list(weights.items()), strict=True)
    mx.eval(target.model.parameters())
    return target


# (family, type): every family in F16 and a K-quant, every type on some family.
CASES = [("qwen3", Q.F32), ("qwen3", Q.F16), ("qwen3", Q.Q4_K), ("qwen2.5", Q.F16),
         ("qwen2.5", Q.Q8_0), ("qwen2.5", Q.Q6_K), ("phi3", Q.F16),
         ("mistral", Q.F16), ("mistral", Q.Q4_0), ("mistral", Q.Q6_K),
         ("llama3-tied", Q.F16), ("llama3-tied", Q.Q4_K),
         ("llama3-untied", Q.F16), ("llama3-untied", Q.Q5_K),
         ("qwen3", Q.BF16), ("qwen2.5", Q.Q5_0), ("mistral", Q.Q5_1), ("phi3", Q.Q4_1),
         ("qwen2.5", Q.Q3_K), ("phi3", Q.Q2_K), ("phi3", Q.Q8_0), ("phi3", Q.Q6_K),
         ("gemma2", Q.F16), ("gemma2", Q.Q4_K), ("gemma3", Q.F16), ("gemma3", Q.Q6_K)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    made: dict = {}

    def get(family: str, qtype: Q):
        if (family, qtype) not in made:
            src = root / family
            if not (src / "config.json").exists():
                make_family(family, src, sizes=SIZES | FAMILY_SIZES.get(family, {}),
                            tokenizer=TOKENIZER.get(family))
                # (Gemma's norms scale by 1 + weight: four a block, each its own name)
                vary_norms(src, 0.0 if family in GEMMA else 1.0)
            path = root / f"{family}-{qtype.name}.gguf"
            held = write_gguf(src, family, qtype, path)
            out = convert_gguf(path, root / f"{family}-{qtype.name}", progress=False)
            made[family, qtype] = (src, held, out)
        return made[family, qtype]
    return get


@pytest.mark.parametrize("family,qtype", CASES, ids=[f"{f}-{q.name}" for f, q in CASES])
def test_converted_gguf_computes_what_the_source_computes(converted, family, qtype):
    src, held, out = converted(family, qtype)
    cfg = json.loads((out / "config.json").read_text())
    # mistral is written (and runs) as llama
    assert cfg["model_type"] == {"gemma3": "gemma3_text"}.get(ARCH[family], ARCH[family])
    # Llama 3.1's scaling, stored as rope_freqs divisors, is read back as its parameters.
    assert cfg.get("rope_scaling") == json.loads((src / "config.json").read_text()).get(
        "rope_scaling")
    # An all-native llama file keeps MLX's reader (the embedded model's path), which
    # dequantizes block types in float16 arithmetic, and GGUF's Q/K order with interleaved
    # RoPE: F16 agrees up to float32 summation order, Q4_0/Q8_0 within float16 rounding of
    # each weight. Otherwise the weights are dequantized in numpy on both sides: the same
    # float32 weights, the same computation, bit for bit.
    native = ARCH[family] == "llama" and qtype in (Q.F16, Q.Q4_0, Q.Q8_0)
    assert cfg["rope_traditional"] is native
    got = load(str(out))
    want = source_with(src, held)
    ids = mx.array([want.tokenizer.encode(TEXT)])
    a, b = got.model(ids), want.model(ids)
    if native:
        rel = float(mx.abs(a - b).max() / mx.abs(b).max())
        assert rel < (1e-5 if qtype == Q.F16 else 5e-3), rel
    else:
        assert mx.array_equal(a, b), float(mx.abs(a - b).max())
    if qtype not in K_SCALES:  # against the unrounded source: within the type's error
        exact = load(str(src)).model(ids)
        tol = {Q.F32: 1e-6, Q.F16: 0.02, Q.BF16: 0.05, Q.Q8_0: 0.05, Q.Q5_0: 0.25, Q.Q5_1: 0.25,
               Q.Q4_0: 0.5, Q.Q4_1: 0.5}[qtype]
        rel = float(mx.abs(a - exact).max() / mx.abs(exact).max())
        tally.NOTES.append(f"gguf {family} {qtype.name}: logits vs the unrounded source, "
                           f"max error / max logit {rel:.1e}")
        assert rel < tol, rel


@pytest.mark.parametrize("base,dims,factor,old", [(500000.0, 128, 8.0, 8192),  # Llama 3.1 8B
                                                   (500000.0, 64, 32.0, 8192),  # Llama 3.2 1B
                                                   (10000.0, 64, 8.0, 1024)])
def test_llama3_rope_scaling_is_read_back_from_rope_freqs(base, dims, factor, old):
    from specdec.convert import llama3_rope_scaling

    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": old}
    divisors = llama3_divisors(scaling, base, dims).astype(np.float32)
    assert llama3_rope_scaling(divisors, base, dims) == scaling
    assert llama3_rope_scaling(np.ones(dims // 2, np.float32), base, dims) is None
    bent = divisors.copy()
    bent[np.flatnonzero((divisors > 1) & (divisors < factor))[0]] *= 1.01
    for bad in (bent, divisors[:-1], np.linspace(1, factor, dims // 2)):
        with pytest.raises(ConversionError, match="rope_freqs"):
            llama3_rope_scaling(bad, base, dims)


@pytest.mark.parametrize("family", ["qwen3", "mistral", "llama3-tied", "gemma2"])
def test_tokenizer_and_template_from_metadata_equal_the_sources(converted, family):
    from transformers import PreTrainedTokenizerFast

    src, _, out = converted(family, Q.Q4_K if family != "mistral" else Q.Q6_K)
    theirs = load(str(src)).tokenizer
    ours = load(str(out)).tokenizer
    for text in (TEXT, "x", " leading", "<|im_start|>user\nhi<|im_end|>", "🦀𝔘ǅẞ 鑫 Ꙭ"):
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == \
            theirs.decode(theirs.encode(text, add_special_tokens=False))
    if family != "mistral":  # SentencePiece decoding drops the first of two leading spaces
        assert ours.decode(ours.encode(TEXT, add_special_tokens=False)) == TEXT
    assert isinstance(ours, PreTrainedTokenizerFast)
    chat = [{"role": "user", "content": "Hi 東京"}, {"role": "assistant", "content": "🙂"}]
    assert ours.apply_chat_template(chat, tokenize=False) == \
        theirs.apply_chat_template(chat, tokenize=False)
    assert load(str(out)).eos_token_ids  # from metadata


SPEC_CASES = [("qwen3", Q.Q4_K), ("mistral", Q.Q6_K), ("gemma2", Q.Q4_K),
              ("llama3-tied", Q.Q4_0), ("llama3-untied", Q.Q5_K), ("qwen2.5", Q.Q6_K),
              ("phi3", Q.Q8_0), ("gemma3", Q.Q6_K)]


@pytest.mark.parametrize("family,qtype", SPEC_CASES, ids=[f"{f}-{q.name}" for f, q in SPEC_CASES])
def test_constrained_decoding_and_speculation_hold_on_a_converted_gguf(converted, family,
                                                                         qtype):
    assert blas.active() == "reference"
    _, _, out = converted(family, qtype)
    target = load(str(out))
    engines = {"self": Engine(target, target), "none": Engine(target, None)}
    engines["self"].compiler = engines["none"].compiler
    e = engines["none"]
    ids = e.chat_prompt(MESSAGES, constrained=True)
    bad: list[str] = []
    for params in MODES.values():
        bad += run_cells(engines, ids, SCHEMA, params, MAX_TOKENS, CELLS,
                         f"gguf: spec cells vs plain ({family} {qtype.name})")
    assert not bad, "\n".join(bad)
    # Gemma 3's sliding-window layers speculate while a request fits the window (64 here),
    # as rejected keys cannot be taken back from a wrapped ring; longer ones decode plainly.
    window = target.config.get("sliding_window") if family == "gemma3" else None
    n = MAX_TOKENS if window is None else window - len(ids) - 16  # room for a round
    assert n >= 4, n
    got = engines["self"].generate(engines["self"].prepare(
        ids, constraint=SCHEMA, max_tokens=n, spec=SpecConfig(4, lookup=True),
        close_at_budget=window is None))
    c = got.stats.counters
    assert c.proposed > 0 and c.spec_off == "", c.spec_off
    assert got.tokens == e.generate(e.prepare(ids, constraint=SCHEMA, max_tokens=n,
                                              close_at_budget=window is None)).tokens
    text = target.tokenizer.decode(list(got.tokens))
    if got.finish_reason == "stop":
        json.loads(text)


def test_unsupported_architecture_tensor_type_and_tokenizer_are_named(tmp_path):
    def write(name: str, arch: str, tokenizer: str, qtype: Q) -> Path:
        w = gguf.GGUFWriter(str(tmp_path / name), arch)
        for key, value in (("block_count", 1), ("context_length", 64),
                           ("embedding_length", 32), ("feed_forward_length", 32),
                           ("attention.head_count", 2)):
            w.add_uint32(f"{arch}.{key}", value)
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
        w.add_tokenizer_model(tokenizer)
        w.add_token_list(["a", "b", "ab"])
        w.add_token_types([1, 1, 1])
        w.add_token_merges(["a b"])
        x = np.zeros((2, 32), dtype=np.float32)
        data = x if qtype == Q.F32 else np.zeros((2, 32 // 32 * 18), dtype=np.uint8)
        w.add_tensor("token_embd.weight", data, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return tmp_path / name

    cases = [(write("a.gguf", "mamba", "gpt2", Q.F32), "architecture 'mamba'"),
             (write("t.gguf", "qwen2", "gpt2", Q.IQ4_NL), "type IQ4_NL"),
             (write("k.gguf", "qwen2", "rwkv", Q.F32), "tokenizer model 'rwkv'")]
    for path, message in cases:
        with pytest.raises(ConversionError, match=message):
            convert_gguf(path, tmp_path / (path.stem + "-out"), progress=False)
        assert not (tmp_path / (path.stem + "-out")).exists()


def test_a_gguf_path_converts_once_into_the_cache_and_the_cli_names_what_is_refused(
        converted, tmp_path, monkeypatch, capsys):
    from specdec import convert

    src, _, _ = converted("qwen3", Q.Q4_K)
    path = tmp_path / "user.gguf"
    write_gguf(src, "qwen3", Q.Q4_K, path)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    first = load(str(path))
    assert first.path.parent == tmp_path / "cache" / "models"
    assert first.path.name.startswith("user-") and first.config["model_type"] == "qwen3"
    assert first.name == "user"  # served under the file's name
    assert "conversion done" in capsys.readouterr().err

    def no_second_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(convert, "gguf_tensors", no_second_conversion)
    again = load(str(path))
    assert again.path == first.path
    assert [p.name for p in first.path.parent.iterdir()] == [first.path.name]  # no leftovers

    bad = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(bad), "rwkv6")
    w.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    run = subprocess.run([sys.executable, "-m", "specdec", "generate", "--model", str(bad),
                          "--prompt", "x"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "architecture 'rwkv6' is not supported" in run.stderr
    assert list((tmp_path / "cache" / "models").iterdir()) == [first.path]


# The split of the models' own tokenizer.json, by `tokenizer.ggml.pre` (Llama 3, Qwen 2).
SPLITS = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                 r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
             r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "smollm": None,
}


@pytest.mark.parametrize("pre", sorted(SPLITS))
def test_bpe_pre_tokenizer_follows_tokenizer_ggml_pre(converted, tmp_path, pre):
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    src, _, _ = converted("qwen3", Q.F16)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    if SPLITS[pre] is None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    model = json.loads(tok.to_str())["model"]
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in added else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model["merges"]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = Tokenizer.from_str(json.dumps(build_tokenizer_files(
        read_metadata(gguf.GGUFReader(path)))[0]))
    text = TEXT + " 1234567 it's   I'LL x\r\n\r\n  y"
    assert ours.encode(text).ids == tok.encode(text).ids
    assert ours.decode(ours.encode(text).ids) == text
    gpt2 = Tokenizer.from_file(str(src / "tokenizer.json"))  # the split matters here
    assert gpt2.encode(text).ids != tok.encode(text).ids


def gemma_meta(arch: str, layers: int, **keys) -> dict:
    """The metadata of a Gemma 2/3 GGUF as llama.cpp writes it (27B sizes), plus `keys`."""
    meta = {"general.architecture": arch, "tokenizer.ggml.tokens": ["<eos>", "a"],
            "tokenizer.ggml.eos_token_id": 0}
    hparams = {"block_count": layers, "context_length": 8192, "embedding_length": 4608,
               "feed_forward_length": 36864, "attention.head_count": 32,
               "attention.head_count_kv": 16, "attention.key_length": 128,
               "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1_000_000.0}
    for key, value in (hparams | keys).items():
        meta[f"{arch}.{key}"] = value
    return meta


def test_gemma_hyperparameters_are_read_as_llama_cpp_reads_them():
    # The query scale: 1/sqrt(head_dim), but 1/sqrt(hidden / heads) on the 27B models.
    cfg = build_config(gemma_meta("gemma2", 46), "float32")
    assert cfg["query_pre_attn_scalar"] == 4608 // 32 == 144
    assert build_config(gemma_meta("gemma2", 42), "float32")["query_pre_attn_scalar"] == 128
    # Gemma 2's defaults; the context is capped at the window (mlx-lm's gemma2 has none).
    assert (cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"]) == (50.0, 30.0)
    assert cfg["sliding_window"] == cfg["max_position_embeddings"] == 4096
    cfg = build_config(gemma_meta("gemma3", 62, embedding_length=5376,
                                  **{"attention.sliding_window": 1024}), "float32")
    assert cfg["model_type"] == "gemma3_text" and cfg["query_pre_attn_scalar"] == 5376 // 32
    assert (cfg["sliding_window"], cfg["sliding_window_pattern"]) == (1024, 6)
    assert (cfg["rope_theta"], cfg["rope_local_base_freq"]) == (1_000_000.0, 10000.0)
    assert "rope_scaling" not in cfg
    cfg = build_config(gemma_meta("gemma3", 34, **{
        "attention.sliding_window": 1024, "attention.sliding_window_pattern": 4,
        "rope.freq_base_swa": 20000.0, "rope.scaling.type": "linear",
        "rope.scaling.factor": 8.0}), "float32")
    assert cfg["query_pre_attn_scalar"] == 128 and cfg["sliding_window_pattern"] == 4
    assert cfg["rope_local_base_freq"] == 20000.0
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}  # global layers
    for meta, message in (
            (gemma_meta("gemma3", 26), "gemma3 GGUF without a sliding window"),
            (gemma_meta("gemma3", 26, **{"attention.sliding_window": 512,
                                         "rope.scaling.type": "yarn"}), "yarn RoPE scaling"),
            (gemma_meta("gemma2", 26, **{"rope.scaling.type": "linear"}),
             "gemma2 GGUF with linear RoPE scaling")):
        with pytest.raises(ConversionError, match=message):
            build_config(meta, "float32")


def test_an_unknown_bpe_pre_tokenizer_is_refused():
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "tekken",
            "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.token_type": [1],
            "tokenizer.ggml.merges": []}
    with pytest.raises(ConversionError, match="pre-tokenizer 'tekken'"):
        build_tokenizer_files(meta)


def test_served_by_name_from_a_gguf_file(converted, tmp_path):
    from tests.serverproc import Server

    src, _, _ = converted("mistral", Q.Q6_K)
    path = tmp_path / "mistral-q6_k.gguf"
    write_gguf(src, "mistral", Q.Q6_K, path)
    s = Server("--model", str(path), env={"SPECDEC_CACHE": str(tmp_path / "cache")})
    try:
        client = s.client()
        assert [m.id for m in client.models.list().data] == ["mistral-q6_k"]
        r = client.chat.completions.create(
            model="mistral-q6_k", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": SCHEMA.value}})
        assert r.choices[0].finish_reason in ("stop", "length")
        if r.choices[0].finish_reason == "stop":
            json.loads(r.choices[0].message.content)
    finally:
        s.stop()


def test_a_file_without_a_chat_template_completes_and_says_chat_needs_one(converted, tmp_path):
    from tests.serverproc import serve_app

    src, _, _ = converted("qwen2.5", Q.Q8_0)
    path = tmp_path / "bare.gguf"
    write_gguf(src, "qwen2.5", Q.Q8_0, path, template=False)
    out = convert_gguf(path, tmp_path / "bare", progress=False)
    (tmp_path / "t.jinja").write_text(TOKENIZERS["chatml"].template)
    for flags, chat in (((), False), (("--chat-template", str(tmp_path / "t.jinja")), True)):
        s = serve_app("--model", str(out), "--draft-model", "none", *flags)
        try:
            r = s.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200, r.text
            for api, body in (("/v1/chat/completions", {"messages": MESSAGES}),
                              ("/v1/responses", {"input": "hi"}),
                              ("/v1/messages", {"model": "bare", "messages": MESSAGES})):
                r = s.http.post(api, json={**body, "max_tokens": 3} if "input" not in body
                                else {**body, "max_output_tokens": 3})
                if chat:
                    assert r.status_code == 200, (api, r.text)
                else:
                    assert r.status_code == 400, (api, r.text)
                    assert "no chat template" in r.text and "--chat-template FILE" in r.text
        finally:
            s.stop()


def test_a_models_folder_of_gguf_files_converts_each_when_it_first_loads(
        converted, tmp_path, monkeypatch):
    import shutil

    from tests.serverproc import serve_app

    folder = tmp_path / "models"
    folder.mkdir()
    for family, qtype in (("qwen3", Q.Q4_K), ("mistral", Q.Q6_K)):
        write_gguf(converted(family, qtype)[0], family, qtype, folder / f"{family}.gguf")
    shutil.copytree(converted("qwen2.5", Q.Q8_0)[0], folder / "plain")  # a model directory
    (folder / "notes.txt").write_text("not a model")
    bad = gguf.GGUFWriter(str(folder / "rwkv.gguf"), "rwkv6")  # refused when it loads
    bad.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    bad.write_header_to_file()
    bad.write_kv_data_to_file()
    bad.write_tensors_to_file()
    bad.close()
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(cache))
    s = serve_app("--models-dir", str(folder), "--draft-model", "none")
    try:
        cards = {m["id"]: m for m in s.http.get("/v1/models").json()["data"]}
        assert set(cards) == {"mistral", "plain", "qwen3", "rwkv"}
        assert not (cache / "models").exists()  # nothing converted at start
        for api, body in (("/v1/chat/completions", {}), ("/v1/messages", {"max_tokens": 2})):
            r = s.http.post(api, json={"model": "rwkv", "messages": MESSAGES, **body})
            assert r.status_code == 503, r.text  # in the API's shape, naming the cause
            err = r.json()["error"]
            assert "architecture 'rwkv6' is not supported" in err["message"]
            assert err["code"] == "model_load_failed", err
        q = cards["qwen3"]  # from the file's header: GGUF's own names
        assert (q["family"], q["context_length"], q["loaded"]) == ("qwen3", 4096, False)
        r = s.http.post("/v1/chat/completions", json={
            "model": "qwen3", "messages": MESSAGES, "max_tokens": 4, "temperature": 0,
            "response_format": {"type": "json_object"}})
        assert r.status_code == 200, r.text
        assert [d.name.split("-")[0] for d in (cache / "models").iterdir()] == ["qwen3"]
    finally:
        s.stop()


# (measured here: 1.3e-2, 6.3e-2 and 4.1e-2 of the largest logit)
@pytest.mark.parametrize("family,qtype,bits,tol", [("qwen3", Q.Q4_K, 4, 0.05),
                                                   ("mistral", Q.Q6_K, 6, 0.15),
                                                   ("phi3", Q.Q5_0, 5, 0.1)])
def test_q4_requantizes_to_mlx_affine_bits_within_a_measured_error(converted, tmp_path,
                                                                   family, qtype, bits, tol):
    """Where memory is what runs out (Metal, CUDA: the `q4` format), a quantized GGUF type is
    requantized to MLX's affine format of about its bits per weight rather than widened to
    float32: the weights take about the file's bytes, and the logits stay within a measured
    error of the dequantized (float32) conversion."""
    src, _, out = converted(family, qtype)
    path = tmp_path / "f.gguf"
    write_gguf(src, family, qtype, path)
    q = convert_gguf(path, tmp_path / "q", "q4", progress=False)
    cfg = json.loads((q / "config.json").read_text())
    layer = "model.layers.0.mlp.down_proj"
    assert cfg["quantization"].get(layer, {"bits": 4})["bits"] == bits
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))  # noqa: E731
    assert size(q) < 1.6 * path.stat().st_size < size(out) / 2
    ours, dense = load(str(q)), load(str(out))
    assert isinstance(ours.model.model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    ids = mx.array([dense.tokenizer.encode(TEXT)])
    a, b = ours.model(ids), dense.model(ids)
    rel = float(mx.abs(a - b).max() / mx.abs(b).max())
    tally.NOTES.append(f"gguf {family} {qtype.name} requantized to {bits}-bit affine: logits "
                       f"vs the float32 conversion, max error / max logit {rel:.1e}")
    assert rel < tol, rel


def test_a_conversion_writes_its_weights_a_shard_at_a_time(converted, tmp_path, monkeypatch):
    """Shards of `SHARD_BYTES` (here a small one) with their index: the same model."""
    from specdec import convert

    src, _, whole = converted("qwen2.5", Q.Q6_K)
    path = tmp_path / "f.gguf"
    write_gguf(src, "qwen2.5", Q.Q6_K, path)
    monkeypatch.setattr(convert, "SHARD_BYTES", 1 << 20)
    out = convert_gguf(path, tmp_path / "sharded", progress=False)
    files = sorted(f.name for f in out.glob("*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(files) > 3 and set(index["weight_map"].values()) == set(files)
    assert [f.name for f in whole.glob("*.safetensors")] == ["model.safetensors"]
    a, b = load(str(out)), load(str(whole))
    ids = mx.array([b.tokenizer.encode(TEXT)])
    assert mx.array_equal(a.model(ids), b.model(ids))


def test_progress_is_a_bar_on_a_terminal_and_lines_in_a_log(capsys):
    from specdec.convert import Progress

    class Tty:
        def __init__(self) -> None:
            self.text = ""

        def write(self, s: str) -> None:
            self.text += s

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return True

    tty = Tty()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sys, "stderr", tty)
        bar = Progress("converting f.gguf", 1000, True)
        for _ in range(10):
            bar.advance(100)
    assert tty.text.count("\r") == 10 and tty.text.endswith("100% 0.00/0.00 GiB\n")
    log = Progress("converting f.gguf", 1000, True)
    for _ in range(40):
        log.advance(25)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 11 and lines[-1].startswith("specdec: converting f.gguf: 100%")
    Progress("x", 10, False).advance(10)
    assert capsys.readouterr().err == ""
