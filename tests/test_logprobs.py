"""Logprobs against the oracle's own: what the server returns for each output token (Chat
Completions' `logprobs.content`, streamed and whole, and /v1/completions' lists) is what the
oracle computes in numpy from its own logits by the documented definition (log_softmax of
the biased, grammar-masked logits over the temperature, 1 when greedy) — greedy and seeded,
with top-k/top-p and logit_bias, constrained and free, plain (`num_draft_tokens: 0`) and
speculative (the served distilled draft). On the reference BLAS (this suite's) the engine's
logits are bitwise the oracle's; `oracle.compare_logprobs` says what "equal" allows for the
rest (float32 vs float64 arithmetic).

Half the cells also ask for the token sources extension (`token_sources`): its tokens are
the oracle's, each one's allowed-set size is the oracle's own mask count (None where
unconstrained), "budget" marks exactly the positions where the oracle's closing rule changed
the pick, "forced" every position whose mask allowed one token, and its logprobs are the
ones checked here."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from oracle import (BudgetOracle, LogprobComparison, OracleResult, OracleStep, ServedLogprob,
                    compare_logprobs, reference_decode)
from oracle.compare import SHAPE_TOL
from oracle.reference import NEAR_TIE
from oracle.sampler import log_probs, top_logprobs
from server.chat_wire import ChatCompletionRequest, CompletionRequest
from server.chat import to_request
from tests import tally
from tests.serverproc import serve_app

MAX_TOKENS = 8
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a city and its country."}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
          "properties": {"city": {"type": "string", "maxLength": 20},
                         "country": {"type": "string", "maxLength": 20}}}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
# "The" down, " city", "Paris" and "France" up, " Paris" banned: tokens these outputs use.
BIAS = {"504": -2.0, "2240": 2.0, "38634": 3.0, "33488": 1.5, "7042": -100}


@dataclass(frozen=True)
class Cell:
    """One request, sent plain and speculative: its endpoint and body fields."""

    endpoint: str  # "chat" or "completions"
    fields: dict[str, Any]


CELLS = {
    "chat greedy free": Cell("chat", dict(temperature=0, top_logprobs=5)),
    "chat seeded free, streamed": Cell("chat", dict(
        temperature=0.8, seed=7, top_logprobs=5, stream=True,
        stream_options={"include_usage": True}, token_sources=5)),
    "chat seeded top-k top-p bias free": Cell("chat", dict(
        temperature=0.6, seed=3, top_k=20, top_p=0.9, logit_bias=BIAS, top_logprobs=5)),
    "chat greedy bias schema": Cell("chat", dict(
        temperature=0, logit_bias=BIAS, response_format=JSON_FORMAT, top_logprobs=0,
        max_tokens=14, token_sources=True)),
    "chat greedy bias schema, budget steered": Cell("chat", dict(
        temperature=0, logit_bias=BIAS, response_format=JSON_FORMAT, top_logprobs=2,
        max_tokens=11, token_sources=2)),  # (the answer needs 12: the budget steers the close)
    "chat seeded top-p schema": Cell("chat", dict(
        temperature=1.2, seed=5, top_p=0.95, response_format=JSON_FORMAT, top_logprobs=20,
        max_tokens=14)),
    "completions seeded top-k regex": Cell("completions", dict(
        prompt="The capital of France is", temperature=0.7, top_k=8, seed=1, logprobs=3,
        structured_outputs={"regex": " Paris, (the capital|a city) of [A-Z][a-z]+\\."},
        token_sources=3)),
}
# Speculative: two draft tokens a round (three verify rows), which costs less on a CPU than
# the default four and still checks rows after proposals.
ARMS = {"plain": {"num_draft_tokens": 0}, "speculative": {"num_draft_tokens": 2}}

_prefixes: dict[tuple[int, ...], list] = {}  # the oracle's prefilled prompt heads
_oracles: dict[tuple, OracleResult] = {}
_seen: list[LogprobComparison] = []


@pytest.fixture(scope="module")
def server(served_models):
    # The default server, but drafting every round: its gate (--draft-min-prob 0.3) leaves
    # some of these requests without a single proposal, which would test plain rows only.
    s = serve_app("--draft-min-prob", "0", models=served_models)
    yield s
    s.stop()
    if _seen:
        tally.NOTES.append(
            f"logprobs vs oracle: {len(_seen)} cells, {sum(r.tokens for r in _seen)} tokens, "
            f"{sum(r.entries for r in _seen)} values; max |served - oracle| "
            f"{max(r.max_abs for r in _seen):.3g} (a row's common offset up to "
            f"{max(r.max_offset for r in _seen):.3g}, the rest up to "
            f"{max(r.max_shape for r in _seen):.3g}); near-ties "
            f"{sum(r.near_ties for r in _seen)}")


def _post(server, cell: Cell, body: dict[str, Any]
          ) -> tuple[list[ServedLogprob], dict, list[dict] | None]:
    """The response's logprobs (a stream's chunks joined), its `specdec` object and its
    token sources (None: none sent)."""
    chat = cell.endpoint == "chat"
    r = server.http.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        lps = [x["logprobs"] for ch in chunks for x in ch["choices"] if x["logprobs"]]
        ext = chunks[-1]["specdec"]
        choices = [x for ch in chunks for x in ch["choices"]]
    else:
        out = r.json()
        lps, ext = [out["choices"][0]["logprobs"]], out["specdec"]
        choices = out["choices"]
    sources = ([e for x in choices for e in x.get("token_sources", [])]
               if any("token_sources" in x for x in choices) else None)
    if chat:
        return [ServedLogprob(c["token"], c["logprob"],
                              tuple((a["token"], a["logprob"]) for a in c["top_logprobs"]))
                for lp in lps for c in lp["content"]], ext, sources
    return [ServedLogprob(t, v, tuple(top.items())) for lp in lps
            for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])
            ], ext, sources


def _oracle(server, embedded, cell: Cell, body: dict[str, Any]) -> OracleResult:
    """The oracle's decode of the request as the server prepared it (its rendered prompt,
    constraint and sampling), once per request; the prompt's head prefilled once."""
    req = server.engine.prepare(to_request(
        ChatCompletionRequest.model_validate(body) if cell.endpoint == "chat"
        else CompletionRequest.model_validate(body)))
    p = req.sampling
    key = (req.prompt_ids, repr(req.constraint), p, req.max_tokens, req.logprobs)
    if key not in _oracles:
        head = req.prompt_ids[:-1]
        if head not in _prefixes:
            _prefixes[head] = make_prompt_cache(embedded.model)
            embedded.model(mx.array([list(head)], dtype=mx.int32), cache=_prefixes[head])
        matcher = (server.engine.compiler.compile(req.constraint).matcher()
                   if req.constraint is not None else None)
        _oracles[key] = reference_decode(
            embedded.model, req.prompt_ids, vocab_size=embedded.vocab_size,
            eos_token_ids=embedded.eos_token_ids, max_tokens=req.max_tokens, matcher=matcher,
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed or 0,
            logit_bias=p.logit_bias, logprobs=req.logprobs,
            cache=copy.deepcopy(_prefixes[head]),
            budget=BudgetOracle.of(server.engine.compiler.tokenizer, embedded.vocab_size,
                                   embedded.eos_token_ids, req.max_tokens)
            if matcher is not None and req.thinking is None else None)
    return _oracles[key]


