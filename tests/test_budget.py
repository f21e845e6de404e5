"""The token budget as part of the constraint (`specdec.budget`): a constrained answer whose
budget is at least its constraint's minimum is complete and valid when the budget ends.

- The closing walk, on its own: ordinary documents close the short way.
- Budget cells on the tiny models (greedy and seeded, budgets at and just above the minimum):
  plain decoding with the rule equals the oracle's own implementation of it (tokens and
  finish), every proposer and token trees equal plain decoding, 0 grammar cuts with draft
  masking, and every output is a complete document.
- The same cells over schemas whose closings need the walk's search (string formats, byte
  patterns, an alternation, minItems of emails, minLength, minProperties, const, anyOf):
  plain equals the oracle, serving-like speculation and token trees equal plain; one such
  request decoded inside a batch of other steered requests equals it decoded alone.
- Tool calls in every tool format, forced with a budget just above the minimum: the call is
  made and its arguments validate, plain equals the oracle and speculation equals plain.
- The embedded model through every API (in process): capped answers parse, streamed or not;
  capped forced calls are made; a budget below the minimum is a 400 naming the API's own
  parameter; `close_at_budget: false` gives plain truncation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import jsonschema
import pytest

from bench.workloads import CASES, CLOSING_KINDS
from oracle import BudgetOracle, OracleResult, reference_decode, report
from specdec import blas
from specdec.budget import Nesting, Place, closing, need
from specdec.engine import Engine, RequestError
from specdec.grammar import Constraint
from specdec.request import GenerateRequest, Message, Tool
from specdec.sampling import SamplingParams
from specdec.speculative import SpecConfig, SpecStats
from tests import tally
from tests.rotation import half
from tests.families import TOOL_FORMATS
from tests.tiny import EOS, WIDTH, drain, tiny_llama
from tests.tiny import plain_steps, spec_steps

REFERENCE = pytest.mark.skipif(blas.active() != "reference",
                               reason="equality is promised on the reference BLAS only")
MODES = {"greedy": SamplingParams(), "seeded": SamplingParams(0.8, top_k=40, seed=11)}
TINY_CASES = [c for c in CASES if c.kind != "choice"]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(1234)


@pytest.fixture(scope="module")
def drafts():
    return {"bad": tiny_llama(99), "soft": tiny_llama(1234, head_scale=2)}


@pytest.fixture(scope="module")
def order(compiler):
    return compiler.closing_order(WIDTH)


def _text(compiler, tokens) -> str:
    return b"".join(compiler.tokenizer.decode_bytes([t]) for t in tokens).decode()


def _complete(compiler, constraint, tokens) -> bool:
    m = compiler.compile(constraint).matcher()
    return m.try_consume_tokens(list(tokens)) == len(tokens) and m.is_accepting()


# -- the walk -------------------------------------------------------------------------------

def test_the_nesting_reader_counts_levels_outside_strings_only():
    at = Nesting().read(b'{"a": ["x}]\\"", {')
    assert (at.depth, at.in_string, at.level) == (3, False, 3)
    at = at.read(b'"y\\')
    assert at.in_string and at.escaped and at.level == 4
    assert at.read(b'""').in_string is False  # the escaped quote, then the closing one


def test_the_walk_closes_ordinary_documents_the_short_way(compiler, order):
    g = compiler.compile(Constraint("json_object", None))
    assert [compiler.tokenizer.decode_bytes([t]) for t in closing(g.matcher(), order, 8)] \
        == [b"{}"]
    for case in CASES:
        c = Constraint(case.kind, case.value)  # type: ignore[arg-type]
        walk = closing(compiler.compile(c).matcher(), order, 200)
        assert walk is not None, case.name
        assert _complete(compiler, c, walk), case.name
        if case.kind == "json_schema":
            jsonschema.validate(json.loads(_text(compiler, walk)), case.value)
    # A document opened deep in a string closes with its quote and brackets.
    c = Constraint("json_object", None)
    m = compiler.compile(c).matcher()
    head = compiler.tokenizer.tokenize_str('{"a": [{"b": "some text')
    assert m.try_consume_tokens(head) == len(head)
    walk = closing(m, order, 16, Place(Nesting().read(_text(compiler, head).encode())))
    assert walk is not None and json.loads(_text(compiler, head + walk))
    assert len(walk) <= 4
    # No closing within the bound: None (the rule then leaves the pick as it is).
    flat = Constraint(CASES[0].kind, CASES[0].value)  # type: ignore[arg-type]
    assert closing(compiler.compile(flat).matcher(), order, 3) is None


# -- budget cells on the tiny models ------------------------------------------------------

def _reference(target, compiler, prompt, c: Constraint, params: SamplingParams,
               max_tokens: int) -> tuple[OracleResult, BudgetOracle]:
    """The oracle's decode of `c` with the budget rule on a tiny target, and its rule."""
    rule = BudgetOracle.of(compiler.tokenizer, WIDTH, EOS, max_tokens)
    return reference_decode(target, prompt, vocab_size=WIDTH, eos_token_ids=EOS,
                            max_tokens=max_tokens, matcher=compiler.compile(c).matcher(),
                            temperature=params.temperature, top_k=params.top_k,
                            top_p=params.top_p, seed=params.seed or 0, budget=rule), rule


