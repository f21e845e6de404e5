"""Small random-weight models of the families people serve on MLX, made locally.

Each family is an mlx-lm model directory like a user's: `config.json` with a real-shaped
config (its model_type, head layout, norms, window, layer kinds; tiny sizes), random weights
in `model.safetensors`, a `generation_config.json` with the family's end-of-turn id, and a
tokenizer of the family's kind trained here with `tokenizers` on a small corpus:
ByteLevel BPE (Llama 3, Qwen, Phi 3 in this matrix) or SentencePiece-style BPE with byte
fallback (Gemma, Mistral/Llama 2), each with its chat template. Nothing is downloaded.

TOOL_FORMATS: the tool-calling formats (Hermes/Qwen 2.5, Qwen 3, Llama 3.1 JSON, Mistral v0.3,
Qwen3-Coder XML, GLM-4.5 XML, DeepSeek V3, gpt-oss Harmony), each a family's tokenizer with
that format's markup tokens (as the real tokenizers have them: special or added text tokens),
its chat template (tests/templates/tools_*.jinja, of the real template's shape) and its
end-of-turn ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

CORPUS = [
    '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"], "active": true}',
    '{"city": "Zürich", "country": "Schweiz", "temp": -3.5, "note": null}',
    '{"title": "東京の天気", "summary": "晴れ時々曇り", "score": 0.87}',
    '{"emoji": "🙂👍🏽", "caf\\u00e9": "crème brûlée", "naïve": false}',
    "The quick brown fox jumps over the lazy dog. Façade, jalapeño, smörgåsbord.",
    "Extract the fields as JSON: name, age, city. Answer with one object.",
    "user assistant system: hello, how are you? I am fine, thank you! 12345 67890",
    "数据 结构 算法 模型 — 你好，世界。こんにちは世界。안녕하세요.",
    "[1, 2, 3], {\"a\": {\"b\": [true, false, null]}}, \"x\\ny\", 3.14e-2",
] * 3

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
          "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
          "{% endif %}")
GEMMA = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
         "{{ 'model' if m['role'] == 'assistant' else 'user' }}\n{{ m['content'] }}"
         "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
         "{% endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
           "{{ m['content'] }}{{ eos_token }}{% else %}[INST] {{ m['content'] }} [/INST]"
           "{% endif %}{% endfor %}")


@dataclass(frozen=True)
class TokenizerKind:
    """A tokenizer shape: `byte_level` (GPT-2 style) or byte fallback (SentencePiece style);
    its special tokens; which of them are BOS, EOS and the end-of-turn id."""

    byte_level: bool
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    end_of_turn: str
    template: str
    # Tokens added after training as text (not special: they decode with the text), as the
    # real tokenizers add <tool_call> or <think>; and lines trained on besides CORPUS.
    added: tuple[str, ...] = ()
    corpus: tuple[str, ...] = ()
    # SentencePiece style: a space is prepended to the text (`add_dummy_prefix`).
    space_prefix: bool = True


TOKENIZERS = {
    "chatml": TokenizerKind(True, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None,
                            "<|endoftext|>", "<|im_end|>", CHATML),
    "llama3": TokenizerKind(True, ("<|begin_of_text|>", "<|end_of_text|>",
                                   "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
                            "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", LLAMA3),
    "gemma": TokenizerKind(False, ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>",
                                   "<end_of_turn>"), "<bos>", "<eos>", "<end_of_turn>", GEMMA),
    "mistral": TokenizerKind(False, ("<unk>", "<s>", "</s>", "[INST]", "[/INST]"), "<s>",
                             "</s>", "</s>", MISTRAL),
}


THINK_TOKENS = ("<think>", "</think>")

TEMPLATES = Path(__file__).parent / "templates"


def _template(name: str) -> str:
    return (TEMPLATES / name).read_text()


# Text of the tool formats' markup (what is not a single token), so the trained BPE spells it
# in few pieces.
TOOL_CORPUS = (
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '{"name": "get_time", "parameters": {"zone": "UTC"}}',
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
    '"required": ["city"]}}}',
    '{"content": "sunny", "call_id": "a1b2c3d4e", "id": "a1b2c3d4e", "output": "sunny"}',
    "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>",
    "<tools>\n</tools> # Tools You may call one or more functions to assist with the query.",
    "function\n```json\n{\"city\": \"Paris\"}\n```",
    "assistant commentary to=functions.get_weather json analysis final to=assistant",
    "namespace functions { type get_weather = (_: { city: string, }) => any; }",
    "system user assistant tool ipython developer Environment: ipython",
)

QWEN_TOOL_TOKENS = ("<tool_call>", "</tool_call>")  # Qwen 2.5: added, not special
QWEN3_TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                     "<think>", "</think>")  # Qwen 3 (and Qwen3-Coder): added, not special
GLM_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
              "<arg_value>", "</arg_value>", "<tool_response>",
              "</tool_response>")  # GLM-4.5: added, not special
DEEPSEEK_TOKENS = ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
                   "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                   "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                   "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
                   "<｜tool▁sep｜>")  # DeepSeek V3: added, not special

TOKENIZERS.update({
    # Gemma 2 and 3's own SentencePiece model: no space prepended (llama.cpp writes
    # add_space_prefix false for them).
    "gemma2": replace(TOKENIZERS["gemma"], space_prefix=False),
    "qwen2.5-tools": replace(TOKENIZERS["chatml"], added=QWEN_TOOL_TOKENS, corpus=TOOL_CORPUS,
                             template=_template("tools_hermes.jinja")),
    "qwen3-tools": replace(TOKENIZERS["chatml"], added=QWEN3_TOOL_TOKENS, corpus=TOOL_CORPUS,
                           template=_template("tools_qwen3.jinja")),
    "llama3.1": TokenizerKind(True, ("<|begin_of_text|>", "<|end_of_text|>",
                                     "<|finetune_right_pad_id|>", "<|start_header_id|>",
                                     "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
                                     "<|python_tag|>"),
                              "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>",
                              _template("tools_llama31.jinja"), corpus=TOOL_CORPUS),
    "mistral-v3": TokenizerKind(False, ("<unk>", "<s>", "</s>", "[INST]", "[/INST]",
                                        "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                        "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                                        "[/TOOL_RESULTS]"),
                                "<s>", "</s>", "</s>", _template("tools_mistral.jinja"),
                                corpus=TOOL_CORPUS),
    "deepseek-v3": TokenizerKind(True, ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                                        "<｜▁pad▁｜>"),
                                 "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                                 "<｜end▁of▁sentence｜>", _template("tools_deepseek.jinja"),
                                 added=DEEPSEEK_TOKENS, corpus=TOOL_CORPUS),
    # GLM-4.5: the turn markers special; generation ends at the next turn's marker.
    "glm": TokenizerKind(True, ("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>",
                                "<eop>", "<|system|>", "<|user|>", "<|assistant|>",
                                "<|observation|>"),
                         None, "<|endoftext|>", "<|user|>", _template("tools_glm.jinja"),
                         added=GLM_TOKENS, corpus=TOOL_CORPUS),
    # Gemma 4: the turn and channel markers special; generation ends with <turn|>.
    "gemma4": TokenizerKind(False, ("<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>",
                                    "<|channel>", "<channel|>", "<|think|>"), "<bos>", "<eos>",
                            "<turn|>", _template("gemma4_style.jinja")),
    # Seed-OSS: <seed:bos> / <seed:eos> special, the think tags added as text tokens.
    "seed-oss": TokenizerKind(True, ("<seed:bos>", "<seed:eos>", "<seed:pad>"), None,
                              "<seed:eos>", "<seed:eos>", _template("seed_oss_style.jinja"),
                              added=("<seed:think>", "</seed:think>")),
    # o200k_harmony: every Harmony marker special; generation ends with <|return|> (an answer)
    # or <|call|> (a tool call); no BOS added to encoded text.
    "harmony": TokenizerKind(True, ("<|startoftext|>", "<|endoftext|>", "<|return|>",
                                    "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
                                    "<|message|>", "<|call|>"),
                             None, "<|return|>", "<|call|>", _template("tools_harmony.jinja"),
                             corpus=TOOL_CORPUS),
})


def make_tokenizer(kind: TokenizerKind, out: Path, vocab: int = 700, think: bool = False
                   ) -> int:
    """Train a BPE tokenizer of this kind on CORPUS into `out`; returns its vocabulary size.
    `think`: add `<think>` and `</think>` as single tokens, as Qwen 3 and DeepSeek-R1 do
    (added, not special: they decode as text)."""
    from tokenizers import (AddedToken, Tokenizer, decoders, models, normalizers,
                            pre_tokenizers, trainers)

    if kind.byte_level:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        specials = list(kind.specials)
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if kind.space_prefix else "never",
            split=False)
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(
            steps + ([decoders.Strip(" ", 1, 0)] if kind.space_prefix else []))
        alphabet = []
        # The 256 byte tokens come right after the specials, as in SentencePiece models.
        specials = list(kind.specials) + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS + list(kind.corpus), trainer)
    added = list(kind.added) + [t for t in THINK_TOKENS if think and t not in kind.added]
    if added:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    if kind.bos:  # as the families' own tokenizer.json: BOS added to encoded text
        from tokenizers import processors

        tok.post_processor = processors.TemplateProcessing(
            single=f"{kind.bos} $A", pair=f"{kind.bos} $A $B",
            special_tokens=[(kind.bos, tok.token_to_id(kind.bos))])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                           "eos_token": kind.eos, "chat_template": kind.template,
                           "clean_up_tokenization_spaces": False,
                           "model_max_length": 4096}
    if kind.bos:
        cfg["bos_token"] = kind.bos
    if not kind.byte_level:
        cfg["unk_token"] = "<unk>"
        cfg["add_bos_token"] = True
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    return tok.get_vocab_size()


def _common(vocab: int, **kw: Any) -> dict[str, Any]:
    base = {"vocab_size": vocab, "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "rope_theta": 10000.0}
    base.update(kw)
    return base


# family -> (tokenizer kind, config maker)
FAMILIES: dict[str, tuple[str, Any]] = {
    "llama3-untied": ("llama3", lambda v: _common(v, model_type="llama",
                                                  tie_word_embeddings=False,
                                                  rope_scaling={"rope_type": "llama3",
                                                                "factor": 8.0,
                                                                "low_freq_factor": 1.0,
                                                                "high_freq_factor": 4.0,
                                                                "original_max_position_"
                                                                "embeddings": 1024})),
    "llama3-tied": ("llama3", lambda v: _common(v, model_type="llama",
                                                tie_word_embeddings=True)),
    "qwen2.5": ("chatml", lambda v: _common(v, model_type="qwen2", tie_word_embeddings=True)),
    "qwen3": ("chatml", lambda v: _common(v, model_type="qwen3", head_dim=16,
                                          tie_word_embeddings=True)),
    "gemma2": ("gemma2", lambda v: _common(v, model_type="gemma2", head_dim=16,
                                           query_pre_attn_scalar=16,
                                           attn_logit_softcapping=50.0,
                                           final_logit_softcapping=30.0, sliding_window=4096)),
    "gemma3": ("gemma", lambda v: _common(v, model_type="gemma3_text", head_dim=16,
                                          num_hidden_layers=3, query_pre_attn_scalar=16,
                                          sliding_window=64, sliding_window_pattern=2,
                                          rope_local_base_freq=10000.0)),
    "mistral": ("mistral", lambda v: _common(v, model_type="mistral",
                                             tie_word_embeddings=False)),
    "phi3": ("chatml", lambda v: _common(v, model_type="phi3", tie_word_embeddings=False)),
    "lfm2": ("chatml", lambda v: {
        "model_type": "lfm2", "vocab_size": v, "hidden_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": 64,
        "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False, "block_ff_dim": 128, "rope_theta": 10000.0,
        "layer_types": ["conv", "full_attention", "conv"], "tie_embedding": True}),
}


def make_family(name: str, out: Path, seed: int = 0, think: bool = False,
                template: str | None = None, scale: float = 8.0, tokenizer: str | None = None,
                eos: tuple[str, ...] | None = None, sizes: dict[str, Any] | None = None
                ) -> Path:
    """Write family `name`'s model directory to `out` (random weights from `seed`); `think`:
    its tokenizer has the think tokens; `template`: its chat template instead of the
    family's; `scale`: the embeddings' and head's factor (smaller: flatter choices);
    `tokenizer`: a TOKENIZERS kind instead of the family's; `eos`: the tokens that end
    generation (generation_config.json) instead of the kind's EOS and end of turn; `sizes`:
    config values instead of the tiny defaults (e.g. rows as wide as a K-quant block)."""
    from mlx_lm.utils import _get_classes

    tok_name, config_of = FAMILIES[name]
    kind = TOKENIZERS[tokenizer or tok_name]
    if template is not None:
        kind = replace(kind, template=template)
    vocab = make_tokenizer(kind, out, think=think)
    tok = json.loads((out / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    config = config_of(vocab) | (sizes or {})
    config["eos_token_id"] = ids[kind.eos]
    if kind.bos:
        config["bos_token_id"] = ids[kind.bos]
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    # Scaled weights give clear, seed-specific winners (random small models are near-flat).
    params = dict(tree_flatten(model.parameters()))
    for k, v in params.items():
        if k.endswith("embed_tokens.weight") or k.endswith("lm_head.weight"):
            params[k] = v * scale
    mx.eval(params)
    mx.save_safetensors(str(out / "model.safetensors"), params)
    (out / "config.json").write_text(json.dumps(config))
    # The end-of-turn id comes from generation_config.json only, as for Gemma and Llama 3.
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": sorted({ids[t] for t in (eos or (kind.eos, kind.end_of_turn))})}))
    return out


@dataclass(frozen=True)
class ToolFamily:
    """A tool-calling format: the model config (a FAMILIES name; the architecture does not
    matter to the format), the TOKENIZERS kind with the format's tokens, the chat template
    (a file in tests/templates/) and the tokens that end generation, as the real family's
    generation_config.json lists them."""

    family: str
    tokenizer: str
    template: str
    eos: tuple[str, ...]


TOOL_FORMATS: dict[str, ToolFamily] = {
    # Qwen 2.5 Instruct: generation_config [<|endoftext|>, <|im_end|>] (151643, 151645).
    "hermes": ToolFamily("qwen2.5", "qwen2.5-tools", "tools_hermes.jinja",
                         ("<|endoftext|>", "<|im_end|>")),
    "qwen3": ToolFamily("qwen3", "qwen3-tools", "tools_qwen3.jinja",
                        ("<|endoftext|>", "<|im_end|>")),
    # Llama 3.1 Instruct: [<|end_of_text|>, <|eom_id|>, <|eot_id|>] (128001, 128008, 128009).
    "llama31": ToolFamily("llama3-untied", "llama3.1", "tools_llama31.jinja",
                          ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")),
    "mistral": ToolFamily("mistral", "mistral-v3", "tools_mistral.jinja", ("</s>",)),
    "qwen3_coder": ToolFamily("qwen3", "qwen3-tools", "tools_qwen3_coder.jinja",
                              ("<|endoftext|>", "<|im_end|>")),
    "deepseek": ToolFamily("llama3-tied", "deepseek-v3", "tools_deepseek.jinja",
                           ("<｜end▁of▁sentence｜>",)),
    # GLM-4.5: [<|endoftext|>, <|user|>, <|observation|>] (151329, 151336, 151338).
    "glm": ToolFamily("qwen3", "glm", "tools_glm.jinja",
                      ("<|endoftext|>", "<|user|>", "<|observation|>")),
    # gpt-oss: [<|return|>, <|endoftext|>, <|call|>] (200002, 199999, 200012).
    "harmony": ToolFamily("llama3-tied", "harmony", "tools_harmony.jinja",
                          ("<|return|>", "<|endoftext|>", "<|call|>")),
}


# Always-thinking templates (their generation prompt opens the reasoning, with no switch):
# not in TOOL_FORMATS, whose requests answer without reasoning.
ALWAYS_THINKING: dict[str, ToolFamily] = {
    "r1_distill": ToolFamily("llama3-tied", "deepseek-v3", "tools_r1_distill.jinja",
                             ("<｜end▁of▁sentence｜>",)),
}


def make_tool_family(key: str, out: Path, seed: int = 0) -> Path:
    """Write the model directory of tool format `key` (TOOL_FORMATS, ALWAYS_THINKING) to
    `out`."""
    f = TOOL_FORMATS[key] if key in TOOL_FORMATS else ALWAYS_THINKING[key]
    return make_family(f.family, out, seed, template=_template(f.template),
                       tokenizer=f.tokenizer, eos=f.eos)


def quantize_family(src: Path, out: Path, bits: int) -> Path:
    """An mlx-lm quantized copy (affine, group size 32) of the model directory `src`, the
    format mlx-community models ship in."""
    import shutil

    from mlx_lm.utils import load as mlx_load
    from mlx_lm.utils import quantize_model

    model, _ = mlx_load(str(src))[:2]
    config = json.loads((src / "config.json").read_text())
    model, config = quantize_model(model, config, 32, bits)
    out.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / f, out / f)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config))
    return out


def hf_cache_with(model_dir: Path, cache: Path, repo_id: str) -> Path:
    """Lay `model_dir` out as `repo_id` in a Hugging Face cache rooted at `cache` (what
    `huggingface-cli download` leaves behind): refs/main naming a snapshot of the files."""
    import shutil

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = "0" * 40
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in model_dir.iterdir():
        shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snap
