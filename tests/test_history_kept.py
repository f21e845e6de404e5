"""The history kept for the next turn (`Engine.keep_history`): after an answer, the prompt
its conversation's next request starts with (the answer as the template renders it back:
reasoning it drops, calls it re-serializes, the next turn's opening) is prefilled into the
prompt store in the background, from the answer's own kept state up to where they part.

On three template shapes (tiny random models of real families' templates, each its own
draft): Hermes' (calls re-serialized), Qwen3's (thinking on: reasoning kept within a tool
loop, dropped once a new question comes) and DeepSeek-R1-distill's (always thinking,
reasoning dropped from every earlier turn). A tool loop of a few turns through the engine
as the server runs it (started, `keep_history` after each answer): each later turn restores
everything its prompt shares with the history prefilled, so it computes only what the client
added; and its tokens and logprobs equal the same request computed cold (no store, prefilled
in chunks that the restored prefix ends inside of); every stored state equals its key's
tokens prefilled cold, bitwise (the reference BLAS). Through the server: the Chat API queues
the prefill after an answer, and /metrics counts it.
"""

from __future__ import annotations

import json
import os
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from specdec.engine import Engine
from specdec.events import Failed, Finished
from specdec.models import load
from specdec.request import GenerateRequest, Message, SamplingParams, Tool, ToolCall
from specdec.speculative import SpecConfig
from tests import tally
from tests.families import make_tool_family

SHAPES = {"hermes": False, "qwen3": True, "r1_distill": None}  # thinking asked (None: always)
TOOL = Tool("lookup", "Look a word up", {"type": "object", "properties": {
    "word": {"type": "string", "maxLength": 6}}, "required": ["word"],
    "additionalProperties": False}, strict=True)
SYSTEM = "You look words up for the user. " * 4
CHUNK = 16  # the cold side's prefill chunk


def _shared(a, b) -> int:
    return len(os.path.commonprefix([list(a), list(b)]))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("history")
    return {k: load(str(make_tool_family(k, root / k))) for k in SHAPES}


def _idle(e: Engine) -> None:
    s = e.scheduler
    while s.active or s.queue_depth or s.background:
        time.sleep(0.002)


def _run(e: Engine, greq: GenerateRequest, req=None) -> Finished:
    for ev in e.submit(req if req is not None else e.prepare(greq)):
        if isinstance(ev, Failed):
            raise ev.error
        if isinstance(ev, Finished):
            return ev
    raise AssertionError("no end")


def _request(msgs: list[Message], calling: bool, thinking: bool | None) -> GenerateRequest:
    return GenerateRequest(messages=tuple(msgs), tools=(TOOL,),
                           tool_choice="required" if calling else "auto",
                           max_tokens=48, sampling=SamplingParams(0.9, seed=3), logprobs=2,
                           thinking=bool(thinking), thinking_budget=6 if thinking else None,
                           spec={"k": 3})


@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_turn_restores_the_history_kept_and_decodes_as_cold(models, shape):
    m, thinking = models[shape], SHAPES[shape]
    warm = Engine(m, m, SpecConfig(k=3))
    warm.start()
    cold = Engine(m, m, SpecConfig(k=3))
    cold.kv_store.capacity = 0  # every prompt computed from 0
    cold.start()
    cold.scheduler.chunk = CHUNK
    try:
        msgs = [Message("system", SYSTEM), Message("user", "Look up 'cat'.")]
        history: list[int] | None = None
        kept = computed_extra = 0
        for turn in range(4):
            calling = msgs[-1].role == "user"
            greq = _request(msgs, calling, thinking)
            req = warm.prepare(greq)
            ids = list(req.prompt_ids)
            got = _run(warm, greq, req)
            if history is not None:
                # it restored all its prompt shares with the history kept, and computed the rest
                expect = _shared(ids[:-1], history)
                assert got.usage.cached_tokens == expect, (turn, got.usage, expect, len(ids))
                assert expect >= len(history) - 1, (turn, expect, len(history))
                computed_extra += len(ids) - 1 - expect
                want = _run(cold, greq)
                assert want.usage.cached_tokens == 0 and expect % CHUNK
                same = (got.tokens, got.finish_reason, got.logprobs) == (
                    want.tokens, want.finish_reason, want.logprobs)
                tally.record(f"history kept ({shape}): next turn restored vs cold "
                             "(tokens, logprobs)", same)
                assert same, (turn, got.tokens, want.tokens)
            answer = Message("assistant", got.text, got.reasoning, got.tool_calls)
            assert (thinking is False) == (got.reasoning is None), got.reasoning
            before = warm.scheduler.stats.history_prefills
            computed = warm.scheduler.stats.history_computed
            kept_keys = warm.scheduler._kept.get(id(req), ())
            assert kept_keys, "the answer's state was kept"
            queued = warm.keep_history(greq, answer, req)
            _idle(warm)
            history = warm.preparer.history_ids(greq, answer)
            assert queued == len(history)
            assert warm.scheduler.stats.history_prefills == before + 1
            assert warm.kv_store.has(m.model, history)
            if warm.scheduler.stats.history_computed > computed:  # stored: the answer's went
                assert not any(warm.kv_store.has(m.model, key) for _, key in kept_keys
                               if list(key) != history)
            kept += 1
            msgs.append(answer)
            if got.tool_calls:
                msgs += [Message("tool", json.dumps({"meaning": "a small animal"}),
                                 tool_call_id=c.id, name=c.name) for c in got.tool_calls]
            else:
                msgs.append(Message("user", "And 'dog'?"))
        assert kept == 4
        # every state the store holds is its key's tokens prefilled cold, target and draft
        checked = 0
        for (_, key), (model, states, _) in list(warm.kv_store._entries.items()):
            cache = make_prompt_cache(model)
            model(mx.array([list(key)], dtype=mx.int32), cache=cache)
            keys, values, n = states[0]
            assert n == len(key)
            want_k, want_v = cache[0].state[0], cache[0].state[1]
            assert mx.array_equal(keys[..., :n, :], want_k[..., :n, :])
            assert mx.array_equal(values[..., :n, :], want_v[..., :n, :])
            checked += 1
        assert checked >= 2
    finally:
        warm.close()
        cold.close()


