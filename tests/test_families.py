"""The model families people serve on MLX (tests/families.py: mlx-lm's own model classes,
small random weights, real-shaped configs, locally trained ByteLevel and byte-fallback
tokenizers): plain decoding against the oracle, and the speculative cells against plain,
greedy and seeded, on the reference BLAS.

Families whose caches cannot drop rejected proposals exactly (recurrent state; a sliding
window that wraps within the request) decode those requests plainly and say why
(`stats.spec_off`); the cells still run and must still equal plain.
"""

from __future__ import annotations

import pytest

from oracle import BudgetOracle, reference_decode
from specdec import blas
from specdec.engine import Engine
from specdec.grammar import Constraint
from specdec.models import load
from specdec.speculative import SpecConfig
from tests import tally
from tests.exactness import MODES, Cell, plain, run_cells
from tests.families import (FAMILIES, TOKENIZERS, hf_cache_with, make_family,
                            make_tokenizer, quantize_family)

SCHEMA = Constraint("json_schema", {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "age": {"type": "integer"},
                                     "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
    "required": ["name", "age", "tags"], "additionalProperties": False})
MESSAGES = [{"role": "user", "content": "Extract the fields as JSON: Ada, 36, tags a and b."}]
MAX_TOKENS = 40
CELLS = [
    Cell("self", SpecConfig(4, lookup=True)),
    Cell("self", SpecConfig(2, draft_masking=False)),
    Cell("self", SpecConfig(4, forced_drafting=False, lookup=True)),
    Cell("none", SpecConfig(8, lookup=True)),
]
# Why a family decodes plainly (None: it speculates).
PLAIN_BECAUSE = {"lfm2": "ArraysCache", "gemma3": "sliding-window"}


def _plain_and_oracle(e, target, ids, constraint, params):
    """Plain decoding of a request and the oracle's decode of it (its logit bias included)."""
    want = plain(e, ids, constraint, params, MAX_TOKENS) if constraint else \
        e.generate(e.prepare(ids, sampling=params, max_tokens=MAX_TOKENS, spec=None))
    g = e.compiled(e.prepare(ids, constraint=constraint)) if constraint else None
    ref = reference_decode(target.model, ids, vocab_size=target.vocab_size,
                           eos_token_ids=target.eos_token_ids, max_tokens=MAX_TOKENS,
                           matcher=g.matcher() if g else None, temperature=params.temperature,
                           top_k=params.top_k, top_p=params.top_p, seed=params.seed or 0,
                           logit_bias=params.logit_bias,
                           budget=BudgetOracle.of(e.compiler.tokenizer, target.vocab_size,
                                                  target.eos_token_ids, MAX_TOKENS) if g else None)
    return want, ref


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")

    def get(name: str):
        base, _, bits = name.partition("-q")
        if bits:  # a quantized copy: "<family>-q4", "<family>-q8"
            return quantize_family(get(base), root / name, int(bits))
        return root / name if (root / name / "config.json").exists() else \
            make_family(name, root / name)
    return get


TEXTS = ["Hi 🙂👍🏽 東京の天気 crème brûlée naïve — 안녕", "rare: 🦀𝔘ǅẞ 鑫 Ꙭ end",
         " leading space,  double  spaces\nand a newline 🙂", '{"a": "Zürich 数据", "b": [1]}']


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_streamed_text_equals_the_final_text_for_every_tokenizer_kind(tmp_path, kind):
    # Byte-fallback tokenizers decode a partial character to one U+FFFD per pending byte;
    # none of them may reach a stream, and the joined deltas must be the final text.
    from transformers import PreTrainedTokenizerFast

    from specdec.output import TextStream

    make_tokenizer(TOKENIZERS[kind], tmp_path)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        for stop in ((), ("数据",), ("🦀",)):
            ts = TextStream(lambda x: tok.decode(x, skip_special_tokens=False), stop)
            deltas = []
            for i in ids:
                d, stopped = ts.feed(i)
                deltas.append(d)
                if stopped:
                    break
            finish, final = ts.close("length")
            full = tok.decode(ids, skip_special_tokens=False)
            want = full[:min(full.find(x) for x in stop if x in full)] if any(
                x in full for x in stop) else full
            assert final == want and finish == ("stop" if want != full else "length")
            assert "".join(deltas) == final[:len("".join(deltas))]
            assert not any("\ufffd" in d for d in deltas), (kind, text, deltas)
            if not stop:
                assert "".join(deltas) == final, (kind, text)