@pytest.mark.parametrize("arm", sorted(ARMS))
@pytest.mark.parametrize("name", sorted(CELLS))
def test_served_logprobs_equal_the_oracles(server, embedded, name, arm):
    cell = CELLS[name]
    body = {"model": "default", "max_tokens": MAX_TOKENS, **cell.fields, **ARMS[arm]}
    if cell.endpoint == "chat":
        body.update(messages=MESSAGES, logprobs=True)
    served, ext, sources = _post(server, cell, body)
    oracle = _oracle(server, embedded, cell, body)
    tokenizer = embedded.tokenizer

    def text(t: int) -> str:  # how the wire names a token
        return str(tokenizer.decode([t], skip_special_tokens=False))

    assert (sources is not None) == ("token_sources" in cell.fields)
    if sources is not None:
        _check_sources(sources, served, oracle, text,
                       lambda ids: str(tokenizer.decode(ids, skip_special_tokens=False)),
                       constrained="response_format" in body
                       or "structured_outputs" in body, speculative=arm == "speculative")
        assert sum(e["source"] == "budget" for e in sources) == ext["budget_steered"]
        if name.endswith("budget steered"):
            assert ext["budget_steered"] > 0 and sources[-1]["source"] == "budget", (ext, sources)

    if arm == "speculative":  # rounds of several verified rows, not one row at a time
        assert ext["proposed"] > 0 and ext["accepted"] > 0, ext
    else:
        assert ext["proposed"] == 0, ext
    if cell.endpoint == "completions":  # top_logprobs is keyed by text: ids sharing one fold
        assert all(len({text(t) for t, _ in st.top}) == len(st.top) for st in oracle.steps)
    got = compare_logprobs(oracle, served, key=text)
    _seen.append(got)
    tally.record("logprobs vs oracle", not got.problems)
    assert not got.problems, "\n".join(got.problems)
    assert got.tokens == len(oracle.tokens) > 0