def _check_budget_cells(target, compiler, order, prompt, c: Constraint,
                        params: SamplingParams, cells, tallied: str) -> int:
    """Decode `c` at budgets at, 2 and 7 above its minimum: plain decoding with the rule
    equals the oracle (tokens and finish) and is a complete document; each (name, draft,
    SpecConfig) of `cells` equals plain, with no grammar cut where drafts are masked.
    Returns how many searches the oracle's walks made."""
    g = compiler.compile(c)
    minimum = need(g.matcher(), order)
    assert minimum is not None
    steered, finishes, searches = 0, set(), 0
    for max_tokens in (minimum, minimum + 2, minimum + 7):
        stats = SpecStats()
        want = drain(plain_steps(target, prompt, max_tokens=max_tokens, matcher=g.matcher(),
                                 params=params, closing=order, timings=stats))
        steered += stats.budget_steered
        finishes.add(want[1])
        oracle, rule = _reference(target, compiler, prompt, c, params, max_tokens)
        searches += rule.searches
        same = report(oracle, want[0]) is None and want[1] == oracle.finish_reason
        tally.record(f"budget: {tallied} plain vs oracle", same)
        assert same, (max_tokens, want, oracle.tokens, oracle.finish_reason)
        assert _complete(compiler, c, want[0]), (max_tokens, _text(compiler, want[0]))
        if stats.budget_steered:  # the budget forced the close
            assert want[1] == "length"
        for name, draft, spec in cells:
            st = SpecStats()
            got = drain(spec_steps(target, draft, prompt, max_tokens=max_tokens,
                                   matcher=g.matcher(), params=params, spec=spec,
                                   closing=order, stats=st))
            tally.record(f"budget: {tallied} spec vs plain", got == want)
            assert got == want, (name, max_tokens)
            if spec.draft_masking:
                assert st.grammar_cuts == 0, (name, max_tokens)
    # Steered, or every answer ended on its own within the minimum (enums, the date regex).
    assert steered > 0 or finishes == {"stop"}, "neither steered nor ended: untested"
    return searches


@REFERENCE
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("case", TINY_CASES, ids=[c.name for c in TINY_CASES])
def test_budget_cells_equal_plain_decoding_and_the_oracle(target, drafts, compiler, order,
                                                          prompt, case, mode):
    cells = [("self", target, SpecConfig(4)), ("bad", drafts["bad"], SpecConfig(2, True)),
             ("bad unmasked", drafts["bad"], SpecConfig(4, draft_masking=False)),
             ("none+lookup", None, SpecConfig(8, lookup=True)),
             ("soft+tree", drafts["soft"], SpecConfig(4, lookup=True, draft_min_prob=0.3,
                                                      tree=8, tree_min_score=0.02))]
    _check_budget_cells(target, compiler, order, prompt,
                  Constraint(case.kind, case.value),  # type: ignore[arg-type]
                  MODES[mode], cells, "tiny")