@pytest.mark.parametrize("name", ["llama3-tied", "gemma3", "mistral", "qwen3"])
def test_raw_prompts_get_the_tokenizers_bos_once_and_chats_the_templates(family_dir, name):
    target = load(str(family_dir(name)))
    e = Engine(target, None)
    tok = target.tokenizer
    bos = tok.bos_token_id if tok.bos_token else None
    raw = e.encode("Hello there", raw=True)
    assert (raw[0] == bos and raw[1] != bos) if bos is not None else \
        raw == e.encode("Hello there")
    if bos is not None:  # a raw prompt that writes its own BOS keeps one
        own = e.encode(tok.bos_token + "Hello there", raw=True)
        assert own[0] == bos and own.count(bos) == 1
    chat = e.chat_prompt(MESSAGES, constrained=True)
    if bos is not None:
        assert chat[0] == bos and chat.count(bos) == 1


@pytest.mark.parametrize("name", sorted(FAMILIES) + ["llama3-tied-q4", "qwen3-q8"])
def test_family_plain_equals_oracle_and_cells_equal_plain(family_dir, name):
    assert blas.active() == "reference"
    target = load(str(family_dir(name)))
    engines = {"self": Engine(target, target), "none": Engine(target, None)}
    engines["self"].compiler = engines["none"].compiler
    engines["self"].kv_store = engines["none"].kv_store
    e = engines["none"]
    ids = e.chat_prompt(MESSAGES, constrained=True)
    if name == "gemma3":  # prompt + output run past the sliding window (64)
        assert len(ids) + MAX_TOKENS > 64
    bad: list[str] = []
    for mode, params in MODES.items():
        for constraint in (SCHEMA, None):
            want, ref = _plain_and_oracle(e, target, ids, constraint, params)
            same = list(want.tokens) == list(ref.tokens)
            tally.record("families: plain vs oracle", same)
            if not same:
                bad.append(f"{mode} {'schema' if constraint else 'free'}: plain {want.tokens} "
                           f"!= oracle {ref.tokens}")
        bad += run_cells(engines, ids, SCHEMA, params, MAX_TOKENS, CELLS,
                         f"families: spec cells vs plain ({name})")
    assert not bad, "\n".join(bad)
    # Speculating families propose; the others decode plainly and say why.
    got = engines["self"].generate(engines["self"].prepare(
        ids, constraint=SCHEMA, max_tokens=MAX_TOKENS, spec=SpecConfig(4, lookup=True)))
    reason, c = PLAIN_BECAUSE.get(name), got.stats.counters
    if reason is None:
        assert c.spec_off == "" and c.proposed > 0
    else:
        assert reason in c.spec_off and c.proposed == 0
    tally.NOTES.append(f"family {name}: "
                       f"{'speculates' if reason is None else 'plain: ' + c.spec_off}")
    if name == "gemma3":  # a request that ends before the window wraps speculates
        # (cut at 6 tokens, under its minimum: plain truncation, the budget rule off)
        short = engines["self"].generate(engines["self"].prepare(
            ids, constraint=SCHEMA, max_tokens=6, spec=SpecConfig(4, lookup=True),
            close_at_budget=False))
        assert len(ids) + 6 + 8 < 64
        assert short.stats.counters.spec_off == "" and short.stats.counters.proposed > 0
        assert short.tokens == e.generate(e.prepare(ids, constraint=SCHEMA, max_tokens=6,
                                                    spec=None, close_at_budget=False)).tokens


@pytest.mark.parametrize("name", ["lfm2", "gemma3", "qwen3"])
def test_family_served_with_lookup_and_a_draft_never_fails(family_dir, name):
    # Served with a draft model and prompt lookup on: 20 requests in a row, streaming and
    # not, constrained and not, greedy and seeded. A hybrid model (recurrent state: no exact
    # trim) and requests that would wrap Gemma's window decode plainly and say why; every
    # answer is what plain decoding answers, never a 5xx.
    import json

    import httpx

    from tests.serverproc import Server

    reason = {"lfm2": "ArraysCache", "gemma3": "sliding-window", "qwen3": ""}[name]
    target = family_dir(name)
    draft = make_family(name, target.parent / f"{name}-draft", seed=1)
    s = Server("--model", str(target), "--draft-model", str(draft), "--num-draft-tokens", "4")
    try:
        client = s.client()
        for i in range(20):
            kind = ["schema", "free", "schema-stream", "free-stream"][i % 4]
            body: dict = {"model": "default", "max_tokens": 24, "messages": MESSAGES,
                          "temperature": 0 if i % 3 else 0.7, "seed": i}
            if kind.startswith("schema"):
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "x", "schema": SCHEMA.value}}
            plain_body = dict(body, num_draft_tokens=0)
            if kind.endswith("stream"):
                parts = []
                with client.chat.completions.create(stream=True, **{
                        k: v for k, v in body.items() if k not in ("seed",)},
                        seed=i) as stream:
                    for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content:
                            parts.append(chunk.choices[0].delta.content)
                text = "".join(parts)
            else:
                r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=300)
                assert r.status_code == 200, r.text
                ext = r.json()["specdec"]
                if reason:
                    assert reason in ext.get("spec_off", ""), ext
                else:
                    assert "spec_off" not in ext and ext["proposed"] > 0, ext
                text = r.json()["choices"][0]["message"]["content"]
            want = httpx.post(s.url + "/v1/chat/completions", json=plain_body, timeout=300)
            assert want.status_code == 200, want.text
            assert text == want.json()["choices"][0]["message"]["content"], (i, kind)
            if kind.startswith("schema") and want.json()["choices"][0]["finish_reason"] == "stop":
                json.loads(text)
        assert ("speculation limited" in s.log()) == bool(reason)
    finally:
        s.stop()