def _check_sources(sources: list[dict], served: list[ServedLogprob], oracle: OracleResult,
                   text: Any, whole: Any, constrained: bool, speculative: bool) -> None:
    """A response's token sources against the oracle's decode (see the module docstring)
    and the response's own logprobs (checked against the oracle's by the caller)."""
    try:
        assert [e["id"] for e in sources] == list(oracle.tokens)
        assert [e["text"] for e in sources] == [text(t) for t in oracle.tokens]
        assert b"".join(bytes(e["bytes"]) for e in sources).decode("utf-8", "replace") == \
            whole(list(oracle.tokens))
        for e, step, lp in zip(sources, oracle.steps, served):
            assert e["allowed"] == (step.allowed if constrained else None), (e, step)
            assert (e["source"] == "budget") == step.steered, (e, step)
            if e["allowed"] == 1 or not speculative:  # (else: proposed as forced text)
                assert (e["source"] == "forced") == (e["allowed"] == 1), e
            assert e["source"] in (("forced", "looked_up", "suffixed", "drafted", "branch",
                                    "target", "budget") if speculative
                                   else ("forced", "target", "budget")), e
            assert (e["logprob"], tuple((t["text"], t["logprob"]) for t in e["top"])) == \
                (lp.logprob, lp.top)
    except AssertionError:
        tally.record("token sources vs oracle", False)
        raise
    tally.record("token sources vs oracle", True)


# The comparison itself, on hand-made rows: it passes a float32 log-softmax of the right
# distribution and fails the wrong ones.

def _row(seed: int = 0, vocab: int = 4096) -> np.ndarray:
    x = np.random.default_rng(seed).normal(0, 3, vocab).astype(np.float32)
    x[5::7] = -np.inf  # a grammar mask
    return x


def _oracle_of(x: np.ndarray, temperature: float, n: int) -> OracleResult:
    lp = log_probs(x, temperature=temperature)
    top, near = top_logprobs(lp, n, NEAR_TIE)
    tok = top[1][0]  # a sampled pick, not the most likely
    step = OracleStep(tok, top[0][0], 0.0, int(np.isfinite(x).sum()), lp[tok], top, near)
    return OracleResult((tok,), "length", (step,))


def _served_float32(x: np.ndarray, temperature: float, tok: int, n: int) -> ServedLogprob:
    """What a float32 server computes: log_softmax in float32, top n by value."""
    s = x / np.float32(temperature)
    lp = (s - (s.max() + np.log(np.exp(s - s.max()).sum(dtype=np.float32)))).astype(np.float32)
    ids = np.argsort(-lp, kind="stable")[:n]
    return ServedLogprob(tok, float(lp[tok]), tuple((int(i), float(lp[i])) for i in ids))


def test_comparison_passes_a_float32_server_and_fails_a_wrong_temperature():
    x = _row()
    oracle = _oracle_of(x, 0.7, 5)
    tok = oracle.tokens[0]
    ok = compare_logprobs(oracle, [_served_float32(x, 0.7, tok, 5)])
    assert not ok.problems and ok.entries == 6 and 0 < ok.max_abs < SHAPE_TOL
    assert compare_logprobs(oracle, [_served_float32(x, 1.0, tok, 5)]).problems
    assert compare_logprobs(oracle, [_served_float32(x, 0.7001, tok, 5)]).problems