# Schemas whose closing needs the walk's search (`CLOSING_KINDS`, shared with the bench),
# and a few more whose walks stall with the walk's byte order as it is (a byte the pattern
# needs late in that order, counts whose steps repeat): the walk keeps coming back to a
# state its steps do not leave, and the search finds the way on. (llguidance refuses the
# formats idn-email and uri-reference as unknown.)
STALLING: dict[str, dict] = {
    "pattern_hash": {"type": "string", "pattern": "^[a-z]+#[0-9]$"},
    "pattern_x_then_y": {"type": "string", "pattern": "^x+y$"},
    "ids": {"type": "array", "items": {"type": "string", "pattern": "^id_[a-z]+\\$$"},
            "minItems": 2},
    "integers": {"type": "array", "items": {"type": "integer"}, "minItems": 20},
    "strings": {"type": "array", "items": {"type": "string"}, "minItems": 20},
}
SEARCHED = {**CLOSING_KINDS, **STALLING}
# One decision rule per kind, alternating, keeps the matrix's time modest.
SEARCHED_CELLS = [(kind, sorted(MODES)[i % 2]) for i, kind in enumerate(sorted(SEARCHED))]


def test_the_oracle_measures_the_minimum_specdec_measures(compiler, order):
    """The closing walk from the start, searches and all, as both sides measure it; with a
    count the search gives up on (`minItems: 500`), the walk goes on to its end."""
    kinds = {**SEARCHED, "integers_500": {"type": "array", "items": {"type": "integer"},
                                          "minItems": 500}}
    constraints = [Constraint.json_schema(v) for v in kinds.values()] + [
        Constraint(c.kind, c.value) for c in CASES]  # type: ignore[arg-type]
    for c in constraints:
        rule = BudgetOracle.of(compiler.tokenizer, WIDTH, EOS, 1)
        assert rule.start(compiler.compile(c).matcher()) == \
            need(compiler.compile(c).matcher(), order), c.value


@REFERENCE
@pytest.mark.parametrize("kind, mode", SEARCHED_CELLS, ids=[f"{k}-{m}" for k, m in SEARCHED_CELLS])
def test_searched_closings_equal_plain_decoding_and_the_oracle(target, drafts, compiler,
                                                               order, prompt, kind, mode):
    """Budget cells over schemas whose closings need the search: plain equals the oracle,
    serving-like speculation (an unrelated draft: many rejections) or token trees equal
    plain (one of the two a run, the other under the next corpus seed: `tests.rotation`)."""
    cells = half([("serving", drafts["bad"], SpecConfig.serving()),
                  ("soft+tree", drafts["soft"], SpecConfig(4, lookup=True, draft_min_prob=0.3,
                                                           tree=8, tree_min_score=0.02))],
                 kind, mode)
    searches = _check_budget_cells(target, compiler, order, prompt,
                             Constraint.json_schema(SEARCHED[kind]), MODES[mode], cells,
                             "tiny searched")
    if kind in STALLING:
        assert searches > 0, "the walk never searched: the search untested"


