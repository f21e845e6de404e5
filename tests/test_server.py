"""The real server (uvicorn on loopback, started as `specdec serve`) driven by the official
`openai` client: structured outputs, streaming, completions, errors, reasoning templates.

Servers whose tests decode a handful of tokens are the same app in process
(`tests.serverproc.serve_app`, the same flags): no process to start. Those that decode many
tokens stay real, where the server's fast BLAS decodes them several times faster than this
process's reference BLAS."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Literal, Union

import httpx
import jsonschema
import openai
import pytest
from annotated_types import Ge, Le, MaxLen, MinLen
from pydantic import BaseModel, ConfigDict, Field

from tests.serverproc import serve_app

TEMPLATES = Path(__file__).parent / "templates"
KEY = "test-key"


@pytest.fixture(scope="module")
def server_args():
    # The defaults: the shipped distilled draft, prompt lookup on.
    return ("--num-draft-tokens", "4", "--api-key", KEY)


@pytest.fixture(scope="module")
def client(server):
    return server.client(KEY)


# Seed-003 patterns, bounded so a 135M model finishes: cascade, routing (Union), cycle (list).
class CandidateEvaluation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    brief_candidate_summary: str = Field(max_length=60)
    rate_skill_match: Annotated[int, Ge(1), Le(10)]
    final_recommendation: Literal["hire", "reject", "hold"]


class FeatureLookup(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rationale: str = Field(max_length=40)
    tool_name: Literal["fetch_user_features"] = "fetch_user_features"
    user_id: str = Field(max_length=12)


class GeneralResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tool_name: Literal["respond"] = "respond"
    content: str = Field(max_length=60)


class RouterSchema(BaseModel):
    model_config = ConfigDict(extra="forbid")
    action: Union[FeatureLookup, GeneralResponse]


class RiskFactor(BaseModel):
    model_config = ConfigDict(extra="forbid")
    explanation: str = Field(max_length=40)
    severity: Literal["low", "medium", "high"]


class RiskAssessment(BaseModel):
    model_config = ConfigDict(extra="forbid")
    factors: Annotated[list[RiskFactor], MinLen(2), MaxLen(4)]


PARSE_CASES = [
    (CandidateEvaluation, "Evaluate: 5 years of Python, led two teams, wants remote work."),
    (RouterSchema, "What is the weather like today?"),
    (RiskAssessment, "List the risks of launching a product without testing."),
]


@pytest.mark.parametrize("model,prompt", PARSE_CASES, ids=[m.__name__ for m, _ in PARSE_CASES])
def test_parse_with_pydantic_models_returns_valid_objects(client, model, prompt):
    r = client.chat.completions.parse(model="default", response_format=model,
                                      messages=[{"role": "user", "content": prompt}],
                                      temperature=0, max_tokens=200)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, model)
    jsonschema.validate(json.loads(r.choices[0].message.content), model.model_json_schema())
    assert r.usage.completion_tokens > 0


def chat_text(client, stream: bool, **kw) -> tuple[str, str]:
    args = dict(model="default", messages=[{"role": "user", "content": "A city as JSON."}],
                max_tokens=60, temperature=0.8, seed=5,
                response_format={"type": "json_schema", "json_schema": {
                    "name": "c", "strict": True, "schema": {
                        "type": "object", "additionalProperties": False,
                        "required": ["city", "country"],
                        "properties": {"city": {"type": "string", "maxLength": 20},
                                       "country": {"type": "string", "maxLength": 20}}}}})
    args.update(kw)
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason
    chunks = list(client.chat.completions.create(stream=True, **args))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    return text, finish


def test_streaming_and_plain_and_speculative_give_identical_text(client):
    base = chat_text(client, False)
    assert chat_text(client, True) == base
    assert chat_text(client, False, extra_body={"num_draft_tokens": 0}) == base
    assert chat_text(client, True, extra_body={"num_draft_tokens": 2,
                                               "draft_masking": False}) == base
    assert chat_text(client, False, extra_body={"prompt_lookup": False}) == base
    json.loads(base[0])


def test_default_server_drafts_with_the_distilled_model_and_looks_up(server):
    text = ("Copy exactly: the reference code is ZX-4471-QUOKKA-88 and the backup code is "
            "ZX-4471-QUOKKA-89.")
    body = {"model": "default", "messages": [{"role": "user", "content": text}],
            "max_tokens": 40, "temperature": 0}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    ext = r.json()["specdec"]
    assert ext["k"] == 4 and ext["drafted"] > 0, ext
    assert ext["looked_up"] > 0, ext


def test_sse_framing_ends_with_done_and_reports_usage(server):
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][6:])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("so,check", [
    ({"json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
               "additionalProperties": False}},
     lambda t: isinstance(json.loads(t)["n"], int)),
    ({"regex": "[0-9]{3}-[0-9]{4}"}, lambda t: len(t) == 8 and t[3] == "-"),
    ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"grammar": 'start: "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
], ids=["json", "regex", "choice", "grammar", "json_object"])
def test_each_structured_outputs_kind(client, so, check):
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Answer."}], temperature=0,
        max_tokens=60, extra_body={"structured_outputs": so})
    if r.choices[0].finish_reason == "stop":
        assert check(r.choices[0].message.content), r.choices[0].message.content
    else:
        assert "json_object" in so  # only the unbounded object may run out of tokens


def test_completions_with_prompt_text_and_token_ids(client):
    r = client.completions.create(model="default", prompt="The capital of France is",
                                  max_tokens=4, temperature=0,
                                  extra_body={"structured_outputs": {"choice": [" Paris",
                                                                               " Rome"]}})
    assert r.choices[0].text in (" Paris", " Rome")
    ids = [504, 3575, 282, 4649, 314]
    r2 = client.completions.create(model="default", prompt=ids, max_tokens=3, temperature=0)
    assert r2.usage.prompt_tokens == 5 and r2.usage.completion_tokens == 3


def test_lenient_schema_reports_what_it_did_not_enforce(server):
    body = {"model": "default", "messages": [{"role": "user", "content": "Numbers"}],
            "max_tokens": 30, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "n", "schema": {"type": "array", "items": {"type": "object"},
                                        "maxItems": 3, "uniqueItems": True}}}}
    # (items that are objects: the uniqueness rule follows scalar items only)
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    assert any("uniqueItems" in w for w in r.json()["specdec"]["warnings"])
    assert "uniqueItems" in r.headers["warning"]
    body["response_format"]["json_schema"]["strict"] = True
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "uniqueItems" in r.json()["error"]["message"]
    # integers it enforces, strict or not, with no warning
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 3,
              "uniqueItems": True}
    body["response_format"]["json_schema"]["schema"] = schema
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and not r.json()["specdec"].get("warnings")
    items = json.loads(r.json()["choices"][0]["message"]["content"])
    assert len(items) == 3 and len(set(items)) == 3


def post(server, body, key: str | None = KEY, raw: bytes | None = None,
         path: str = "/v1/chat/completions") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        return httpx.post(server.url + path, content=raw, timeout=60,
                          headers={**headers, "Content-Type": "application/json"})
    return httpx.post(server.url + path, json=body, timeout=60, headers=headers)


MSG = [{"role": "user", "content": "x"}]
ERRORS = [
    ("malformed-json", None, b"{not json", 400),
    ("not-an-object", [1, 2], None, 400),
    ("messages-type", {"messages": "hi"}, None, 400),
    ("temperature-type", {"messages": MSG, "temperature": "hot"}, None, 400),
    ("unknown-response-format", {"messages": MSG, "response_format": {"type": "xml"}}, None,
     400),
    ("invalid-schema", {"messages": MSG, "response_format": {"type": "json_schema",
                        "json_schema": {"name": "x", "schema": {"type": "objec"}}}}, None, 400),
    ("invalid-regex", {"messages": MSG, "structured_outputs": {"regex": "a(b"}}, None, 400),
    ("invalid-grammar", {"messages": MSG, "structured_outputs": {"grammar": "start: x"}}, None,
     400),
    ("empty-choice", {"messages": MSG, "structured_outputs": {"choice": []}}, None, 400),
    ("two-kinds", {"messages": MSG, "structured_outputs": {"regex": "a", "choice": ["a"]}},
     None, 400),
    ("prompt-too-long", {"messages": [{"role": "user", "content": "word " * 9000}]}, None,
     400),
    ("max-tokens-zero", {"messages": MSG, "max_tokens": 0}, None, 400),
    ("max-tokens-beyond-context", {"messages": MSG, "max_tokens": 10**6}, None, 400),
    ("k-out-of-range", {"messages": MSG, "num_draft_tokens": 99}, None, 400),
    ("n-two", {"messages": MSG, "n": 2}, None, 400),
    ("top-p-zero", {"messages": MSG, "top_p": 0}, None, 400),
    ("unknown-model", {"messages": MSG, "model": "gpt-9"}, None, 404),
]


@pytest.mark.parametrize("name,body,raw,status", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_input_gets_openai_error_shape_and_server_keeps_serving(server, name, body, raw,
                                                                   status):
    r = post(server, body, raw=raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_auth_and_body_size(server):
    assert post(server, {"messages": MSG}, key=None).status_code == 401
    assert post(server, {"messages": MSG}, key="wrong").status_code == 401
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (9 * 1024 * 1024) + b'"}]}'
    r = post(server, None, raw=big)
    assert r.status_code == 413 and r.json()["error"]["message"]


def test_models_metrics_health(server, client):
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 401  # key needed
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=10).text
    assert "specdec_requests_total" in text and "specdec_queue_depth" in text
    assert "specdec_grammar_cuts_total" in text


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=10).text
    return next(float(ln.split()[1]) for ln in text.splitlines() if ln.split()[0] == name)


def test_disconnect_mid_stream_stops_the_request_and_the_next_is_served(server, client):
    # A client that leaves mid-stream: its request is stopped, counted as cancelled (a
    # request that ran to its end is not), its slot freed; the next request is served.
    body = {"model": "default", "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 400, "stream": True, "temperature": 0}
    cancelled = _metric(server, "specdec_cancelled_total")
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break  # leave mid-stream
    for _ in range(600):  # a hang guard (2 min), not a speed limit
        if (_metric(server, "specdec_cancelled_total"),
                _metric(server, "specdec_active_requests")) == (cancelled + 1, 0):
            break
        time.sleep(0.2)
    assert _metric(server, "specdec_cancelled_total") == cancelled + 1
    assert _metric(server, "specdec_active_requests") == 0
    r = client.chat.completions.create(model="default", messages=MSG, max_tokens=3,
                                       temperature=0)
    assert r.choices[0].finish_reason == "length"


@pytest.fixture(scope="module")
def qwen_server_without_draft(serve):
    # One real server for two tests that decode: a reasoning template with a switch, and no
    # draft model (drafting never changes the text; the template never stops jump-forward).
    return serve("--chat-template", str(TEMPLATES / "qwen3_style.jinja"), "--draft-model",
                 "none")


def test_reasoning_template_with_switch_gives_json_without_think_block(
        qwen_server_without_draft):
    qwen = qwen_server_without_draft
    r = qwen.client().chat.completions.create(
        model="default", messages=[{"role": "user", "content": "A color as JSON."}],
        temperature=0, max_tokens=40, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert "<think>" not in text
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    # Asking for thinking together with a constraint thinks (the embedded vocabulary has no
    # think tokens: the markers are text), then answers under the constraint.
    r = qwen.client().chat.completions.create(
        model="default", messages=MSG, response_format={"type": "json_object"},
        temperature=0, max_tokens=80,
        extra_body={"chat_template_kwargs": {"enable_thinking": True},
                    "max_thinking_tokens": 8})
    msg = r.choices[0].message
    assert "reasoning_content" in msg.model_extra and "</think>" not in (msg.content or "")
    assert r.usage.completion_tokens_details.reasoning_tokens >= 8
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(msg.content), dict)


def test_reasoning_template_without_switch_thinks_then_answers(served_models):
    r1 = serve_app("--chat-template", str(TEMPLATES / "r1_style.jinja"), models=served_models)
    try:
        r = r1.client().chat.completions.create(model="default", messages=MSG, max_tokens=60,
                                                temperature=0,
                                                response_format={"type": "json_object"})
        msg = r.choices[0].message
        assert "reasoning_content" in msg.model_extra
        assert isinstance(json.loads(msg.content), dict)
        r = r1.client().chat.completions.create(model="default", messages=MSG, max_tokens=3,
                                                temperature=0)  # unconstrained is fine
        assert r.choices[0].finish_reason == "length"
    finally:
        r1.stop()


def test_schema_over_the_compile_limit_is_a_400_and_others_keep_being_served(served_models):
    s = serve_app("--compile-timeout", "0.002", models=served_models)
    try:
        props = {f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]+$"}
                 for i in range(300)}
        schema = {"type": "object", "properties": props, "required": list(props)}
        with pytest.raises(openai.BadRequestError, match="compile"):
            s.client().chat.completions.create(
                model="default", messages=MSG, max_tokens=5,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "big", "schema": schema}})
        r = s.client().chat.completions.create(model="default", messages=MSG, max_tokens=2,
                                               temperature=0)
        assert r.choices[0].finish_reason == "length"
    finally:
        s.stop()


def test_server_without_a_draft_jump_forwards_constrained_requests(
        qwen_server_without_draft):
    # The engine resolves a request's speculation with its constraint known: with no draft
    # model, constrained requests propose grammar-forced tokens (jump-forward).
    # The forced run opens the object (`{"city": "`): a few tokens show it.
    s = qwen_server_without_draft
    body = {"model": "default", "messages": MSG, "max_tokens": 12, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "c", "schema": {"type": "object", "required": ["city"],
                                        "properties": {"city": {"type": "string"}}}}}}
    ext = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=300).json()["specdec"]
    assert ext["k"] > 0 and ext["forced"] > 0 and ext["drafted"] == 0, ext
    free = httpx.post(s.url + "/v1/chat/completions", timeout=300,
                      json={**body, "max_tokens": 2,
                            "response_format": {"type": "text"}}).json()["specdec"]
    assert free["k"] == 0, free  # unconstrained requests decode plainly
