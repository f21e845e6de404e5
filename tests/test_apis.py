"""The same guarantees on every API: one constrained request through Chat Completions,
Responses and Messages, streamed and not, thinking and not, in three reasoning formats (think
tags, Gemma channels, Harmony), gives the tokens of the same request through Chat Completions
with speculation off, and every finished answer validates.

In process (httpx's ASGI transport against the real app and engine), on the reference BLAS
where equality is promised: per format a small random-weight Qwen 3 with that format's
tokenizer and template (think tags: the output opens the block, with a no-think switch;
Gemma 4's channels; Harmony) and an unrelated draft of the same tokenizer, so speculation
proposes, is rejected and recovers. The tokens each request
produced are read off the engine's own `Finished` events.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import jsonschema
import pytest

from specdec import blas
from specdec.engine import Engine
from specdec.events import Finished
from specdec.models import load
from tests import tally
from tests.families import make_family

TEMPLATES = Path(__file__).parent / "templates"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
PROMPT = "Extract the fields as JSON: Ada, 36."
MAX_TOKENS, BUDGET = 60, 12


# reasoning format -> (tokenizer kind, template, end-of-generation tokens; None: the family's)
FORMATS = {"think": ("chatml", "qwen3_style.jinja", None),
           "gemma": ("gemma4", "gemma4_style.jinja", ("<turn|>", "<eos>")),
           "harmony": ("harmony", "tools_harmony.jinja", ("<|return|>", "<|endoftext|>",
                                                         "<|call|>"))}


@pytest.fixture(scope="module", params=list(FORMATS))
def served(request, tmp_path_factory):
    from server.app import create_app
    from server.door import ServeConfig

    kind, name, eos = FORMATS[request.param]
    root = tmp_path_factory.mktemp("apis")
    template = (TEMPLATES / name).read_text()
    target = load(str(make_family("qwen3", root / "t", think=True, scale=1.0,
                                  template=template, tokenizer=kind, eos=eos)))
    draft = load(str(make_family("qwen3", root / "d", seed=1, think=True, scale=1.0,
                                 template=template, tokenizer=kind, eos=eos)))
    engine = Engine(target, draft)
    tokens: list[tuple[int, ...]] = []
    output = engine.output

    def spy(req, sink):
        def record(ev):
            if isinstance(ev, Finished):
                tokens.append(ev.tokens)
            sink(ev)
        return output(req, record)

    engine.output = spy  # type: ignore[method-assign]
    yield create_app(engine, ServeConfig()), tokens, engine
    engine.close()


def body_of(api: str, thinking: bool, stream: bool, plain: bool = False) -> tuple[str, dict]:
    msgs = [{"role": "user", "content": PROMPT}]
    if api == "chat":
        b = {"messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
             "response_format": {"type": "json_schema", "json_schema": {
                 "name": "person", "schema": SCHEMA, "strict": True}}}
        if thinking:
            b["max_thinking_tokens"] = BUDGET
        if plain:
            b["num_draft_tokens"] = 0
        return "/v1/chat/completions", b
    if api == "responses":
        b = {"model": "default", "input": PROMPT, "max_output_tokens": MAX_TOKENS,
             "temperature": 0, "stream": stream, "text": {"format": {
                 "type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}}}
        if thinking:
            b["reasoning"] = {"effort": "low"}
            b["max_thinking_tokens"] = BUDGET
        return "/v1/responses", b
    b = {"model": "default", "messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0,
         "stream": stream, "output_format": {"type": "json_schema", "schema": SCHEMA}}
    if thinking:
        b["thinking"] = {"type": "enabled", "budget_tokens": BUDGET}
    return "/v1/messages", b


def sse_events(text: str) -> list[tuple[str | None, dict]]:
    out = []
    for block in text.split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:") and line[5:].strip() != "[DONE]":
                data = json.loads(line[5:])
        if data is not None:
            out.append((name or data.get("type"), data))
    return out


def answer_of(api: str, r: httpx.Response, stream: bool) -> tuple[str, str]:
    """(reasoning, answer) as the API's client would assemble them."""
    reasoning, answer = "", ""
    if not stream:
        d = r.json()
        if api == "chat":
            m = d["choices"][0]["message"]
            return m.get("reasoning_content") or "", m["content"]
        if api == "responses":
            for item in d["output"]:
                for part in item.get("content") or []:
                    if item["type"] == "reasoning":
                        reasoning += part["text"]
                    elif part["type"] == "output_text":
                        answer += part["text"]
            return reasoning, answer
        for block in d["content"]:
            if block["type"] == "thinking":
                reasoning += block["thinking"]
            elif block["type"] == "text":
                answer += block["text"]
        return reasoning, answer
    for name, d in sse_events(r.text):
        if api == "chat":
            for ch in d.get("choices", []):
                reasoning += ch["delta"].get("reasoning_content") or ""
                answer += ch["delta"].get("content") or ""
        elif api == "responses":
            if name == "response.output_text.delta":
                answer += d["delta"]
            elif name == "response.reasoning_text.delta":
                reasoning += d["delta"]
        elif name == "content_block_delta":
            delta = d["delta"]
            answer += delta.get("text", "") if delta["type"] == "text_delta" else ""
            reasoning += delta.get("thinking", "") if delta["type"] == "thinking_delta" else ""
    return reasoning, answer