@REFERENCE
def test_a_searched_closing_in_a_batch_equals_it_decoded_alone(target, drafts, compiler,
                                                                order, prompt):
    """A needle whose closing needs the search (a list of patterned ids), its budget near the
    minimum, decoded inside a batch of other steered requests (searched and not,
    speculative and plain, some joining late) gives the tokens it gives alone, and the
    oracle's."""
    from specdec.budget import Closing
    from specdec.core import Models, new_state, prefill, run_round
    from specdec.prepare import Request

    models = Models(target, WIDTH, drafts["soft"], WIDTH)
    greedy, seeded = MODES["greedy"], MODES["seeded"]

    def request(kind, extra, params, spec, lead=()):
        c = Constraint.json_schema(SEARCHED[kind])
        minimum = need(compiler.compile(c).matcher(), order)
        return c, Request(tuple(prompt) + tuple(lead), sampling=params,
                          max_tokens=minimum + extra, spec=spec,
                          closing=Closing(order, minimum))

    serving = SpecConfig.serving()
    steered = 0
    for params in (greedy, seeded):
        c, needle = request("ids", 2, params, serving)
        want = drain(spec_steps(target, drafts["soft"], needle.prompt_ids,
                                max_tokens=needle.max_tokens,
                                matcher=compiler.compile(c).matcher(), params=params,
                                spec=serving, closing=order))
        oracle, rule = _reference(target, compiler, needle.prompt_ids, c, params,
                                  needle.max_tokens)
        assert (want[0], want[1]) == (list(oracle.tokens), oracle.finish_reason)
        assert rule.searches > 0, "the needle's closings never searched"
        assert _complete(compiler, c, want[0])
        others = [request("pattern_hash", 0, seeded, SpecConfig(4), (401, 402)),
                  request("nested", 1, greedy, None, (403,)),
                  request("min_length", 3, seeded, serving, (404, 405, 406)),
                  request("pattern_alternation", 0, greedy,
                          SpecConfig(2, draft_masking=False))]
        states = [new_state(models, r, EOS, matcher=compiler.compile(oc).matcher())
                  for oc, r in [others[0], (c, needle), *others[1:]]]
        s = states[1]
        for st in states[:3]:
            prefill(models, st)
        active, out, rnd = states[:3], [], 0
        while not s.done:
            if rnd == 2:  # the rest join mid-flight
                for st in states[3:]:
                    prefill(models, st)
                active += states[3:]
            run_round(models, active)
            out += s.new_tokens
            active = [a for a in active if not a.done or a is s]
            rnd += 1
        assert s.error is None, s.error
        for st in states:
            st.release()
        same = (out, s.finish) == want
        tally.record("budget: searched needle in a batch vs alone", same)
        assert same, (params, out, want)
        steered += s.stats.budget_steered
    assert steered > 0, "the budget never steered the needle: the rule untested in a batch"


# -- tool calls in every format ------------------------------------------------------------

# Parameters as real function definitions write them: open objects, an unbounded array, a
# free object; the budget must still close the call.
OPEN_TOOLS = (
    Tool("search_web", "Search the web.", {
        "type": "object", "properties": {"query": {"type": "string"},
                                         "filters": {"type": "object"}},
        "required": ["query"]}),
    Tool("sum_values", "Add numbers.", {
        "type": "object", "properties": {"values": {"type": "array",
                                                    "items": {"type": "integer"}}},
        "required": ["values"]}),
)
ASK = (Message("system", "You are terse."), Message("user", "Find the weather in Paris."))
TOOL_FORMAT_NAMES = sorted(TOOL_FORMATS) + ["generic"]


def _oracle(engine: Engine, req) -> tuple[tuple[int, ...], str]:
    t, s = engine.target, req.sampling
    ref = reference_decode(t.model, req.prompt_ids, vocab_size=t.vocab_size,
                           eos_token_ids=t.eos_token_ids, max_tokens=req.max_tokens,
                           matcher=engine.compiled(req).matcher(),
                           temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                           seed=s.seed or 0, logit_bias=s.logit_bias,
                           budget=BudgetOracle.of(engine.compiler.tokenizer, t.vocab_size,
                                                  t.eos_token_ids, req.max_tokens,
                                                  req.closing.hints))
    return ref.tokens, ref.finish_reason


