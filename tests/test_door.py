"""The one door (`Engine.submit` → events, `output.Output`): every caller gets the same
tokens, finish reason, usage and logprobs, because they are computed in one place.

Unit tests drive `Output` with a hand-made decoder (a stop string that cuts a token in the
middle, reasoning split from the answer, a tool call cut by max_tokens); the integration test
runs the same request through the CLI (a subprocess) and the server app (in process) on the
embedded model and compares everything they report.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import httpx
import pytest

from specdec import blas
from specdec.events import (Failed, Finished, ReasoningDelta, TextDelta, TokenLogprob,
                            ToolCallDelta)
from specdec.output import Output
from specdec.reasoning import Thinking
from specdec.request import GenerateRequest, Message
from specdec.sampling import SamplingParams
from specdec.speculative import SpecStats
from specdec.tools import GENERIC, CallParser, ToolFormat

VOCAB = {1: "ab", 2: "cd", 3: "ef", 4: "<think>", 5: "</think>", 6: "\n\n",
         7: "{\"tool_calls\": [{\"name\": \"", 8: "f\", \"arguments\": ", 9: "{}}]}",
         10: "gh", 11: "<tool_call>\n{\"name\": \"", 12: "{}}\n</tool_call>"}
# Calls that may follow text (Hermes' markup): tokens 11, 8, 12.
HERMES = ToolFormat("template", "", '<tool_call>\n{"name": "', '\n<tool_call>\n{"name": "',
                    '", "arguments": ', '}\n</tool_call>\n<tool_call>\n{"name": "',
                    '}\n</tool_call>', "<tool_call>")


def parser(fmt=GENERIC):
    return CallParser(fmt)


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


def run_output(tokens, **kw):
    events = []
    out = Output(decode, events.append, prompt_tokens=3, **kw)
    for i, t in enumerate(tokens):
        if out.feed(t, TokenLogprob(t, -0.1 * (i + 1))):
            break
    out.finish("length", SpecStats(), 1.0)
    return events


def test_a_stop_string_that_cuts_a_token_keeps_the_tokens_its_text_begins_in():
    # "abcdef" with stop "de": the content is "abc"; token 2 ("cd") begins inside it and is
    # counted (usage, logprobs, tokens); token 3 ("ef") lies wholly after the cut.
    events = run_output([1, 2, 3, 10], stop=("de",))
    done = events[-1]
    assert isinstance(done, Finished)
    assert (done.text, done.finish_reason, done.stop_sequence) == ("abc", "stop", "de")
    assert done.tokens == (1, 2) and done.usage.completion_tokens == 2
    assert [e.token for e in done.logprobs] == [1, 2]
    deltas = [e for e in events if isinstance(e, TextDelta)]
    assert "".join(d.text for d in deltas) == "abc"
    assert [t for d in deltas for t in d.tokens] == [1, 2]
    assert [e.token for d in deltas for e in d.logprobs] == [1, 2]


def test_a_stop_string_at_a_token_boundary_drops_the_tokens_after_it():
    done = run_output([1, 2, 3], stop=("cd",))[-1]
    assert (done.text, done.tokens, done.usage.completion_tokens) == ("ab", (1,), 1)


def test_reasoning_and_answer_arrive_as_their_own_deltas_and_join_to_the_final_split():
    events = run_output([4, 1, 2, 5, 6, 3, 10], thinking=Thinking("</think>", "<think>"),
                        reasoning_tokens=lambda toks, th: 4)
    done = events[-1]
    assert (done.reasoning, done.text) == ("abcd", "efgh")
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "abcd"
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "efgh"
    assert done.usage.reasoning_tokens == 4 and done.usage.completion_tokens == 7


def test_a_tool_call_streams_its_name_then_its_arguments_and_a_cut_one_is_never_reported():
    whole = Output(decode, (got := []).append, calls=parser())
    for t in (7, 8, 9):
        whole.feed(t)
    whole.finish("stop", SpecStats(), 1.0)
    calls = [e for e in got if isinstance(e, ToolCallDelta)]
    assert {(c.index, c.id, c.name) for c in calls} == {(0, got[-1].tool_calls[0].id, "f")}
    assert json.loads("".join(c.arguments for c in calls)) == {}
    assert got[-1].finish_reason == "tool_calls" and got[-1].text == ""
    assert not [e for e in got if isinstance(e, TextDelta)]
    cut = run_output([7, 8], calls=parser())  # max_tokens ran out mid-call
    assert cut[-1].finish_reason == "length" and cut[-1].tool_calls == () and \
        cut[-1].text == ""
    assert not [e for e in cut if isinstance(e, TextDelta)]  # markup never reaches content


def test_text_then_a_call_streams_the_text_then_the_call_and_holds_markup_back():
    events = run_output([1, 2, 6, 11, 8, 12], calls=parser(HERMES), stop=("tool",))
    done = events[-1]
    assert done.text == "abcd\n" and done.finish_reason == "length"
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "abcd\n"
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    assert {d.id for d in deltas} == {done.tool_calls[0].id} and deltas[0].name == "f"
    assert "".join(d.arguments for d in deltas) == done.tool_calls[0].arguments == "{}"


def test_a_failed_request_ends_with_failed(engine):
    from specdec.errors import SpecdecError

    stream = engine.submit(engine.prepare(GenerateRequest(
        messages=(Message("user", "hi"),), max_tokens=2)))
    events = list(stream)
    assert isinstance(events[-1], Finished)
    events = []
    Output(decode, events.append).fail(SpecdecError("boom"))
    assert isinstance(events[0], Failed)


def _mid_token_stop(engine, req):
    """A stop string that begins in the middle of an output token (its second character)
    and does not occur earlier, and the content the stop leaves."""
    free = engine.generate(engine.prepare(req))
    tok = engine.target.tokenizer
    texts = [tok.decode([t], skip_special_tokens=False) for t in free.tokens]
    text = "".join(texts)
    at = 0
    for i, t in enumerate(texts[:-1]):
        stop = t[1:] + texts[i + 1][:1]
        if len(t) >= 2 and t.isascii() and text.find(stop) == at + 1:
            return stop, text[:at + 1], i + 1
        at += len(t)
    pytest.skip("no token fit for a mid-token stop in this output")


@pytest.mark.model
def test_cli_and_server_give_the_same_tokens_usage_and_logprobs_with_a_mid_token_stop(
        engine):
    from server.app import create_app
    from server.door import ServeConfig

    prompt = "Write one sentence about the sea."
    base = GenerateRequest(messages=(Message("user", prompt),), max_tokens=24,
                           sampling=SamplingParams(), logprobs=2, spec=None)
    stop, content, n_tokens = _mid_token_stop(engine, base)
    cli = subprocess.run([sys.executable, "-m", "specdec", "generate", "--prompt", prompt,
                          "--max-tokens", "24", "--temperature", "0", "--stop", stop,
                          "--draft-model", "none", "--stats", "--logprobs", "2"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "SPECDEC_BLAS": blas.active()})  # as this process
    assert cli.returncode == 0, cli.stderr
    stats = json.loads(cli.stderr.strip().splitlines()[-1])
    assert cli.stdout[:-1] == content  # print() adds the newline

    async def ask():
        app = create_app(engine, ServeConfig())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as c:
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
                "temperature": 0, "stop": [stop], "logprobs": True, "top_logprobs": 2,
                "num_draft_tokens": 0}, timeout=300)
        return r

    try:
        r = asyncio.run(ask())
    finally:
        engine.close()  # later tests decode on their own thread again
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == content
    assert choice["finish_reason"] == stats["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == stats["usage"]["completion_tokens"] == \
        len(stats["tokens"]) == n_tokens
    assert body["usage"]["prompt_tokens"] == stats["usage"]["prompt_tokens"]
    served = choice["logprobs"]["content"]
    tok = engine.target.tokenizer
    assert [e["token"] for e in served] == [tok.decode([t], skip_special_tokens=False)
                                            for t in stats["tokens"]]
    assert [e["logprob"] for e in served] == [lp for _, lp, _ in stats["logprobs"]]
    assert [[a["logprob"] for a in e["top_logprobs"]] for e in served] == \
        [[b for _, b in top] for _, _, top in stats["logprobs"]]
    # The logprob tokens join to the content, then the cut token's rest (inside the stop).
    joined = "".join(e["token"] for e in served)
    assert joined.startswith(content) and stop.startswith(joined[len(content):])


@pytest.mark.parametrize("body,loc,path", [
    # a tagged union's tag value and a union member's name are not in the body
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     ("messages", 0, "user", "content", "str"), "messages[0].content"),
    # a field that is missing ends the path
    ({"input": [{"type": "message"}]}, ("input", 0, "message", "role"), "input[0].role"),
    # a mapping's keys are data: the mapping is the field at fault
    ({"logit_bias": {"x": 1}}, ("logit_bias", "x", "[key]"), "logit_bias"),
    ({"logit_bias": {"5": 200}}, ("logit_bias", "5"), "logit_bias"),
    # a validator's name is not a field
    ({"tools": [{"type": "function"}]}, ("tools", 0, "function-after[check()]"), "tools[0]"),
])
def test_a_validation_error_names_the_field_as_the_body_spells_it(body, loc, path):
    from server.door import field_path

    assert field_path(body, loc) == path


def test_each_api_names_the_engines_fields_its_own_way():
    from server import chat, messages, responses
    from server.errors import wire_param
    from specdec.errors import RequestError

    def param(api, neutral):
        return wire_param(RequestError("x", param=neutral), api.PARAMS)

    assert [param(api, "messages[2]") for api in (chat, responses)] == ["messages[2]", "input"]
    assert [param(api, "constraint") for api in (chat, responses, messages)] == [
        "response_format", "text.format", "output_config.format"]
    assert [param(api, "max_tokens") for api in (chat, responses, messages)] == [
        "max_tokens", "max_output_tokens", "max_tokens"]
    assert param(chat, "sampling.temperature") == param(responses, "sampling.temperature") \
        == "temperature"
    assert param(messages, "stop") == "stop_sequences"


@pytest.mark.parametrize("tokens,kw", [
    ([1, 2, 3, 10], {}),
    ([1, 2, 3, 10], {"stop": ("de",)}),
    # thinking: the split holds text back (a possible end marker) across several tokens
    ([4, 1, 2, 1, 2, 5, 6, 3, 10], {"thinking": Thinking("</think>", "<think>")}),
    ([4, 1, 2, 5, 6, 7, 8, 9], {"thinking": Thinking("</think>", "<think>"),
                               "calls": parser()}),
    ([7, 8, 9], {"calls": parser()}),
    ([1, 6, 11, 8, 12], {"calls": parser(HERMES)}),
], ids=["plain", "stop", "thinking", "thinking-then-call", "call", "text-then-call"])
def test_every_kept_token_and_logprob_is_carried_by_exactly_one_event_in_order(tokens, kw):
    events = Output(decode, (got := []).append, reasoning_tokens=lambda t, th: 0, **kw)
    for i, t in enumerate(tokens):
        if events.feed(t, TokenLogprob(t, -0.1 * (i + 1))):
            break
    done = events.finish("stop", SpecStats(), 1.0)
    carried = [t for e in got[:-1] for t in e.tokens]
    assert carried == list(done.tokens)
    assert [x.token for e in got[:-1] for x in e.logprobs] == list(done.tokens)


@pytest.mark.model
def test_a_stopped_scheduler_ends_every_stream_and_the_engine_decodes_inline_again(engine):
    from specdec.errors import SchedulerStopped

    req = engine.prepare(GenerateRequest(messages=(Message("user", "Count to ten."),),
                                         max_tokens=40, sampling=SamplingParams()))
    engine.start()
    streams = [engine.submit(req) for _ in range(3)]
    engine.close()  # mid-decode: what the thread still holds ends with Failed, nothing hangs
    ends = [list(s)[-1] for s in streams]
    assert all(isinstance(e, (Finished, Failed)) for e in ends)
    assert any(isinstance(e, Failed) and isinstance(e.error, SchedulerStopped) for e in ends) \
        or all(isinstance(e, Finished) for e in ends)
    again = engine.generate(req)  # no thread now: this thread runs the rounds
    assert again.finish_reason in ("stop", "length") and again.tokens
    early = engine.submit(req)
    for _ in early:  # a reader that stops early cancels its request
        break
    assert early.cancelled.is_set() and engine._inline.active == 0  # dropped, slots freed


@pytest.mark.model
@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "scheduler thread"])
def test_a_stream_read_again_after_its_end_yields_nothing_and_returns(engine, threaded):
    # A reader that took the first event and stopped (the request is cancelled and, inline,
    # drained to its end), then iterates again: the rest or nothing, never a wait or a spin.
    req = engine.prepare(GenerateRequest(messages=(Message("user", "Count to ten."),),
                                         max_tokens=8, sampling=SamplingParams()))
    if threaded:
        engine.start()
    try:
        stream = engine.submit(req)
        next(iter(stream))
        rest = list(stream)
        assert not rest or isinstance(rest[-1], (Finished, Failed))
        assert list(stream) == [] and stream.ended
    finally:
        engine.close()
