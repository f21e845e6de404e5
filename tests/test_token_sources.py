"""The token sources extension on every API (`token_sources`, off by default): each output
token's id, text, source, allowed-set size, logprob and top alternatives, on the deltas of a
stream (Chat Completions: each chunk's choice; Responses: the delta events; Messages: each
content_block_delta) and on the whole answer (Chat: the choice; Responses and Messages: the
`specdec` object), streamed and not, for an answer and a tool call. Where not asked for, no
byte of it is on the wire. Bad values are a 400 naming the field, in the API's own shape.

In process (the real app over the session's embedded model and its draft). What the sources
say is checked against the oracle in tests/test_logprobs.py (allowed sets, the budget's
steered positions, forced positions, logprobs).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from specdec.events import SOURCES
from tests.serverproc import serve_app

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
USER = "Give a person's name and age as JSON."
TOOL = {"name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                 "maxLength": 16}},
                       "required": ["city"], "additionalProperties": False}}
MAX_TOKENS = 40
APIS = ("chat", "responses", "messages")


@pytest.fixture(scope="module")
def server(served_models):
    s = serve_app(models=served_models)
    yield s
    s.stop()


def body_of(api: str, *, stream: bool, sources: Any = None, tools: bool = False
            ) -> tuple[str, dict[str, Any], dict[str, str]]:
    """(path, body, headers) of a greedy request on `api`: a JSON-schema answer, or one
    required call of `TOOL`."""
    extra = {} if sources is None else {"token_sources": sources}
    if api == "chat":
        b: dict[str, Any] = {"model": "default", "messages": [{"role": "user", "content": USER}],
                             "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
        if tools:
            b.update(tools=[{"type": "function", "function": TOOL}], tool_choice="required")
        else:
            b["response_format"] = {"type": "json_schema",
                                    "json_schema": {"name": "person", "schema": SCHEMA}}
        return "/v1/chat/completions", {**b, **extra}, {}
    if api == "responses":
        b = {"model": "default", "input": USER, "max_output_tokens": MAX_TOKENS,
             "temperature": 0, "stream": stream, "store": False}
        if tools:
            b.update(tools=[{"type": "function", **TOOL}], tool_choice="required")
        else:
            b["text"] = {"format": {"type": "json_schema", "name": "person", "schema": SCHEMA}}
        return "/v1/responses", {**b, **extra}, {}
    b = {"model": "default", "messages": [{"role": "user", "content": USER}],
         "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    if tools:
        b.update(tools=[{"name": TOOL["name"], "description": TOOL["description"],
                         "input_schema": TOOL["parameters"]}], tool_choice={"type": "any"})
    else:
        b["output_config"] = {"format": {"type": "json_schema", "schema": SCHEMA}}
    return "/v1/messages", {**b, **extra}, {"anthropic-version": "2023-06-01"}


def events_of(r: httpx.Response) -> list[dict[str, Any]]:
    """A stream's events' data, in order."""
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def streamed_sources(api: str, events: list[dict[str, Any]]) -> tuple[list[dict], str]:
    """The token sources a stream's deltas carried, joined in order, and the text of those
    deltas (answer, reasoning or arguments); every delta with text carries its tokens'
    sources."""
    deltas: list[tuple[str, list[dict] | None]] = []  # (its text, its token sources)
    for ev in events:
        if api == "chat":
            for ch in ev["choices"]:
                if ch.get("finish_reason"):
                    continue  # (the closing chunk: `wire_sources`)
                d = ch.get("delta") or {}
                deltas.append(((d.get("content") or "") + "".join(
                    c["function"].get("arguments") or "" for c in d.get("tool_calls") or ()),
                    ch.get("token_sources")))
        elif api == "responses":
            if ev["type"].endswith(".delta"):
                deltas.append((ev["delta"], ev.get("token_sources")))
            else:
                assert "token_sources" not in json.dumps(ev.get("response", {}).get(
                    "output", [])), ev
        elif ev["type"] == "content_block_delta":
            d = ev["delta"]
            deltas.append((d.get("text") or d.get("partial_json") or d.get("thinking") or "",
                           ev.get("token_sources")))
    got, text = [], ""
    for piece, carried in deltas:
        if piece:
            assert carried, (piece, carried)
        got += carried or []
        text += piece
    return got, text


def whole_sources(api: str, out: dict[str, Any]) -> list[dict]:
    if api == "chat":
        return out["choices"][0]["token_sources"]
    return out["specdec"]["token_sources"]


def answer_text(api: str, out: dict[str, Any]) -> str:
    if api == "chat":
        m = out["choices"][0]["message"]
        return m["content"] or "".join(c["function"]["arguments"]
                                       for c in m.get("tool_calls") or ())
    if api == "responses":
        return "".join(c["text"] if i["type"] == "message" else "" for i in out["output"]
                       for c in i.get("content") or ()) + "".join(
            i["arguments"] for i in out["output"] if i["type"] == "function_call")
    return "".join(b["text"] if b["type"] == "text" else json.dumps(b["input"])
                   for b in out["content"])


def check_entries(entries: list[dict], n: int) -> None:
    """Each entry's shape and what its values can be."""
    assert entries
    for e in entries:
        assert set(e) == {"id", "text", "bytes", "source", "allowed", "logprob", "top"}, e
        assert all(set(t) == {"id", "text", "bytes", "logprob"} for t in e["top"]), e
        assert e["source"] in SOURCES, e
        assert isinstance(e["allowed"], int) and e["allowed"] >= 1, e  # (all constrained)
        assert e["logprob"] <= 1e-6, e
        assert len(e["top"]) == min(n, e["allowed"]), e
        values = [t["logprob"] for t in e["top"]]
        assert values == sorted(values, reverse=True)
        if e["allowed"] == 1:
            assert e["source"] == "forced" and e["logprob"] == 0.0, e
    assert any(e["source"] == "forced" for e in entries)
    assert any(e["source"] != "forced" for e in entries)