def test_a_history_prefill_replaces_only_its_own_answers_state(models):
    # Two conversations with the same first prompt and different answers, on a template that
    # drops the reasoning from the history (so either kept state shares as much with the
    # history as the other): the history prefill of the later one drops that one's kept
    # state, not the earlier one's.
    m = models["r1_distill"]
    e = Engine(m, m, SpecConfig(k=3))
    e.start()
    try:
        msgs = (Message("system", SYSTEM), Message("user", "Say something."))
        runs = []
        for seed in (1, 2):
            # (a first turn without tools: `continues` says a next turn comes, so its
            # answer is kept)
            greq = GenerateRequest(messages=msgs, max_tokens=24, thinking_budget=8,
                                   sampling=SamplingParams(8.0, seed=seed), spec={"k": 3},
                                   continues=True)
            req = e.prepare(greq)
            before = set(e.kv_store._entries)
            got = _run(e, greq, req)
            runs.append((greq, req, got, set(e.kv_store._entries) - before))
        assert runs[0][2].tokens != runs[1][2].tokens
        (_, _, _, other), (greq, req, got, own) = runs
        assert other and own
        e.keep_history(greq, Message("assistant", got.text, got.reasoning), req)
        _idle(e)
        assert e.scheduler.stats.history_computed > 0
        assert other <= set(e.kv_store._entries)  # the other conversation's answer stays
        assert not own & set(e.kv_store._entries)  # this one's is superseded
    finally:
        e.close()


def test_the_server_queues_the_history_after_an_answer(models):
    # Through the Chat API: after an answer the server prefills the history in the
    # background (/metrics counts it) and the next turn, resending it, restores it.
    from server.app import create_app
    from server.chat import to_request
    from server.chat_wire import ChatCompletionRequest
    from server.door import ServeConfig
    from tests.serverproc import InProcess

    m = models["hermes"]
    e = Engine(m, m, SpecConfig(k=3))
    asgi = create_app(e, ServeConfig())
    app = InProcess(asgi, e)
    try:
        c = app.client()
        tools = [{"type": "function", "function": {"name": TOOL.name, "parameters":
                                                   dict(TOOL.parameters)}}]
        msgs = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Look up 'cat'."}]
        body1 = dict(model="default", messages=msgs, tools=tools, tool_choice="required",
                     max_tokens=48, temperature=0)
        r1 = c.chat.completions.create(**body1)
        while asgi.state.door.prepares.pending:
            time.sleep(0.002)
        _idle(e)
        metrics = app.http.get("/metrics").text
        assert "specdec_history_prefills_total 1" in metrics, metrics
        m1 = r1.choices[0].message
        call = m1.tool_calls[0]
        body2 = dict(model="default", messages=[*msgs, m1.model_dump(exclude_none=True), {
            "role": "tool", "tool_call_id": call.id, "content": "a small animal"}],
            tools=tools, max_tokens=8, temperature=0)
        r2 = c.chat.completions.create(**body2)
        # the history the server kept, as the engine renders it from the server's own
        # reading of the first body and its answer; the second turn restored all of it
        greq1 = to_request(ChatCompletionRequest.model_validate(body1))
        calls = tuple(ToolCall(t.id, t.function.name, t.function.arguments)
                      for t in m1.tool_calls)
        history = e.preparer.history_ids(greq1, Message("assistant", m1.content or "",
                                                        None, calls))
        ids2 = e.prepare(to_request(ChatCompletionRequest.model_validate(body2))).prompt_ids
        expect = _shared(ids2[:-1], history)
        assert expect >= len(history) - 1 and len(history) > r1.usage.prompt_tokens
        assert r2.usage.prompt_tokens_details.cached_tokens == expect, (r2.usage, expect)
    finally:
        app.stop()


def test_a_next_turn_sent_at_once_computes_the_history_itself(models):
    # An agent whose tool runs at once sends its next turn within the history prefill's
    # grace: the waiting prefill is dropped (it would only delay the turn by a forward of
    # its own), the turn restores the answer's kept state and computes the rest with its
    # own tokens, and decodes what it decodes cold.
    m = models["hermes"]
    e = Engine(m, m, SpecConfig(k=3))
    e.start()
    try:
        msgs = [Message("system", SYSTEM), Message("user", "Look up 'cat'.")]
        greq = _request(msgs, True, False)
        req = e.prepare(greq)
        got = _run(e, greq, req)
        answer = Message("assistant", got.text, got.reasoning, got.tool_calls)
        assert got.tool_calls
        nxt = _request([*msgs, answer, *(Message("tool", "a small animal", tool_call_id=c.id,
                                                 name=c.name) for c in got.tool_calls)],
                       False, False)
        req2 = e.prepare(nxt)
        assert e.keep_history(greq, answer, req) > 0
        warm = _run(e, nxt, req2)  # at once
        _idle(e)
        st = e.scheduler.stats
        assert (st.history_superseded, st.history_prefills) == (1, 0)
        assert warm.usage.cached_tokens > len(req.prompt_ids)  # the answer's kept state
        e.kv_store.clear()
        assert _run(e, nxt).tokens == warm.tokens  # as cold
    finally:
        e.close()