def test_comparison_fails_a_bias_left_out_and_a_normaliser_over_the_unmasked_row():
    x = _row(1)
    biased = x.copy()
    biased[np.argsort(-x)[2]] += np.float32(0.5)
    oracle = _oracle_of(biased, 0.9, 4)
    assert compare_logprobs(oracle, [_served_float32(x, 0.9, oracle.tokens[0], 4)]).problems
    oracle = _oracle_of(x, 0.9, 4)
    unmasked = np.where(np.isfinite(x), x, np.float32(0.0))
    good = _served_float32(x, 0.9, oracle.tokens[0], 4)
    assert not compare_logprobs(oracle, [good]).problems
    s = unmasked / np.float32(0.9)
    lse = s.max() + np.log(np.exp(s - s.max()).sum())
    wrong = ServedLogprob(good.token, float(s[good.token] - lse),
                          tuple((i, float(s[i] - lse)) for i, _ in good.top))
    assert compare_logprobs(oracle, [wrong]).problems


def test_comparison_lets_tied_tokens_come_in_either_order_and_counts_them():
    x = _row(2)
    order = np.argsort(-x)
    x[order[3]] = x[order[2]]  # an exact tie inside the top 5
    oracle = _oracle_of(x, 1.0, 5)
    good = _served_float32(x, 1.0, oracle.tokens[0], 5)
    top = list(good.top)
    top[2], top[3] = top[3], top[2]
    got = compare_logprobs(oracle, [ServedLogprob(good.token, good.logprob, tuple(top))])
    assert not got.problems and got.near_ties == 2
    top[0], top[1] = top[1], top[0]  # no tie there
    assert compare_logprobs(oracle, [ServedLogprob(good.token, good.logprob,
                                                   tuple(top))]).problems


MSG = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def reference_server(serve):
    # A real server on the reference BLAS: speculative and plain rows are bitwise equal
    # there, so their logprobs must be too.
    return serve("--num-draft-tokens", "4", env={"SPECDEC_BLAS": "reference"})


def test_logprobs_are_those_of_the_pick_and_equal_with_and_without_speculation(
        reference_server):
    import math

    client = reference_server.client()
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "n": {"type": "integer"}},
              "required": ["colour", "n"], "additionalProperties": False}
    got = {}
    for arm, extra in (("spec", None), ("plain", {"num_draft_tokens": 0})):
        r = client.chat.completions.create(
            model="default", messages=MSG, max_tokens=16, temperature=0, logprobs=True,
            top_logprobs=3, extra_body=extra, response_format={
                "type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
        content = r.choices[0].logprobs.content
        assert "".join(c.token for c in content) == r.choices[0].message.content
        for c in content:
            assert c.logprob <= 0 and c.top_logprobs[0].token == c.token  # greedy: the top
            assert c.top_logprobs[0].logprob == c.logprob
            assert sum(math.exp(t.logprob) for t in c.top_logprobs) <= 1 + 1e-5
            assert bytes(c.bytes).decode() == c.token
        got[arm] = [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs])
                    for c in content]
        if arm == "spec":
            assert r.model_extra["specdec"]["proposed"] > 0
    assert got["spec"] == got["plain"]
    # A forced position (one token allowed) has logprob 0 under the mask.
    assert any(lp == 0.0 for _, lp, _ in got["plain"])
    # Streaming carries the same entries, chunk by chunk.
    streamed = []
    with client.chat.completions.create(
            model="default", messages=MSG, max_tokens=16, temperature=0, logprobs=True,
            top_logprobs=3, stream=True, response_format={
                "type": "json_schema", "json_schema": {"name": "c", "schema": schema}}) as st:
        for chunk in st:
            for ch in chunk.choices:
                if ch.logprobs and ch.logprobs.content:
                    streamed += [(c.token, c.logprob, [(t.token, t.logprob)
                                                        for t in c.top_logprobs])
                                 for c in ch.logprobs.content]
    assert streamed == got["spec"]
    # Completions: parallel lists.
    r = httpx.post(reference_server.url + "/v1/completions", timeout=300, json={
        "prompt": "One, two,", "max_tokens": 3, "temperature": 0, "logprobs": 2}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    assert all(len(t) <= 2 for t in lp["top_logprobs"])