@pytest.mark.skipif(blas.active() != "reference", reason="equality is promised on the "
                    "reference BLAS only")
@pytest.mark.parametrize("thinking", [False, True], ids=["answer", "think-then-answer"])
def test_every_api_streamed_or_not_gives_plain_chat_completions_tokens(served, thinking):
    app, tokens, engine = served

    async def go():
        got = {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=300) as c:
            path, body = body_of("chat", thinking, False, plain=True)
            for effort in (None, "low") if thinking else (None,):
                # (Responses asks for thinking with an effort, which templates read)
                r = await c.post(path, json={**body, "reasoning_effort": effort} if effort
                                 else body)
                assert r.status_code == 200, r.text
                got["plain", effort] = (tokens[-1], answer_of("chat", r, False),
                                        r.json()["choices"][0]["finish_reason"])
            for api in ("chat", "responses", "messages"):
                for stream in (False, True):
                    path, body = body_of(api, thinking, stream)
                    r = await c.post(path, json=body)
                    assert r.status_code == 200, (api, stream, r.text)
                    got[api, stream] = (tokens[-1], answer_of(api, r, stream))
        return got

    got = asyncio.run(go())
    want = {effort: got.pop(("plain", effort)) for effort in (None, "low")
            if ("plain", effort) in got}
    for want_tokens, (want_reasoning, want_answer), finish in want.values():
        if finish == "stop":  # (else max_tokens cut it)
            jsonschema.validate(json.loads(want_answer), SCHEMA)
        text = engine.decode_text(want_tokens)
        # Thinking: the reasoning is carried (where the output opens it, the model may
        # also answer at once); without it, no reasoning markers in the output.
        opens = ("<think>", "<|channel>thought", "<|channel|>analysis<|message|>")
        if not thinking:
            assert want_reasoning == "" and not text.startswith(opens), text
        elif want_reasoning:
            assert want_reasoning in text and want_reasoning not in want_answer
    for (api, stream), (toks, split) in got.items():
        # The template reads reasoning_effort (Harmony's system line): Responses' thinking
        # request is compared with the chat request of the same effort.
        w = want["low" if api == "responses" and thinking else None]
        tally.record("apis: chat, responses, messages x stream vs plain chat", toks == w[0])
        assert toks == w[0], (api, stream)
        assert split == w[1], (api, stream)


def test_a_think_only_template_thinks_then_answers_on_every_api_unasked(tmp_path):
    # The template opens a think block for the reply and has no switch to turn it off: a
    # constrained request that does not ask for thinking is served on every API, streamed
    # or not: it thinks (within the default thinking budget), then answers under the
    # constraint; the reasoning comes back where each API puts it.
    from server.app import create_app
    from server.door import ServeConfig

    template = (TEMPLATES / "r1_style.jinja").read_text()
    engine = Engine(load(str(make_family("qwen3", tmp_path / "r1", think=True, scale=1.0,
                                         template=template))))
    app = create_app(engine, ServeConfig())

    async def go():
        out = {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=300) as c:
            for api in ("chat", "responses", "messages"):
                for stream in (False, True):
                    path, body = body_of(api, False, stream)
                    out[api, stream] = await c.post(path, json=body)
        return out

    try:
        got = asyncio.run(go())
    finally:
        engine.close()
    splits = set()
    for (api, stream), r in got.items():
        assert r.status_code == 200, (api, stream, r.text)
        reasoning, answer = answer_of(api, r, stream)
        jsonschema.validate(json.loads(answer), SCHEMA)
        assert reasoning and "</think>" not in reasoning + answer, (api, stream, reasoning)
        splits.add((reasoning, answer))
    assert len(splits) == 1, splits  # greedy: one output, split alike by every API