@REFERENCE
@pytest.mark.parametrize("fmt", TOOL_FORMAT_NAMES)
def test_a_forced_call_with_a_small_budget_is_made_in_every_tool_format(tool_engines, fmt):
    e = tool_engines(fmt)
    schemas = {t.name: t.parameters for t in OPEN_TOOLS}
    base = GenerateRequest(messages=ASK, tools=OPEN_TOOLS, tool_choice="required",
                           max_tokens=400, spec=None)
    minimum = e.prepare(base).closing.minimum
    steered, ends = 0, set()
    for extra, parallel, params in ((0, True, SamplingParams()),
                                    (3, False, SamplingParams(1.0, seed=3)),
                                    (9, True, SamplingParams(1.2, seed=7)),
                                    (5, True, SamplingParams(1.5, seed=11))):
        greq = GenerateRequest(messages=ASK, tools=OPEN_TOOLS, tool_choice="required",
                               parallel_tool_calls=parallel, max_tokens=minimum + extra,
                               spec=None, sampling=params)
        req = e.prepare(greq)
        want = e.generate(req)
        steered += want.stats.counters.budget_steered
        ends.add(want.finish_reason)
        assert want.tool_calls, (fmt, extra, want.text, e.decode_text(want.tokens))
        assert len(want.tool_calls) == 1 or parallel
        for call in want.tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        # "length" when the budget steered or ended it (complete calls, more were allowed)
        assert want.finish_reason == "length" if want.stats.counters.budget_steered else (
            want.finish_reason == "tool_calls" or len(want.tokens) == req.max_tokens)
        same = _oracle(e, req)[0] == want.tokens
        tally.record("budget: tool formats, plain vs oracle", same)
        assert same, (fmt, extra)
        got = e.generate(e.prepare(GenerateRequest(
            messages=ASK, tools=OPEN_TOOLS, tool_choice="required",
            parallel_tool_calls=parallel, max_tokens=minimum + extra, spec={"k": 4},
            sampling=req.sampling)))
        tally.record("budget: tool formats, spec vs plain", got.tokens == want.tokens)
        assert (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason), fmt
    assert steered > 0 or ends == {"tool_calls"}, f"{fmt}: neither steered nor ended"


@REFERENCE
@pytest.mark.parametrize("fmt", TOOL_FORMAT_NAMES)
def test_auto_with_a_small_budget_calls_completely_or_answers_in_every_tool_format(
        tool_engines, fmt):
    """tool_choice "auto", the call markup pushed, budgets around a forced call's minimum:
    each call made is complete and valid, no call markup reaches the text, plain equals the
    oracle and speculation equals plain."""
    from tests.test_tools import marker_bias

    e = tool_engines(fmt)
    schemas = {t.name: t.parameters for t in OPEN_TOOLS}
    forced, auto = (e.prepare(GenerateRequest(messages=ASK, tools=OPEN_TOOLS, max_tokens=400,
                                              tool_choice=choice, spec=None)).closing.minimum
                     for choice in ("required", "auto"))
    budgets = (max(auto, forced - 2), max(auto, forced), max(auto, forced) + 4)
    calls = 0
    for budget, params in zip(budgets, (SamplingParams(), SamplingParams(1.0, seed=3),
                                        SamplingParams())):
        params = dataclasses.replace(params, logit_bias=marker_bias(e, 100.0))
        greq = GenerateRequest(messages=ASK, tools=OPEN_TOOLS, max_tokens=budget,
                               spec=None, sampling=params)
        req = e.prepare(greq)
        want = e.generate(req)
        calls += len(want.tool_calls)
        for call in want.tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        assert e.tool_format().marker not in want.text, (fmt, budget, want.text)
        same = _oracle(e, req)[0] == want.tokens
        tally.record("budget: tool formats auto, plain vs oracle", same)
        assert same, (fmt, budget)
        got = e.generate(e.prepare(dataclasses.replace(greq, spec={"k": 4})))
        tally.record("budget: tool formats auto, spec vs plain", got.tokens == want.tokens)
        assert (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason), fmt
    assert calls > 0, f"{fmt}: the pushed markup never gave a call"


# -- the embedded model through every API ---------------------------------------------------

# Ordinary schemas, as users write them (no length bounds on the strings or arrays).
SCHEMAS = [c.value for c in CASES if c.kind == "json_schema"] + [
    {"type": "object", "properties": {"title": {"type": "string"},
                                      "steps": {"type": "array", "items": {"type": "string"}}},
     "required": ["title", "steps"]},
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                      "email": {"type": "string"}},
     "required": ["name", "age", "email"]},
    {"type": "object", "properties": {"summary": {"type": "string"},
                                      "keywords": {"type": "array",
                                                   "items": {"type": "string"}},
                                      "sentiment": {"enum": ["positive", "negative"]}},
     "required": ["summary", "keywords", "sentiment"]},
]
USER = "Describe a recipe for pancakes in detail, with every field filled generously."


@pytest.fixture(scope="module")
def app(engine):
    from server.app import create_app
    from server.door import ServeConfig

    return create_app(engine, ServeConfig())