def test_end_of_turn_ids_come_from_generation_config(family_dir):
    # Gemma's <end_of_turn> and Llama 3's <|eot_id|> are only in generation_config.json.
    for name, turn in (("gemma3", "<end_of_turn>"), ("llama3-tied", "<|eot_id|>")):
        m = load(str(family_dir(name)))
        assert m.tokenizer.convert_tokens_to_ids(turn) in m.eos_token_ids, name
        assert m.tokenizer.eos_token_id in m.eos_token_ids, name


def test_a_repo_id_resolves_from_the_local_hugging_face_cache(family_dir, tmp_path,
                                                               monkeypatch):
    from specdec.models import ModelNotFoundError

    snap = hf_cache_with(family_dir("qwen3"), tmp_path / "hub", "specdec-tests/tiny-qwen3")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    m = load("specdec-tests/tiny-qwen3")
    assert m.path == snap and m.vocab_size == load(str(family_dir("qwen3"))).vocab_size
    with pytest.raises(ModelNotFoundError, match="never downloaded"):
        load("specdec-tests/not-cached")


@pytest.mark.parametrize("name", ["lfm2", "gemma3"])
def test_prompt_state_reuse_deep_copies_every_cache_kind(family_dir, name):
    # Recurrent state (a list the live cache mutates) and a ring buffer: a request served
    # from the stored prompt state decodes exactly as one prefilled from scratch.
    target = load(str(family_dir(name)))
    fresh, stored = Engine(target, None), Engine(target, None)
    fresh.kv_store.capacity = 0
    ids = fresh.chat_prompt(MESSAGES, constrained=False)
    req = dict(max_tokens=MAX_TOKENS, spec=None)
    want = fresh.generate(fresh.prepare(ids, **req)).tokens
    for _ in range(3):
        assert stored.generate(stored.prepare(ids, **req)).tokens == want
    assert stored.kv_store.hits >= 2


@pytest.mark.parametrize("name", ["llama3-tied", "qwen3"])
def test_logit_bias_is_applied_before_the_mask_in_every_path(family_dir, name):
    # The bias moves the target's logits before the grammar mask: plain decoding equals the
    # oracle's rule, speculative cells equal plain, and a huge bias on a token the grammar
    # forbids never lets it out.
    import dataclasses
    import json

    target = load(str(family_dir(name)))
    engines = {"self": Engine(target, target), "none": Engine(target, None)}
    engines["self"].compiler = engines["none"].compiler
    e = engines["none"]
    ids = e.chat_prompt(MESSAGES, constrained=True)
    free = e.generate(e.prepare(ids, max_tokens=8, spec=None)).tokens
    quote = target.tokenizer.convert_tokens_to_ids("Ġ{") or 0
    bias = tuple(sorted({(free[0], -100.0), (free[1], 7.5), (quote, 100.0)}))
    bad: list[str] = []
    for mode, params in MODES.items():
        params = dataclasses.replace(params, logit_bias=bias)
        for constraint in (SCHEMA, None):
            want, ref = _plain_and_oracle(e, target, ids, constraint, params)
            assert list(want.tokens) == list(ref.tokens), (mode, constraint)
            tally.record("families: plain vs oracle, logit bias", True)
            if constraint is None:
                assert free[0] not in want.tokens[:1]  # -100 moved the first pick
            elif want.finish_reason == "stop":
                json.loads(want.text)
        bad += run_cells(engines, ids, SCHEMA, params, MAX_TOKENS, CELLS,
                         f"families: spec cells vs plain, logit bias ({name})")
    assert not bad, "\n".join(bad)