def wire_sources(api: str, events: list[dict[str, Any]]) -> tuple[list[dict], list[dict]]:
    """A stream's token sources: those its deltas carried, and those its closing event
    carried (chat: the finish chunk; Responses: response.completed or .incomplete;
    Messages: message_delta)."""
    deltas, closing = [], []
    for ev in events:
        if api == "chat":
            for ch in ev["choices"]:
                (closing if ch.get("finish_reason") else deltas).extend(
                    ch.get("token_sources") or [])
        elif ev["type"].endswith(".delta") or ev["type"] == "content_block_delta":
            deltas += ev.get("token_sources") or []
        else:
            closing += ev.get("token_sources") or []
    return deltas, closing


@pytest.mark.parametrize("api", APIS)
def test_the_closing_event_carries_the_tokens_no_delta_did(fake, fake_app, api):
    """Stand-in engine: two tokens behind two deltas and a third behind no text (markup
    closing the output): the stream's deltas carry the first two, its closing event the
    third; the whole answer all three; without the field, none."""
    from specdec.events import TextDelta, TokenLogprob, TokenSource
    from tests.fakeengine import finished, post

    lps = (TokenLogprob(5, -0.5, ((5, -0.5), (6, -1.5))), TokenLogprob(9, -0.25, ((9, -0.25),)),
           TokenLogprob(11, 0.0, ((11, 0.0),)))
    srcs = (TokenSource("forced", 1), TokenSource("drafted", 40), TokenSource("target", 3))
    fake.script = [TextDelta("<5>", (5,), lps[:1], srcs[:1]),
                   TextDelta("<9>", (9,), lps[1:2], srcs[1:2]),
                   finished("<5><9>", tokens=(5, 9, 11), logprobs=lps, sources=srcs)]
    want = [{"id": t, "text": f"<{t}>", "bytes": list(f"<{t}>".encode()),
             "source": s.source, "allowed": s.allowed, "logprob": lp.logprob,
             "top": [{"id": a, "text": f"<{a}>", "bytes": list(f"<{a}>".encode()),
                      "logprob": b} for a, b in lp.top[:1]]}
            for t, s, lp in zip((5, 9, 11), srcs, lps)]
    path, body, _ = body_of(api, stream=True, sources=1)
    deltas, closing = wire_sources(api, events_of(post(fake_app, path, body)))
    assert (deltas, closing) == (want[:2], want[2:])
    assert fake.seen[-1].token_sources == 1
    path, body, _ = body_of(api, stream=False, sources=1)
    r = post(fake_app, path, body)
    assert r.status_code == 200, r.text
    assert whole_sources(api, r.json()) == want
    for stream in (False, True):
        path, body, _ = body_of(api, stream=stream)
        r = post(fake_app, path, body)
        assert r.status_code == 200 and "token_sources" not in r.text, r.text