def _post_all(app, calls: list[tuple[str, dict]]) -> list[httpx.Response]:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=600) as c:
            return [await c.post(path, json=body) for path, body in calls]
    return asyncio.run(go())


def _sse(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines()
            if line.startswith("data:") and line[5:].strip() != "[DONE]"]


def test_capped_answers_parse_on_every_api_streamed_or_not(app):
    calls = []
    for i, schema in enumerate(SCHEMAS):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
        calls.append(("/v1/chat/completions", {
            "messages": [{"role": "user", "content": USER}], "max_tokens": 32,
            "temperature": 0, "response_format": fmt, "stream": i % 2 == 1}))
    calls.append(("/v1/chat/completions", {
        "messages": [{"role": "user", "content": USER}], "max_tokens": 12, "temperature": 0,
        "response_format": {"type": "json_object"}}))
    for schema in SCHEMAS[:3]:
        calls.append(("/v1/responses", {
            "model": "default", "input": USER, "max_output_tokens": 28, "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}}}))
        calls.append(("/v1/messages", {
            "model": "default", "max_tokens": 28, "temperature": 0,
            "messages": [{"role": "user", "content": USER}],
            "output_format": {"type": "json_schema", "schema": schema}}))
    steered = 0
    for (path, body), r in zip(calls, _post_all(app, calls)):
        assert r.status_code == 200, r.text
        if path == "/v1/chat/completions" and body.get("stream"):
            chunks = _sse(r.text)
            text = "".join(ch["delta"].get("content") or "" for c in chunks
                           for ch in c.get("choices", []))
            finish = next(ch["finish_reason"] for c in chunks for ch in c.get("choices", [])
                          if ch.get("finish_reason"))
            ext = next((c["specdec"] for c in chunks if "specdec" in c), None)
        elif path == "/v1/chat/completions":
            d = r.json()
            text, finish = d["choices"][0]["message"]["content"], \
                d["choices"][0]["finish_reason"]
            ext = d["specdec"]
        elif path == "/v1/responses":
            d = r.json()
            text = "".join(p["text"] for item in d["output"]
                           for p in item.get("content") or [] if p["type"] == "output_text")
            finish = "length" if d["status"] == "incomplete" else "stop"
            if finish == "length":
                assert d["incomplete_details"] == {"reason": "max_output_tokens"}
            ext = d["specdec"]
        else:
            d = r.json()
            text = "".join(b["text"] for b in d["content"] if b["type"] == "text")
            finish = {"max_tokens": "length", "end_turn": "stop"}[d["stop_reason"]]
            ext = d.get("specdec")
        value = json.loads(text)
        if "json_schema" in json.dumps(body.get("response_format", {})) or \
                path != "/v1/chat/completions":
            schema = (body.get("response_format", {}).get("json_schema", {}).get("schema")
                      or body.get("text", {}).get("format", {}).get("schema")
                      or body.get("output_format", {}).get("schema"))
            jsonschema.validate(value, schema)
        if ext is not None:
            steered += ext["budget_steered"] > 0
            assert (finish == "length") == (ext["budget_steered"] > 0), (path, body, ext)
    assert steered >= 3, "the budget steered too few of these capped answers to test it"


def test_capped_forced_calls_are_made_on_chat_and_messages(app):
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.parameters}}
             for t in OPEN_TOOLS]
    calls = [("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Find pancake recipes."}], "tools": tools,
        "tool_choice": "required", "max_tokens": 48, "temperature": 0, "stream": stream})
        for stream in (False, True)]
    calls.append(("/v1/messages", {
        "model": "default", "max_tokens": 48, "temperature": 0,
        "messages": [{"role": "user", "content": "Find pancake recipes."}],
        "tools": [{"name": t.name, "description": t.description,
                   "input_schema": t.parameters} for t in OPEN_TOOLS],
        "tool_choice": {"type": "any"}}))
    schemas = {t.name: t.parameters for t in OPEN_TOOLS}
    for (path, body), r in zip(calls, _post_all(app, calls)):
        assert r.status_code == 200, r.text
        if path == "/v1/messages":
            uses = [b for b in r.json()["content"] if b["type"] == "tool_use"]
            assert uses, r.json()
            for u in uses:
                jsonschema.validate(u["input"], schemas[u["name"]])
            continue
        if body["stream"]:
            args: dict[int, list] = {}
            for c in _sse(r.text):
                for ch in c.get("choices", []):
                    for tc in ch["delta"].get("tool_calls") or []:
                        a = args.setdefault(tc["index"], [None, ""])
                        a[0] = a[0] or (tc.get("function") or {}).get("name")
                        a[1] += (tc.get("function") or {}).get("arguments") or ""
            made = list(args.values())
        else:
            msg = r.json()["choices"][0]["message"]
            made = [[c["function"]["name"], c["function"]["arguments"]]
                    for c in msg.get("tool_calls") or []]
        assert made, r.text
        for name, arguments in made:
            jsonschema.validate(json.loads(arguments), schemas[name])


