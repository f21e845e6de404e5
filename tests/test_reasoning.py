"""Think, then answer under the constraint (specdec/reasoning.py).

Exactness: a small random-weight Qwen 3 (flat head, so the thinking text varies) under three
template families: DeepSeek-R1 style (the prompt opens the think block), Qwen 3 style (the
output opens it; `enable_thinking` switch), and a vocabulary without the think tokens (the
markers are text). Each request ends its thinking one of three ways: forced at once (budget
0), by the budget mid-thought, or naturally (a logit bias on the end marker, no budget).
Plain decoding equals the oracle (which applies the budget rule itself), every speculative
cell (draft masking on and off, lookup on, forced drafting on and off) equals plain, greedy
and seeded, on the reference BLAS, and every finished answer validates against its schema.

Server: the `openai` client's `parse()` on a thinking request returns the parsed object and a
non-empty `reasoning_content`; streaming sends the same split as deltas; usage counts the
reasoning tokens; the same request without thinking is unchanged; unsupported combinations
are a 400 naming what is missing.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import jsonschema
import pytest

from oracle import BudgetOracle, ThinkingRule, reference_decode
from specdec import blas
from specdec.engine import Engine
from specdec.grammar import Constraint
from specdec.models import load
from specdec.reasoning import ReasoningDeltas, Thinking, marker_ids, split_reasoning
from tests import tally
from tests.exactness import MODES, cells_vs
from tests.families import make_family
from tests.test_families import CELLS  # the proposer cells every family runs

TEMPLATES = Path(__file__).parent / "templates"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
# The answer after the reasoning needs the budget's closing search (an email's `@`).
EMAIL_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "email": {"type": "string", "format": "email"}},
    "required": ["name", "email"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Extract the fields as JSON: Ada, 36."}]
MAX_TOKENS = 60
# template family -> (template file, whether the vocabulary has the think tokens)
FAMILIES = {"r1": ("r1_style.jinja", True), "qwen3": ("qwen3.jinja", True),
            "text-markers": ("r1_style.jinja", False)}
# how thinking ends -> (budget, logit bias on the end marker token; None: the first of
# NATURAL_BIASES with which the model ends its thought itself, after thinking a while)
ENDS = {"at-once": (0, 0.0), "budget": (7, 0.0), "natural": (40, None),
        "skipped": (40, 0.0)}  # (only where the output opens the block and may skip it)
NATURAL_BIASES = tuple(b / 2 for b in (0, -1, 1, -2, 2, -3, 3, -4, 4, -5, 5, -6, 6, 8, 10))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("reasoning")
    out = {}
    for name, (template, think) in FAMILIES.items():
        d = make_family("qwen3", root / name, think=think, scale=1.0,
                        template=(TEMPLATES / template).read_text())
        target = load(str(d))
        engines = {"self": Engine(target, target), "none": Engine(target, None)}
        engines["self"].compiler = engines["none"].compiler
        engines["self"].kv_store = engines["none"].kv_store
        out[name] = (target, engines)
    return out


def parts(engine, result, thinking):
    """A result's (reasoning, answer) as the protocol splits its text (the answer is None
    while it has not begun; a stop string's cut applies), checked against what the result
    reports."""
    reasoning, answer = split_reasoning(engine.decode_text(result.tokens), thinking)
    assert result.reasoning == reasoning
    return reasoning, None if answer is None else result.text


def test_think_markers_and_split():
    t = Thinking(close="</think>", open="<think>")
    assert split_reasoning("<think>\nhm</think>\n\n{}", t) == ("\nhm", "{}")
    assert split_reasoning("<think>\nhm</thi", t) == ("\nhm", None)  # cut inside the marker
    assert split_reasoning("<think>\nh<", t) == ("\nh", None)
    assert split_reasoning("<think>hm</think>\n", t) == ("hm", "")
    # Streamed in any pieces, the deltas join to the split of the whole.
    rng = random.Random(0)
    for text in ["<think>\nabc</think>\n\n{\"a\": 1}", "<think>x</think>\n\n", "<think>\nab</",
                 "<think></think>\n\n</think>"]:
        for _ in range(30):
            cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, 5)))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            d = ReasoningDeltas(t)
            got = [d.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
            r, a = split_reasoning(text, t)
            assert "".join(x for x, _ in got) == r
            assert "".join(y for _, y in got) == (a or "")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_speculative_equals_plain_equals_oracle_across_the_end_of_thinking(models, family):
    assert blas.active() == "reference"
    target, engines = models[family]
    e = engines["none"]
    tok = target.tokenizer
    close_ids, special = marker_ids(e.compiler.markup, "</think>")
    assert special == FAMILIES[family][1] == (len(close_ids) == 1)  # which grammar form runs
    constraint = Constraint.json_schema(SCHEMA)
    bad: list[str] = []
    seen_ends: set[str] = set()
    thought_first = 0  # natural ends after some thinking
    for end, (budget, bias) in ENDS.items():
        if end == "natural" and len(close_ids) > 1:
            continue  # a text marker is not one token to bias towards
        ids, thinking = e.chat_prompt_thinking(MESSAGES, budget=budget,
                                               optional=end == "skipped")
        if end == "skipped" and thinking.direct is None:
            continue
        assert (thinking.open is None) == (family != "qwen3")
        opener = 0 if thinking.open is None else len(
            e.target.tokenizer.encode(thinking.open, add_special_tokens=False))

        def natural(n: int, thought: bool = True) -> bool:
            """Ended by the model before the budget (after thinking a while, if `thought`)."""
            return opener + len(close_ids) - (not thought) < n < opener + (budget or 0)

        open_id = e.target.tokenizer.encode(thinking.open, add_special_tokens=False)[0] if thinking.open else 0
        for mode, base in MODES.items():
            # Where the model may answer at once (the output opens the block), a bias on the
            # open marker makes it skip ("skipped") or reason (the first bias with which it
            # opens). A natural end after some thinking if a bias gives one, else at the
            # first position (a greedy random model repeats itself: the end comes at once or
            # never).
            opens = (0.0,) if thinking.direct is None else (-100.0,) if end == "skipped" \
                else (0.0, 2.0, 4.0, 8.0, 16.0)
            tried = []
            for ob in opens:
                for b in (bias,) if bias is not None else NATURAL_BIASES:
                    params = dataclasses.replace(base, logit_bias=tuple(
                        (t, x) for t, x in ((close_ids[0], b), (open_id, ob)) if x))
                    want = e.generate(e.prepare(ids, constraint=constraint, sampling=params,
                                                max_tokens=MAX_TOKENS, spec=None,
                                                thinking=thinking))
                    n = e.reasoning_tokens(want.tokens, thinking)
                    opened = thinking.open is None or tok.decode(
                        list(want.tokens), skip_special_tokens=False).startswith(thinking.open)
                    if opened == (end != "skipped"):
                        tried.append((n, params, want))
                        if bias is not None or natural(n):
                            break
                if tried and (bias is not None or natural(tried[-1][0])):
                    break
            n, params, want = tried[-1] if bias is not None or natural(tried[-1][0]) else \
                next(x for x in tried if natural(x[0], thought=False))
            g = e.compiled(e.prepare(ids, constraint=constraint, thinking=thinking))
            rule = None if budget is None else ThinkingRule(
                budget, close_ids, lambda toks: "</think>" in tok.decode(list(toks)),
                (lambda toks: 0) if thinking.open is None else (lambda toks: next(
                    (i + 1 for i in range(len(toks)) if "<think>" in tok.decode(
                        list(toks[:i + 1]))), None)))
            ref = reference_decode(target.model, ids, vocab_size=target.vocab_size,
                                   eos_token_ids=target.eos_token_ids, max_tokens=MAX_TOKENS,
                                   matcher=g.matcher(), temperature=params.temperature,
                                   top_k=params.top_k, top_p=params.top_p,
                                   seed=params.seed or 0, logit_bias=params.logit_bias,
                                   thinking=rule, budget=BudgetOracle.of(
                                       e.compiler.tokenizer, target.vocab_size,
                                       target.eos_token_ids, MAX_TOKENS))
            same = list(want.tokens) == list(ref.tokens)
            tally.record("reasoning: plain vs oracle", same)
            if not same:
                bad.append(f"{end} {mode}: plain {want.tokens} != oracle {ref.tokens}")
            # How thinking ended is what the cell says it is.
            reasoning, answer = parts(e, want, thinking)
            assert answer is not None, (end, mode, want.text)
            n_think = e.reasoning_tokens(want.tokens, thinking)
            if end == "at-once":
                assert reasoning == "" and n_think == opener + len(close_ids), want.text
            elif end == "budget":
                assert n_think == opener + budget + len(close_ids), (n_think, want.text)
            elif end == "skipped":
                assert reasoning == "" and n_think == 0, want.text
            else:
                assert natural(n_think, thought=False), want.text
                thought_first += natural(n_think)
            seen_ends.add(end)
            jsonschema.validate(json.loads(answer), SCHEMA)  # in time: the budget rule
            lines, gots = cells_vs(engines, CELLS, want, f"reasoning: spec cells vs plain "
                                   f"({family})", f"{end} {mode}", ids, constraint=constraint,
                                   sampling=params, max_tokens=MAX_TOKENS, thinking=thinking)
            bad += lines
            for cell, got in zip(CELLS, gots):
                if cell.draft == "self":
                    assert got.stats.counters.proposed > 0
    assert not bad, "\n".join(bad)
    assert seen_ends == ({"at-once", "budget", "natural"} if len(close_ids) == 1
                         else {"at-once", "budget"}) | ({"skipped"} if family == "qwen3" else set())
    assert thought_first or len(close_ids) > 1, "no natural end came after some thinking"


@pytest.mark.parametrize("schema", ["plain", "email"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_budget_ends_the_reasoning_in_time_for_the_answer(models, family, schema):
    """No thinking budget, a model kept from ending its thought (a bias against the end
    marker; for it to open the block where it may skip it, one towards the open marker), and
    a token budget from the constraint's minimum up: the budget rule ends the reasoning in
    time, the answer is complete and valid, finish "length"; plain equals the oracle (its
    own rule over the thinking), every proposer cell equals plain."""
    assert blas.active() == "reference"
    target, engines = models[family]
    e = engines["none"]
    schema = {"plain": SCHEMA, "email": EMAIL_SCHEMA}[schema]
    constraint = Constraint.json_schema(schema)
    ids, thinking = e.chat_prompt_thinking(MESSAGES, budget=None)
    close_ids = marker_ids(e.compiler.markup, thinking.close)[0]
    bias = [(close_ids[0], -30.0)]
    if thinking.open is not None:
        bias.append((e.target.tokenizer.encode(thinking.open, add_special_tokens=False)[0],
                     30.0))
    minimum = e.prepare(ids, constraint=constraint, max_tokens=MAX_TOKENS,
                        thinking=thinking).closing.minimum
    text = e.decode_text
    opened = (lambda toks: 0) if thinking.open is None else (lambda toks: next(
        (i + 1 for i in range(len(toks)) if text(toks[:i + 1]).startswith(thinking.open)),
        None))
    rule = ThinkingRule(10 ** 9, close_ids,  # no thinking budget: never due by it
                        lambda toks: thinking.close in text(toks)[len(thinking.open or ""):],
                        opened)
    bad: list[str] = []
    for extra in (0, 3, 9) if schema is SCHEMA else (0, 3):  # (the email: the search's)
        budget = minimum + extra
        for mode, base in MODES.items():
            params = dataclasses.replace(base, logit_bias=tuple(bias))
            want = e.generate(e.prepare(ids, constraint=constraint, sampling=params,
                                        max_tokens=budget, spec=None, thinking=thinking))
            reasoning, answer = parts(e, want, thinking)
            assert answer is not None, (family, budget, want.text)
            # with room beyond the think markup, the reasoning runs until it must end
            assert reasoning or extra < 9, (family, budget, want.text)
            jsonschema.validate(json.loads(answer), schema,
                                format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
            assert want.finish_reason == "length" and want.stats.counters.budget_steered > 0
            assert len(want.tokens) <= budget
            ref = reference_decode(target.model, ids, vocab_size=target.vocab_size,
                                   eos_token_ids=target.eos_token_ids, max_tokens=budget,
                                   matcher=e.compiled(e.prepare(
                                       ids, constraint=constraint, max_tokens=budget,
                                       thinking=thinking)).matcher(),
                                   temperature=params.temperature, top_k=params.top_k,
                                   top_p=params.top_p, seed=params.seed or 0,
                                   logit_bias=params.logit_bias, thinking=rule,
                                   budget=BudgetOracle.of(e.compiler.tokenizer,
                                                          target.vocab_size,
                                                          target.eos_token_ids, budget))
            same = (list(want.tokens), want.finish_reason) == (list(ref.tokens),
                                                               ref.finish_reason)
            tally.record("reasoning budget: plain vs oracle", same)
            if not same:
                bad.append(f"{budget} {mode}: plain {want.tokens} != oracle {ref.tokens}")
            bad += cells_vs(engines, CELLS, want, "reasoning budget: spec cells vs plain",
                            f"{budget} {mode}", ids, constraint=constraint, sampling=params,
                            max_tokens=budget, thinking=thinking)[0]
    assert not bad, "\n".join(bad)


def test_asked_for_thinking_the_embedded_model_always_reasons(embedded, distilled):
    """The embedded model, not trained to open a think block, behind a Qwen 3-style template
    that leaves opening it to the model: asked for thinking, every answer comes after a
    non-empty reasoning (the block is opened for it) and validates; the distilled draft's
    speculation gives the same tokens."""
    from specdec.config import EngineDefaults
    from specdec.request import GenerateRequest, Message

    defaults = EngineDefaults(chat_template=(TEMPLATES / "qwen3.jinja").read_text())
    plain, spec = Engine(embedded, None, defaults=defaults), Engine(embedded, distilled,
                                                                    defaults=defaults)
    asks = ("Extract the fields as JSON: Ada, 36.", "Think, then answer in the schema: Bob, 41.")
    for ask in asks:
        greq = GenerateRequest(messages=(Message("user", ask),), thinking=True,
                               constraint=Constraint.json_schema(SCHEMA), max_tokens=48)
        req = plain.prepare(greq)
        assert req.thinking is not None and req.thinking.open == "<think>"
        assert req.thinking.direct is None  # asked for: not skipped
        want = plain.generate(req)
        assert want.reasoning and want.reasoning.strip(), (ask, want)
        jsonschema.validate(json.loads(want.text), SCHEMA)
        got = spec.generate(spec.prepare(greq))
        tally.record("reasoning: asked for, embedded (distilled draft vs plain)",
                     got.tokens == want.tokens)
        assert got.tokens == want.tokens, ask


def test_a_template_without_a_think_block_cannot_think(models, tmp_path):
    from specdec.chat import ThinkingUnsupportedError

    d = make_family("qwen3", tmp_path / "plain-chatml", scale=1.0)
    e = Engine(load(str(d)), None)
    with pytest.raises(ThinkingUnsupportedError, match="writes no reasoning markers"):
        e.chat_prompt_thinking(MESSAGES)
    e.chat_prompt(MESSAGES, constrained=True)  # not asking: unchanged


@pytest.fixture(scope="module")
def server_args(tmp_path_factory):
    d = make_family("qwen3", tmp_path_factory.mktemp("think-server") / "m", think=True,
                    scale=1.0)
    return ("--model", str(d), "--chat-template", str(TEMPLATES / "qwen3_style.jinja"),
            "--max-thinking-tokens", "12")


def test_parse_returns_the_object_and_the_reasoning(server):
    from openai.lib._parsing._completions import type_to_response_format_param
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=10)
        age: int = Field(ge=0, le=120)

    client = server.client()
    think = {"chat_template_kwargs": {"enable_thinking": True}}
    got = {}
    for arm, extra in (("spec", think), ("plain", {**think, "num_draft_tokens": 0})):
        r = client.chat.completions.parse(model="default", messages=MESSAGES, max_tokens=60,
                                          temperature=0, response_format=Person,
                                          extra_body=extra)
        msg = r.choices[0].message
        assert isinstance(msg.parsed, Person), msg
        reasoning = msg.model_extra["reasoning_content"]
        assert reasoning and "</think>" not in reasoning and "</think>" not in msg.content
        # The server's budget (12) ended the thought: 12 tokens and the end marker.
        assert r.usage.completion_tokens_details.reasoning_tokens == 13
        got[arm] = (reasoning, msg.content)
        if arm == "spec":
            assert r.model_extra["specdec"]["proposed"] > 0
    assert got["spec"] == got["plain"]
    # Streaming (the response_format parse() sends): reasoning deltas, then content deltas;
    # they join to the same split.
    parts = {"reasoning": "", "content": ""}
    with client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=60,
                                        temperature=0, stream=True, extra_body=think,
                                        response_format=type_to_response_format_param(Person),
                                        stream_options={"include_usage": True}) as stream:
        for chunk in stream:
            if chunk.usage is not None:
                assert chunk.usage.completion_tokens_details.reasoning_tokens == 13
            for ch in chunk.choices:
                parts["reasoning"] += (ch.delta.model_extra or {}).get("reasoning_content") or ""
                parts["content"] += ch.delta.content or ""
    assert (parts["reasoning"], parts["content"]) == got["plain"]
    # A budget of the request's own, via reasoning_effort too.
    r = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=60, temperature=0,
        response_format=type_to_response_format_param(Person),
        extra_body={"reasoning_effort": "low", "max_thinking_tokens": 3})
    assert r.usage.completion_tokens_details.reasoning_tokens == 4
    assert r.choices[0].finish_reason == "stop"
    Person.model_validate_json(r.choices[0].message.content)


def test_without_thinking_the_request_is_unchanged(server):
    import httpx

    body = {"messages": MESSAGES, "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_object"}}
    plain = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    off = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        **body, "chat_template_kwargs": {"enable_thinking": False}}).json()
    msg = plain["choices"][0]["message"]
    assert "reasoning_content" not in msg and "completion_tokens_details" not in plain["usage"]
    assert msg["content"] == off["choices"][0]["message"]["content"]
    assert "<think>" not in msg["content"]


@pytest.mark.parametrize("extra,param", [
    ({"reasoning_effort": "maximal"}, "reasoning_effort"),
    ({"max_thinking_tokens": -1}, "max_thinking_tokens"),
    ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
     "reasoning_effort"),
])
def test_bad_thinking_requests_are_a_400_naming_the_field(server, extra, param):
    import httpx

    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": MESSAGES, "max_tokens": 5, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_budget_ending_mid_character_waits_for_the_character(models):
    # A byte-level vocabulary splits many characters over tokens; the end marker cannot
    # follow half a character, so the budget's marker comes at the first position after.
    target, engines = models["r1"]
    e = engines["none"]
    constraint = Constraint.json_schema(SCHEMA)
    ids, free = e.chat_prompt_thinking(MESSAGES, budget=None)
    params = MODES["seeded"]
    base = e.generate(e.prepare(ids, constraint=constraint, sampling=params,
                                max_tokens=30, spec=None, thinking=free))
    mid = [b for b in range(1, 25) if e.decode_text(base.tokens[:b]).endswith("\ufffd")]
    assert mid, "no budget lands mid-character in this output"
    budget = mid[0]
    ids, thinking = e.chat_prompt_thinking(MESSAGES, budget=budget)
    want = e.generate(e.prepare(ids, constraint=constraint, sampling=params,
                                max_tokens=MAX_TOKENS, spec=None, thinking=thinking))
    reasoning, answer = parts(e, want, thinking)
    assert answer is not None and "\ufffd" not in reasoning
    assert e.reasoning_tokens(want.tokens, thinking) > budget + 1  # the character finished
    close_ids = marker_ids(e.compiler.markup, "</think>")[0]
    g = e.compiled(e.prepare(ids, constraint=constraint, thinking=thinking))
    ref = reference_decode(target.model, ids, vocab_size=target.vocab_size,
                           eos_token_ids=target.eos_token_ids, max_tokens=MAX_TOKENS,
                           matcher=g.matcher(), temperature=params.temperature,
                           top_k=params.top_k, top_p=params.top_p, seed=params.seed or 0,
                           thinking=ThinkingRule(budget, close_ids,
                                                 lambda toks: close_ids[0] in toks),
                           budget=BudgetOracle.of(e.compiler.tokenizer, target.vocab_size,
                                                  target.eos_token_ids, MAX_TOKENS))
    assert list(ref.tokens) == list(want.tokens)
    for cell in CELLS[:2]:
        eng = engines[cell.draft]
        got = eng.generate(eng.prepare(ids, constraint=constraint, sampling=params,
                                       max_tokens=MAX_TOKENS, spec=cell.spec,
                                       thinking=thinking))
        assert got.tokens == want.tokens, cell.name


def test_stop_strings_apply_to_the_answer_only(models):
    target, engines = models["r1"]
    e = engines["none"]
    ids, thinking = e.chat_prompt_thinking(MESSAGES, budget=10)
    constraint = Constraint.json_schema(SCHEMA)
    seeded = MODES["seeded"]
    base = e.generate(e.prepare(ids, constraint=constraint, max_tokens=MAX_TOKENS, spec=None,
                                thinking=thinking, sampling=seeded))
    reasoning, answer = parts(e, base, thinking)
    stop = next(reasoning[i:i + 2] for i in range(len(reasoning) - 1)
                if reasoning[i:i + 2].strip() and reasoning[i:i + 2] not in answer)
    got = e.generate(e.prepare(ids, constraint=constraint, max_tokens=MAX_TOKENS, spec=None,
                               thinking=thinking, stop=(stop, '"age"'), sampling=seeded))
    r2, a2 = parts(e, got, thinking)
    assert r2 == reasoning and stop in r2  # not cut inside the thinking
    assert a2 == answer[:answer.index('"age"')] and got.finish_reason == "stop"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_answer_may_hold_the_think_markers_inside_a_json_string(models, family):
    """The markers as data: a JSON string that holds `<think>` and `</think>` (added tokens
    or text) is written as text, and the reasoning ends at the real end marker only."""
    target, engines = models[family]
    e = engines["none"]
    ids, thinking = e.chat_prompt_thinking(MESSAGES, budget=4)
    note = "<think> and </think>"
    schema = {"type": "object", "properties": {"note": {"const": note}}, "required": ["note"],
              "additionalProperties": False}
    for spec in (None, "default"):
        got = e.generate(e.prepare(ids, constraint=Constraint.json_schema(schema),
                                   max_tokens=60, spec=spec, thinking=thinking,
                                   sampling=MODES["greedy"]))
        assert got.finish_reason == "stop", got
        assert json.loads(got.text) == {"note": note} and note not in got.reasoning, got


def test_the_cli_thinks_to_stderr_and_answers_to_stdout(models, tmp_path):
    import subprocess
    import sys

    target, _ = models["r1"]
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    r = subprocess.run([sys.executable, "-m", "specdec", "generate", "--model", str(target.path),
                        "--draft-model", "none", "--prompt", MESSAGES[0]["content"],
                        "--json-schema", str(schema), "--max-tokens", str(MAX_TOKENS),
                        "--max-thinking-tokens", "6"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), SCHEMA)
    assert "</think>" not in r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "specdec", "generate", "--model", str(target.path),
                        "--raw-prompt", "x", "--think"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "--think needs a chat prompt" in r.stderr