def test_messages_refuse_token_sources_beside_omitted_thinking(fake, fake_app):
    from tests.fakeengine import finished, post

    path, body, _ = body_of("messages", stream=False, sources=True)
    body["thinking"] = {"type": "enabled", "budget_tokens": 8, "display": "omitted"}
    r = post(fake_app, path, body)
    assert r.status_code == 400 and "token_sources" in r.json()["error"]["message"], r.text
    body["thinking"].pop("display")
    fake.script = [finished("{}", reasoning="")]
    assert post(fake_app, path, body).status_code == 200


@pytest.mark.model
@pytest.mark.parametrize("tools", [False, True], ids=["schema", "tool call"])
@pytest.mark.parametrize("api", APIS)
def test_token_sources_streamed_and_whole(server, api, tools):
    path, body, headers = body_of(api, stream=False, sources=2, tools=tools)
    r = server.http.post(path, json=body, headers=headers)
    assert r.status_code == 200, r.text
    whole = whole_sources(api, r.json())
    check_entries(whole, 2)
    text = answer_text(api, r.json())
    # The tokens' bytes, joined, are the answer's UTF-8 (their text too, where no token
    # splits a character, as in this ASCII JSON).
    if not tools:
        assert b"".join(bytes(e["bytes"]) for e in whole).decode() == text
        assert "".join(e["text"] for e in whole) == text
        json.loads(text)
    path, body, headers = body_of(api, stream=True, sources=2, tools=tools)
    events = events_of(server.http.post(path, json=body, headers=headers))
    streamed, carried_text = streamed_sources(api, events)
    streamed += wire_sources(api, events)[1]
    # Greedy: the same tokens, each carried by one delta or the closing event (where each
    # came from may differ: the second request's proposals include the first's answer).
    def strip(es: list[dict]) -> list[dict]:
        return [{k: v for k, v in e.items() if k != "source"} for e in es]

    assert strip(streamed) == strip(whole)
    check_entries(streamed, 2)
    if not tools:
        assert carried_text == text
    else:
        assert json.loads(carried_text) == json.loads(text) and "city" in json.loads(text)


@pytest.mark.model
@pytest.mark.parametrize("api", APIS)
def test_absent_unless_asked(server, api):
    for stream in (False, True):
        for off in (None, False):
            path, body, headers = body_of(api, stream=stream, sources=off)
            r = server.http.post(path, json=body, headers=headers)
            assert r.status_code == 200, r.text
            assert "token_sources" not in r.text


@pytest.mark.model
@pytest.mark.parametrize("api", APIS)
def test_bad_values_are_a_400_naming_the_field(server, api):
    for bad in (21, -1, "yes", 2.5, [1], {"n": 1}):
        path, body, headers = body_of(api, stream=False, sources=bad)
        r = server.http.post(path, json=body, headers=headers)
        assert r.status_code == 400, (bad, r.text)
        if api == "messages":
            assert r.json()["type"] == "error" and "token_sources" in r.json()["error"]["message"]
        else:
            err = r.json()["error"]
            assert "token_sources" in (err["param"] or "") + err["message"], err
    assert server.http.get("/health").status_code == 200


@pytest.mark.model
def test_chat_logprobs_keep_their_own_count_beside_more_alternatives(server):
    path, body, _ = body_of("chat", stream=False, sources=4)
    body.update(logprobs=True, top_logprobs=1)
    out = server.http.post(path, json=body).json()
    lps = out["choices"][0]["logprobs"]["content"]
    srcs = out["choices"][0]["token_sources"]
    assert len(lps) == len(srcs)
    for lp, e in zip(lps, srcs):
        assert len(lp["top_logprobs"]) == min(1, e["allowed"])
        assert len(e["top"]) == min(4, e["allowed"])
        assert (lp["token"], lp["logprob"]) == (e["text"], e["logprob"])
        assert [(t["token"], t["logprob"]) for t in lp["top_logprobs"]] == \
            [(t["text"], t["logprob"]) for t in e["top"][:1]]