def test_a_budget_below_the_minimum_is_a_400_naming_the_parameter(app, engine):
    schema = SCHEMAS[0]
    req = engine.prepare(GenerateRequest(messages=(Message("user", USER),),
                                         constraint=Constraint.json_schema(schema),
                                         max_tokens=400))
    minimum = req.closing.minimum
    with pytest.raises(RequestError) as e:
        engine.prepare(GenerateRequest(messages=(Message("user", USER),),
                                       constraint=Constraint.json_schema(schema),
                                       max_tokens=minimum - 1))
    assert e.value.param == "max_tokens" and str(minimum) in str(e.value)
    engine.prepare(GenerateRequest(messages=(Message("user", USER),),
                                   constraint=Constraint.json_schema(schema),
                                   max_tokens=minimum))  # the minimum itself is enough
    msgs = [{"role": "user", "content": USER}]
    calls = [
        ("/v1/chat/completions", {"messages": msgs, "max_tokens": minimum - 1,
                                  "response_format": {"type": "json_schema", "json_schema": {
                                      "name": "s", "schema": schema}}}),
        ("/v1/chat/completions", {"messages": msgs, "max_completion_tokens": 2,
                                  "response_format": {"type": "json_schema", "json_schema": {
                                      "name": "s", "schema": schema}}}),
        ("/v1/responses", {"model": "default", "input": USER, "max_output_tokens": 2,
                           "text": {"format": {"type": "json_schema", "name": "s",
                                               "schema": schema}}}),
        ("/v1/messages", {"model": "default", "max_tokens": 2, "messages": msgs,
                          "output_format": {"type": "json_schema", "schema": schema}}),
        ("/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "tool_choice": "required",
                                  "tools": [{"type": "function", "function": {
                                      "name": "f", "parameters": schema}}]}),
    ]
    got = _post_all(app, calls)
    params = ["max_tokens", "max_completion_tokens", "max_output_tokens", None, "max_tokens"]
    for n, (r, param) in enumerate(zip(got, params)):
        assert r.status_code == 400, r.text
        if param is None:  # Messages' error shape: type + error {type, message}
            err = r.json()
            assert err["type"] == "error" and "max_tokens" in err["error"]["message"]
        else:
            err = r.json()["error"]
            assert err["param"] == param and err["code"] == "max_tokens_too_small", err
            # (a forced call's minimum is its markup's and the schema's)
            assert f"takes {minimum} tokens" in err["message"] or n == 4
    assert _post_all(app, [("/v1/chat/completions", {"messages": msgs, "max_tokens": 3})]
                     )[0].status_code == 200  # and the server keeps serving


def test_close_at_budget_false_is_plain_truncation(app):
    schema = SCHEMAS[0]
    body = {"messages": [{"role": "user", "content": USER}], "max_tokens": 20,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
                "name": "s", "schema": schema}}}
    on, off = _post_all(app, [("/v1/chat/completions", body),
                              ("/v1/chat/completions", {**body, "close_at_budget": False})])
    assert on.status_code == off.status_code == 200, (on.text, off.text)
    json.loads(on.json()["choices"][0]["message"]["content"])  # closed in time
    cut = off.json()
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["specdec"]["budget_steered"] == 0 and cut["usage"]["completion_tokens"] == 20
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut["choices"][0]["message"]["content"])
