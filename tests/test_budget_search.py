"""The token budget's closing search (`specdec.budget`): where the greedy walk keeps coming
back to a state it does not leave (an email's local part, a duration's digits, a pattern's
separator), the search finds the way on, so every kind of schema closes.

- The closing of every kind (string formats, patterns, long enums, minItems/minLength/
  minProperties, nesting, const, anyOf) is found, and its document validates (formats
  checked).
- On small grammars the minimum is within a few tokens of an exhaustive search's shortest
  complete answer (over the whole vocabulary).
- A grammar whose closing is not found within the bound is served without the rule, and
  says so: the `specdec` extension, the response headers and a /metrics counter.
- Through the APIs on the embedded model: below the minimum a 400 naming it; at the minimum
  and a few tokens above, the answer parses and validates, on Chat and another API,
  streamed or not; a forced call with an email argument in an element-style tool format.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import jsonschema
import pytest

from bench.workloads import CLOSING_KINDS as KINDS
from bench.workloads import EMAIL, one_property
from specdec import budget
from specdec.budget import closing, need
from specdec.engine import RequestError
from specdec.grammar import Constraint
from specdec.request import GenerateRequest, Message, Tool
from specdec.sampling import SamplingParams
from tests.families import TOOL_FORMATS

CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


def _valid(schema: dict, text: str) -> None:
    jsonschema.Draft202012Validator(schema, format_checker=CHECKER).validate(json.loads(text))


@pytest.fixture(scope="module")
def order(engine):
    return engine.compiler.closing_order(engine.target.vocab_size)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_closes_and_its_closing_validates(engine, order, kind):
    g = engine.compiler.compile(Constraint.json_schema(KINDS[kind]))
    walk = closing(g.matcher(), order, budget.NEED_LIMIT)
    assert walk is not None, kind
    text = engine.compiler.tokenizer.decode_bytes(walk).decode()
    _valid(KINDS[kind], text)
    assert need(g.matcher(), order) == len(walk)


def test_the_walk_alone_never_leaves_a_repeated_alternation(engine, order, monkeypatch):
    # Without its search, the walk never finds the `x` that ends `^(ab|cd)+x$` (it keeps
    # taking `ab`): what the search is for.
    g = engine.compiler.compile(Constraint.json_schema(KINDS["pattern_alternation"]))
    monkeypatch.setattr(budget, "search", lambda *a, **k: None)
    assert closing(g.matcher(), order, budget.NEED_LIMIT) is None


# Grammars whose states the walk's shortcuts must read exactly as consuming does: JSON
# schemas of every closing kind, a choice, a lexeme with max_tokens, a stop= lexeme, and an
# ambiguous grammar.
TAKES = [Constraint.json_schema(KINDS[k]) for k in sorted(KINDS)] + [
    Constraint("choice", ["yes", "no", "maybe"]),
    Constraint("grammar", 'start: a " " b\na[max_tokens=2]: /[a-z]+/\nb: /[0-9]+/'),
    Constraint("grammar", 'start: x "!"\nx[stop="END"]: /[a-z ]*/'),
    Constraint("grammar", 'start: e\ne: e e | /[a-z]/')]


def test_the_walks_shortcuts_answer_as_consuming_does(engine):
    """`budget._takes` (llguidance's check before each consume) against consuming token by
    token, and "no forced bytes, no forced token", from random states of every grammar
    above: token runs the grammar allows, with random tokens and end tokens mixed in."""
    import random

    import llguidance.numpy as llnp
    import numpy as np

    vocab = engine.target.vocab_size
    ends = sorted(engine.target.eos_token_ids)
    rng = random.Random(7)
    row = llnp.allocate_token_bitmask(1, vocab)

    def allowed(m) -> np.ndarray:
        llnp.fill_next_token_bitmask(m, row, 0)
        return np.flatnonzero(np.unpackbits(row[0].view(np.uint8), bitorder="little")[:vocab])

    def consumed(m, toks) -> bool:
        for t in toks:
            if not m.consume_token(t) or m.is_error():
                return False
        return True

    compared = took = 0
    for c in TAKES:
        base = engine.compiler.compile(c).matcher()
        for _ in range(12):
            m = base.deep_copy()
            for _ in range(rng.randint(0, 20)):
                ok = allowed(m)
                if not len(ok):
                    break
                m.consume_token(int(rng.choice(ok)))
            if not m.compute_ff_bytes():
                assert not m.compute_ff_tokens(), c
            for _ in range(6):
                seq, probe = [], m.deep_copy()
                for _ in range(rng.randint(1, 10)):
                    r = rng.random()
                    if r < 0.1:
                        seq.append(rng.randrange(vocab))
                        continue
                    ok = allowed(probe)
                    if r < 0.2 or not len(ok):
                        seq.append(rng.choice(ends))
                        continue
                    seq.append(int(rng.choice(ok)))
                    probe.consume_token(seq[-1])
                a, b = m.deep_copy(), m.deep_copy()
                want = consumed(a, seq)
                assert budget._takes(b, seq) == want, (c, seq)
                if want:
                    assert (a.is_accepting(), a.is_stopped()) == (b.is_accepting(),
                                                                  b.is_stopped()), (c, seq)
                compared += 1
                took += want
    assert compared == len(TAKES) * 12 * 6 and 0 < took < compared


def _exhaustive(compiler, grammar, eos, limit: int, cap: int = 20000) -> int | None:
    """The fewest tokens of any complete answer (over the whole vocabulary), breadth-first;
    states are told apart by their output bytes (a grammar state is a function of them)."""
    import llguidance.numpy as llnp
    import numpy as np

    tok = compiler.tokenizer
    frontier = {b"": grammar.matcher()}
    row = llnp.allocate_token_bitmask(1, tok.vocab_size)
    for depth in range(limit + 1):
        if any(m.is_accepting() for m in frontier.values()):
            return depth
        nxt: dict[bytes, object] = {}
        for text, m in frontier.items():
            llnp.fill_next_token_bitmask(m, row, 0)
            ok = np.unpackbits(row[0].view(np.uint8), bitorder="little")[:tok.vocab_size]
            for t in np.flatnonzero(ok):
                data = text + tok.decode_bytes([int(t)])
                if data in nxt or int(t) in eos:
                    continue
                c = m.deep_copy()
                if c.consume_token(int(t)) and not c.is_error():
                    nxt[data] = c
            assert len(nxt) < cap, "not a small grammar"
        frontier = nxt
    return None


SMALL = {  # (small alphabets: the exhaustive search tells states apart by all their bytes)
    "date_like": Constraint.regex(r"[12]{4}-[01]{2}-[12]{2}"),
    "pattern_separators": Constraint.regex(r"[A-B]{2}-[0-1]{3}:[a-c]{1,2}"),
    "pattern_alternation": Constraint.regex(r"(ab|cd){1,3}x"),
    "ipv4_like": Constraint.regex(r"[0-2]{1,3}\.[0-2]{1,3}\.[0-2]{1,3}\.[0-2]{1,3}"),
    "email_like": Constraint.regex(r"[a-c]{1,3}@[a-c]{1,2}\.(io|com)"),
    "duration_like": Constraint.regex(r"P[0-9]{1,2}(D|W)"),
    "long_enum": Constraint.json_schema(KINDS["long_enum"]),
    "const": Constraint.json_schema(KINDS["const"]),
    "enum_items": Constraint.json_schema(one_property({
        "type": "array", "minItems": 2, "items": {"enum": ["alpha", "omega"]}})),
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_the_minimum_is_within_a_few_tokens_of_the_exhaustive_shortest(engine, order, name):
    g = engine.compiler.compile(SMALL[name])
    ours = need(g.matcher(), order)
    best = _exhaustive(engine.compiler, g, set(engine.target.eos_token_ids), 40)
    assert ours is not None and best is not None
    assert best <= ours <= best + 3, (name, ours, best)


# -- never silent -------------------------------------------------------------------------------

def test_a_closing_the_search_cannot_find_is_no_minimum_and_says_why(engine, order,
                                                                      monkeypatch):
    g = engine.compiler.compile(Constraint.json_schema(KINDS["pattern_alternation"]))
    monkeypatch.setattr(budget, "PROBES", 3)
    why: list[str] = []
    assert need(g.matcher(), order, why=why) is None
    # (then the walk goes on from its stall, as if it had not, and reaches its bound)
    assert why == ["the closing search gave up after 3 states", "no closing within 4096 tokens"]
    why = []
    assert need(g.matcher(), order, limit=3, why=why) is None and why


def _post(app, calls: list[tuple[str, dict]]) -> list[httpx.Response]:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=600) as c:
            return [await c.post(path, json=body) for path, body in calls]
    return asyncio.run(go())


@pytest.fixture(scope="module")
def app(engine):
    from server.app import create_app
    from server.door import ServeConfig

    return create_app(engine, ServeConfig())


def _sse(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines()
            if line.startswith("data:") and line[5:].strip() != "[DONE]"]


def test_an_unguaranteed_budget_is_a_warning_a_header_and_a_counter(app, monkeypatch):
    # A closing longer than the bound (here 64 tokens; 100 items take ~200) is not found:
    # the request is served as it is, and every channel says the guarantee is off.
    monkeypatch.setattr(budget, "NEED_LIMIT", 64)
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 100}
    before = _metrics(app)
    calls = [("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Numbers."}], "max_tokens": 3,
        "temperature": 0, "stream": stream, "stream_options": {"include_usage": True},
        "response_format": {
            "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
        for stream in (False, True)]
    calls.append(("/v1/messages", {"model": "default", "max_tokens": 3,
                                   "messages": [{"role": "user", "content": "Numbers."}],
                                   "output_format": {"type": "json_schema", "schema": schema}}))
    for (path, body), r in zip(calls, _post(app, calls)):
        assert r.status_code == 200, r.text
        assert "no closing within 64 tokens" in r.headers["specdec-budget-unguaranteed"]
        assert "budget_unguaranteed" in r.headers["warning"]
        ext = (next(c["specdec"] for c in _sse(r.text) if "specdec" in c) if body.get("stream")
               else r.json()["specdec"])
        assert "no closing within 64 tokens" in ext["budget_unguaranteed"]
        assert any(w.startswith("budget_unguaranteed: ") for w in ext["warnings"])
    assert _metrics(app) - before == 3


def _metrics(app) -> float:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as c:
            return (await c.get("/metrics")).text
    line = next(ln for ln in asyncio.run(go()).splitlines()
                if ln.startswith("specdec_budget_unguaranteed_total "))
    return float(line.split()[1])


def test_a_closed_budget_carries_no_unguaranteed_warning(app):
    r = _post(app, [("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Contact?"}], "max_tokens": 40,
        "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
            "name": "c", "schema": KINDS["format_email"]}}})])[0]
    assert r.status_code == 200, r.text
    assert "specdec-budget-unguaranteed" not in r.headers
    assert "budget_unguaranteed" not in r.json()["specdec"]


# -- through the APIs ----------------------------------------------------------------------------

USER = "Fill in this record with realistic values, as JSON."


def _minimum(engine, schema: dict) -> int:
    req = engine.prepare(GenerateRequest(messages=(Message("user", USER),),
                                         constraint=Constraint.json_schema(schema),
                                         max_tokens=400))
    assert req.closing is not None and req.unguaranteed is None
    return req.closing.minimum


def _call(api: str, schema: dict, max_tokens: int, stream: bool) -> tuple[str, dict]:
    if api == "chat":
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": USER}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, "response_format": {
                "type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}
    if api == "responses":
        return "/v1/responses", {
            "model": "default", "input": USER, "max_output_tokens": max_tokens,
            "temperature": 0, "stream": stream,
            "text": {"format": {"type": "json_schema", "name": "r", "schema": schema}}}
    return "/v1/messages", {
        "model": "default", "max_tokens": max_tokens, "temperature": 0, "stream": stream,
        "messages": [{"role": "user", "content": USER}],
        "output_format": {"type": "json_schema", "schema": schema}}


def _text(path: str, body: dict, r: httpx.Response) -> str:
    if body.get("stream"):
        events = _sse(r.text)
        if path == "/v1/chat/completions":
            return "".join(ch["delta"].get("content") or "" for e in events
                           for ch in e.get("choices", []))
        if path == "/v1/responses":
            return "".join(e.get("delta", "") for e in events
                           if e.get("type") == "response.output_text.delta")
        return "".join(e["delta"].get("text", "") for e in events
                       if e.get("type") == "content_block_delta")
    d = r.json()
    if path == "/v1/chat/completions":
        return d["choices"][0]["message"]["content"]
    if path == "/v1/responses":
        return "".join(p["text"] for item in d["output"] for p in item.get("content") or []
                       if p["type"] == "output_text")
    return "".join(b["text"] for b in d["content"] if b["type"] == "text")


@pytest.fixture(scope="module")
def answered(engine, app) -> dict[str, tuple[int, list, list]]:
    """Every kind's minimum, its calls and their responses: Chat whole at the minimum,
    another API streamed a few tokens above it (the kinds take turns at Responses and
    Messages) and that API below it; posted all at once (decoded in batches)."""
    calls: dict[str, tuple[int, list]] = {}
    for n, kind in enumerate(sorted(KINDS)):
        schema, minimum = KINDS[kind], _minimum(engine, KINDS[kind])
        other = ("responses", "messages")[n % 2]
        calls[kind] = (minimum, [_call("chat", schema, minimum, False),
                                 _call(other, schema, minimum + 3, True),
                                 _call(other, schema, minimum - 1, False)])

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=600) as c:
            return await asyncio.gather(*(c.post(path, json=body) for _, cs in calls.values()
                                          for path, body in cs))
    got = iter(asyncio.run(go()))
    return {kind: (minimum, cs, [next(got) for _ in cs])
            for kind, (minimum, cs) in calls.items()}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_at_and_above_its_minimum_parses_below_it_is_a_400(engine, answered, kind):
    schema = KINDS[kind]
    minimum, calls, (ok_min, ok_above, below) = answered[kind]
    with pytest.raises(RequestError) as e:
        engine.prepare(GenerateRequest(messages=(Message("user", USER),),
                                       constraint=Constraint.json_schema(schema),
                                       max_tokens=minimum - 1))
    assert e.value.param == "max_tokens" and f"takes {minimum} tokens" in str(e.value)
    for (path, body), r in zip(calls[:2], (ok_min, ok_above)):
        assert r.status_code == 200, r.text
        _valid(schema, _text(path, body, r))
    assert below.status_code == 400, below.text
    assert str(minimum) in below.text


# -- the rule's grammar work is the request's grammar work -------------------------------------

class _SlowFills:
    """`llguidance.numpy` as the budget rule sees it, every fill `delay` seconds slower (an
    injected sleep), counting them."""

    def __init__(self, delay: float) -> None:
        import llguidance.numpy as llnp

        self.real, self.delay, self.fills = llnp, delay, 0

    def allocate_token_bitmask(self, *a):
        return self.real.allocate_token_bitmask(*a)

    def fill_next_token_bitmask(self, *a):
        import time

        self.fills += 1
        time.sleep(self.delay)
        return self.real.fill_next_token_bitmask(*a)


def test_the_rules_grammar_work_stops_at_the_requests_grammar_budget(embedded, monkeypatch):
    # Every fill of the rule's closing walks takes 0.25 s (injected) and the request's grammar
    # budget is 1 s in all: the request stops with grammar_too_complex once its closing work
    # has spent that budget, after a bounded number of fills, rather than walking on.
    from specdec.config import MaskBudget
    from specdec.engine import Engine
    from specdec.errors import GrammarTooComplex

    e = Engine(embedded, masks=MaskBudget(slow_s=0.05, mask_s=0.5, total_s=1.0))
    try:
        schema = KINDS["contact"]
        minimum = _minimum(e, schema)  # (found before the fills slow down)
        req = e.prepare(GenerateRequest(messages=(Message("user", USER),),
                                        constraint=Constraint.json_schema(schema),
                                        max_tokens=minimum + 1))
        slow = _SlowFills(0.25)
        monkeypatch.setattr(budget, "llnp", slow)
        with pytest.raises(GrammarTooComplex) as err:
            e.generate(req)
        assert "closing was sought" in str(err.value)
        assert 1 <= slow.fills <= 1.0 / 0.25 + 2, slow.fills
        # One fill over the per-fill limit stops it at that fill.
        slow.delay, slow.fills = 0.6, 0
        with pytest.raises(GrammarTooComplex) as err:
            e.generate(req)
        assert "one mask took" in str(err.value) and slow.fills == 1
    finally:
        e.close()


def test_a_grammar_too_costly_at_its_first_step_leaves_the_cache(embedded, monkeypatch):
    # Its masks take longer than the per-fill limit (injected): the request ends with
    # grammar_too_complex in its first round, and the compiled grammar is not kept for the
    # next request.
    from specdec import request_grammar
    from specdec.config import MaskBudget
    from specdec.engine import Engine
    from specdec.errors import GrammarTooComplex

    e = Engine(embedded, None, masks=MaskBudget(slow_s=0.05, mask_s=0.3, total_s=5.0))
    try:
        c = Constraint.json_schema(KINDS["contact"])
        req = e.prepare(GenerateRequest(messages=(Message("user", USER),), constraint=c,
                                        max_tokens=200, spec=None))
        assert e.compiler.compile(c) is req.grammar  # cached by its preparation
        monkeypatch.setattr(request_grammar, "llnp", _SlowFills(0.6))
        with pytest.raises(GrammarTooComplex) as err:
            e.generate(req)
        assert err.value.position <= 1
        assert e.compiler.compile(c) is not req.grammar  # compiled again: it was dropped
    finally:
        e.close()


 # -- tool arguments in every tool format -------------------------------------------------------


# -- tool arguments in every tool format -------------------------------------------------------

# (In the formats that write arguments as elements, a string argument is raw text whose
# `format` and `pattern` the grammar does not hold; objects are JSON, held whole.)
CONTACT_TOOL = Tool("add_contact", "Save a contact.", {
    "type": "object", "properties": {
        "who": {"type": "object", "properties": {"email": EMAIL}, "required": ["email"]},
        "met": {"type": "object", "properties": {"on": {
            "type": "string", "pattern": "^[12][0-9]{3}-[01][0-9]-[0-3][0-9]$"}},
            "required": ["on"]},
        "note": {"type": "string"}},
    "required": ["who", "met", "note"]})


@pytest.mark.parametrize("fmt", sorted(TOOL_FORMATS) + ["generic"])
def test_a_forced_call_needing_the_search_is_made_in_every_tool_format(tool_engines, fmt):
    # An email and a date in the arguments (raw element values in the XML formats): at the
    # minimum and a few tokens above it the call is made and its arguments validate, formats
    # checked; speculation gives plain decoding's tokens.
    e = tool_engines(fmt)
    ask = (Message("user", "Save Ada's contact."),)
    base = GenerateRequest(messages=ask, tools=(CONTACT_TOOL,), tool_choice="required",
                           max_tokens=400, spec=None)
    req = e.prepare(base)
    assert req.closing is not None and req.unguaranteed is None, req.unguaranteed
    for extra, params in ((0, SamplingParams()), (3, SamplingParams(1.0, seed=5))):
        greq = dataclasses.replace(base, max_tokens=req.closing.minimum + extra,
                                   sampling=params)
        want = e.generate(e.prepare(greq))
        assert want.tool_calls, (fmt, extra, e.decode_text(want.tokens))
        for call in want.tool_calls:
            jsonschema.Draft202012Validator(CONTACT_TOOL.parameters,
                                            format_checker=CHECKER).validate(
                json.loads(call.arguments))
        got = e.generate(e.prepare(dataclasses.replace(greq, spec={"k": 4},
                                                        sampling=want_sampling(e, greq))))
        assert got.tokens == want.tokens, (fmt, extra)


def want_sampling(e, greq):
    """The sampling a prepared request ran with (its seed filled in where it samples)."""
    return e.prepare(greq).sampling if greq.sampling.greedy else greq.sampling