@pytest.mark.model
def test_official_clients_read_the_extension(server):
    """The openai and anthropic SDKs stream a request that asks for it, and keep it on
    their objects (`model_extra`)."""
    client = server.client()
    seen = []
    with client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": USER}], max_tokens=16,
            temperature=0, stream=True, extra_body={"token_sources": True}) as st:
        for chunk in st:
            for ch in chunk.choices:
                seen += (ch.model_extra or {}).get("token_sources") or []
    assert seen and all(e["source"] in SOURCES and e["allowed"] is None for e in seen)
    ac = server.anthropic_client()
    seen = []
    with ac.messages.stream(model="default", max_tokens=16,
                            messages=[{"role": "user", "content": USER}],
                            extra_body={"token_sources": 1, "temperature": 0}) as st:
        for ev in st:
            if ev.type == "content_block_delta":
                seen += (ev.model_extra or {}).get("token_sources") or []
        final = st.get_final_message()
    assert seen and "".join(e["text"] for e in seen) == final.content[0].text


@pytest.mark.model
def test_every_decode_path_reports_the_same_allowed_sets(engines):
    """Plain decoding, proposal chains and token trees (branches priced in: every round may
    grow one) emit the same tokens with the same allowed-set sizes on the reference BLAS;
    only where each came from differs, and a tree's accepted branches say "branch"."""
    from collections import Counter

    from specdec.request import Constraint, GenerateRequest, Message

    engine = engines["distilled"]
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"],
                                       "email": {"type": "string", "format": "email"}},
              "required": ["name", "age", "email"]}
    got = {}
    for arm, spec in (("plain", None), ("chain", {"tree": 0}),
                      ("tree", {"tree": 8, "tree_min_score": 0.0})):
        f = engine.generate(engine.prepare(GenerateRequest(
            messages=(Message("user", USER + " With an email."),),
            constraint=Constraint.json_schema(schema), max_tokens=48, token_sources=0,
            spec=spec)))
        assert len(f.sources) == len(f.tokens) == len(f.logprobs) > 0
        got[arm] = f
    for arm in ("chain", "tree"):
        assert got[arm].tokens == got["plain"].tokens, arm
        assert [s.allowed for s in got[arm].sources] == \
            [s.allowed for s in got["plain"].sources], arm
        assert [lp.logprob for lp in got[arm].logprobs] == \
            [lp.logprob for lp in got["plain"].logprobs], arm
    counts = {arm: Counter(s.source for s in f.sources) for arm, f in got.items()}
    assert set(counts["plain"]) <= {"forced", "target", "budget"}, counts
    assert counts["tree"]["branch"] > 0, counts
    assert "branch" not in counts["chain"], counts
    assert set(counts["chain"]) - {"forced", "target", "budget"}, counts  # proposals accepted


@pytest.mark.model
def test_tree_tokens_sets_a_requests_token_tree(server):
    """`tree_tokens` (every API): the most branch tokens a round adds; 0 proposes chains
    only, so no token comes from a branch; past the limit it is a 400 naming it."""
    from server.chat import to_request
    from server.chat_wire import ChatCompletionRequest

    path, body, _ = body_of("chat", stream=False, sources=True)
    assert to_request(ChatCompletionRequest.model_validate(
        {**body, "tree_tokens": 8})).spec == {"tree": 8}
    out = server.http.post(path, json={**body, "tree_tokens": 0}).json()
    assert "branch" not in {e["source"] for e in out["choices"][0]["token_sources"]}
    assert out["specdec"]["branched"] == 0 and out["specdec"]["proposed"] > 0
    for api in APIS:
        path, body, headers = body_of(api, stream=False)
        r = server.http.post(path, json={**body, "tree_tokens": 33}, headers=headers)
        assert r.status_code == 400 and "tree_tokens" in r.text, r.text
