"""An agent's tool loop, turn after turn: what each turn computes of its prompt, how soon its
first token comes, and whether the draft's cache came back with the target's.

The loop: a long system prompt and tools, a question, a forced call, its result, an answer,
the next question (call turns force a call with tool_choice "required"; answer turns leave
it "auto"), each turn sending the whole history back, as agents do. It runs on the engine
the server runs (the embedded model, its distilled draft, the shipped settings, started),
with what the server does after each answer (`Engine.keep_history`, the history the next
request starts with prefilled in the background; the bench waits for the engine to be
idle before the next turn, as an agent runs its tool), on three template shapes:

- `plain`: the embedded model's own template (no reasoning; calls in its format);
- `reasoning_dropped`: Qwen3's shape, thinking on: reasoning stays in the history within a
  tool loop and is dropped from every earlier turn once a new question comes;
- `calls_reserialized`: Hermes' shape (Qwen2.5's): a call comes back in the history as
  the template serializes its arguments, not as the model wrote it.

Per shape:
- `agent_loop_computed_over_new_<shape>`: from turn 2 on, prompt positions the turns
  computed over the tokens the client added (the prompt past the earlier conversation as the
  template renders it, read by rendering the client's own messages with the tokenizer's
  template and two different next turns, `new_tokens`); goal: at most 1.1.
- `agent_loop_history_computed_<shape>`: positions the background history prefills computed,
  per turn (the work moved off the next turn's path).
- `agent_loop_ttft_last_over_cold_<shape>`: time to the first event of the last turn over
  the same request cold (the prompt store emptied), both giving the same tokens.
- `agent_loop_draft_cached_<shape>`: of the positions restored from the store, the fraction
  the draft's cache restored too (the rest the draft computed).

Served (`test_agent_loop_served`): the `plain` loop through a real `specdec serve` (the
embedded model, shipped settings), Chat Completions streamed, tools in every request, each
turn sending the whole history back the moment the last one ended (the tool answers at
once), `SERVED_TURNS` turns:
- `agent_loop_served_ttft_over_bound`: turn 8's time to its first delta (at the client)
  over its prefill (`specdec.prefill_s`: the positions it computed, the stored ones
  restored) plus its first round (`specdec.first_round_s`) plus 50 ms; goal: at most 1 (the
  first token costs the new tokens and one round, nothing else).
- `agent_loop_served_last_over_cold`: the last turn's time to its first delta over the same
  request's on a new server (nothing stored), both giving the same answer; goal: at most
  0.1 at turn 20.

And the loop by id: `agent_loop_by_id_over_resend_computed`: the `plain` loop through the
server's Responses API continuing each turn by `previous_response_id`, against the same
loop through Chat Completions resending the whole history (in process, one server): prompt
positions computed over all turns, by id over resend; both arms give the same answers.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from bench import results
from specdec.config import EngineConfig
from specdec.events import Finished, Failed
from specdec.request import GenerateRequest, Message, SamplingParams, Tool, ToolCall

TEMPLATES = Path(__file__).resolve().parent.parent / "tests" / "templates"
SHAPES = {"plain": (None, False), "reasoning_dropped": ("qwen3.jinja", True),
          "calls_reserialized": ("tools_hermes.jinja", False)}
TURNS = results.size(8, 20, smoke=2)
SERVED_TURNS = results.size(20, 20, smoke=3)
BOUND_TURN = 8  # the served turn whose first delta is held to its prefill and one round
MAX_TOKENS = 40
THINKING = 12  # a thinking turn's reasoning budget
SYSTEM = ("You are the operations assistant of a travel agency. You answer travellers' "
          "questions about the weather, flights and hotels. Use the tools for facts; never "
          "invent a number. Keep answers short: one or two sentences. ") * results.size(
              14, 14, smoke=2)
TOOLS = (Tool("get_weather", "The weather now in a city", {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"], "additionalProperties": False}, strict=True),
    Tool("find_flights", "Flights between two cities on a date", {
        "type": "object", "properties": {"origin": {"type": "string", "maxLength": 24},
                                         "destination": {"type": "string", "maxLength": 24},
                                         "date": {"type": "string", "maxLength": 10}},
        "required": ["origin", "destination"], "additionalProperties": False}, strict=True))
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Berlin", "Dakar",
          "Hanoi"]


def _question(i: int) -> str:
    return (f"What is the weather in {CITIES[i % len(CITIES)]} today?" if i % 2 == 0 else
            f"Is there a flight from {CITIES[i % len(CITIES)]} to "
            f"{CITIES[(i + 3) % len(CITIES)]} tomorrow?")


def _result(call: ToolCall) -> str:
    args = json.loads(call.arguments)
    if call.name == "get_weather":
        return json.dumps({"city": args.get("city"), "temperature_c": 18, "sky": "cloudy"})
    return json.dumps({"flights": [{"number": "SD 204", "departs": "09:40"}]})


def _engine(shape: str):
    from specdec.engine import Engine

    name, _ = SHAPES[shape]
    template = (TEMPLATES / name).read_text() if name else None
    e = Engine.load(config=dataclasses.replace(
        EngineConfig(), defaults=dataclasses.replace(EngineConfig().defaults,
                                                     chat_template=template)))
    e.start()
    return e


def _idle(e) -> None:
    """Wait until the engine holds no request (the history prefill done)."""
    sched = e.scheduler
    while sched.active or sched.queue_depth or sched.background:
        time.sleep(0.005)


def _run(e, greq: GenerateRequest, req: Any = None) -> tuple[Finished, float]:
    """Submit (`req`: `greq` prepared), iterate to the end; returns the end and the time to
    the first event (preparing included)."""
    t0 = time.perf_counter()
    first = None
    for ev in e.submit(req if req is not None else e.prepare(greq)):
        if first is None:
            first = time.perf_counter() - t0
        if isinstance(ev, Failed):
            raise ev.error
        if isinstance(ev, Finished):
            return ev, first if first is not None else time.perf_counter() - t0
    raise AssertionError("no end")


def _request(messages: list[Message], calling: bool, thinking: bool) -> GenerateRequest:
    return GenerateRequest(messages=tuple(messages), tools=TOOLS,
                           tool_choice="required" if calling else "auto",
                           max_tokens=MAX_TOKENS, sampling=SamplingParams(),
                           thinking=thinking, thinking_budget=THINKING if thinking else None)


def new_tokens(e, greq: GenerateRequest, prompt: int) -> int:
    """The tokens of a `prompt`-token request past its earlier conversation as the engine
    renders it: the client's messages up to its last assistant turn rendered (as the server
    renders a request) with two next turns that differ only in their text; their common
    prefix is the earlier conversation, the rest of the prompt is new."""
    msgs = list(greq.messages)
    last = max(i for i, m in enumerate(msgs) if m.role == "assistant")
    kind = msgs[last + 1]

    def render(text: str) -> list[int]:
        nxt = dataclasses.replace(kind, content=text)
        return e.preparer._render(dataclasses.replace(greq, messages=(*msgs[:last + 1], nxt)),
                                  e.preparer._tools(greq))[0]

    a, b = render("0"), render("1")
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return prompt - n


def _loop(e, shape: str) -> dict[str, Any]:
    """The tool loop, `TURNS` requests; per turn its usage, first-event time and the history
    prefill's computed positions."""
    _, thinking = SHAPES[shape]
    msgs = [Message("system", SYSTEM), Message("user", _question(0))]
    turns, q = [], 1
    for n in range(TURNS):
        calling = msgs[-1].role == "user"
        greq = _request(msgs, calling, thinking)
        before = e.scheduler.stats.history_computed
        t0 = time.perf_counter()
        req = e.prepare(greq)
        prep = time.perf_counter() - t0
        end, first = _run(e, greq, req)
        first += prep  # (as the cold run's, which prepares in `_run`)
        answer = Message("assistant", end.text, end.reasoning, end.tool_calls)
        e.keep_history(greq, answer, req)  # what the server does after an answer
        _idle(e)
        c = end.stats.counters
        turns.append({"prompt": end.usage.prompt_tokens, "cached": end.usage.cached_tokens,
                      "draft_cached": c.draft_cached, "first_s": first, "greq": greq,
                      "tokens": end.tokens,
                      "history": e.scheduler.stats.history_computed - before})
        msgs.append(answer)
        if end.tool_calls:
            msgs += [Message("tool", _result(c), tool_call_id=c.id, name=c.name)
                     for c in end.tool_calls]
        else:
            msgs.append(Message("user", _question(q)))
            q += 1
    for t in turns[1:]:
        t["new"] = new_tokens(e, t["greq"], t["prompt"])
    return {"turns": turns}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_agent_loop(benchmark, shape):
    e = _engine(shape)
    try:
        out = benchmark.pedantic(lambda: _loop(e, shape), rounds=1, iterations=1)
        turns = out["turns"]
        later = turns[1:]
        computed = sum(t["prompt"] - t["cached"] for t in later)
        new = sum(t["new"] for t in later)
        worst = max((t["prompt"] - t["cached"]) / max(t["new"], 1) for t in later)
        # The last turn again, cold: the store emptied, the same request.
        last = turns[-1]
        e.kv_store.clear()
        cold, cold_first = _run(e, last["greq"])
        assert cold.tokens == last["tokens"], "the last turn cold gave other tokens"
        restored = sum(t["cached"] for t in later)
        per_turn = " ".join(f"{t['prompt'] - t['cached']}/{t['new']}" for t in later)
        note = (f"{TURNS} turns, the embedded model and its draft as served, the {shape} "
                f"template; first prompt {turns[0]['prompt']} tokens (system prompt, tools, "
                f"question); turns 2-{TURNS}: {computed} positions computed for {new} new "
                f"tokens (computed/new per turn: {per_turn}; worst {worst:.2f}); last turn "
                f"{last['prompt']} tokens")
        results.add(f"agent_loop_computed_over_new_{shape}", computed / max(new, 1), "ratio",
                    note)
        results.add(f"agent_loop_history_computed_{shape}",
                    statistics.mean(t["history"] for t in turns), "tokens",
                    "positions each turn's background history prefill computed (mean)")
        results.add(f"agent_loop_ttft_last_over_cold_{shape}", last["first_s"] / cold_first,
                    "ratio", f"last turn {last['first_s'] * 1e3:.0f} ms warm, "
                             f"{cold_first * 1e3:.0f} ms cold; same tokens")
        results.add(f"agent_loop_draft_cached_{shape}",
                    sum(t["draft_cached"] for t in later) / max(restored, 1), "fraction",
                    f"of {restored} positions restored over turns 2-{TURNS}")
    finally:
        e.close()


def chat_tools() -> list[dict[str, Any]]:
    """`TOOLS` as Chat Completions spells them."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": dict(t.parameters)}}
            for t in TOOLS]


@dataclasses.dataclass
class Turn:
    """One streamed turn as the client saw it: time to its first delta (text or a call),
    to its end, its text, calls ({id, name, arguments}) and the `specdec` extension."""

    first_s: float
    total_s: float
    text: str
    calls: list[dict[str, str]]
    ext: dict[str, Any]

    def message(self) -> dict[str, Any]:
        """The assistant message the client sends back."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.text or None}
        if self.calls:
            msg["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                "name": c["name"], "arguments": c["arguments"]}} for c in self.calls]
        return msg

    def answer(self) -> list[Any]:
        return [self.text, [(c["name"], c["arguments"]) for c in self.calls]]


def stream_turn(client: Any, msgs: list[dict[str, Any]], tools: list[dict[str, Any]]
                ) -> Turn:
    """One turn of the loop through Chat Completions, streamed: a call is required where
    the last message is the user's, else "auto"."""
    calling = msgs[-1]["role"] == "user"
    t0 = time.perf_counter()
    first, text, calls, ext = None, "", {}, {}
    stream = client.chat.completions.create(
        model="default", messages=msgs, tools=tools, temperature=0, max_tokens=MAX_TOKENS,
        tool_choice="required" if calling else "auto", stream=True,
        stream_options={"include_usage": True})
    for chunk in stream:
        ext = (chunk.model_extra or {}).get("specdec") or ext
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        if first is None and (d.content or d.tool_calls):
            first = time.perf_counter() - t0
        text += d.content or ""
        for tc in d.tool_calls or []:
            got = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            got["id"] = tc.id or got["id"]
            if tc.function is not None:
                got["name"] += tc.function.name or ""
                got["arguments"] += tc.function.arguments or ""
    total = time.perf_counter() - t0
    return Turn(first if first is not None else total, total, text,
                [calls[i] for i in sorted(calls)], ext)


def next_messages(msgs: list[dict[str, Any]], turn: Turn, q: int) -> int:
    """Append the turn's answer and what the client sends next (its calls' results, or
    the next question, `q`); returns the next question's number."""
    msgs.append(turn.message())
    for c in turn.calls:
        msgs.append({"role": "tool", "tool_call_id": c["id"],
                     "content": _result(ToolCall(c["id"], c["name"], c["arguments"]))})
    if not turn.calls:
        msgs.append({"role": "user", "content": _question(q)})
        q += 1
    return q


def test_agent_loop_served(benchmark):
    """The `plain` loop through a real server, streamed: the bound turn's first delta
    against its prefill and first round; the last turn against itself cold."""
    import openai

    from tests.serverproc import Server

    tools = chat_tools()
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": _question(0)}]

    def loop() -> tuple[list[Turn], list[dict[str, Any]]]:
        srv = Server()
        try:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
            turns, q, sent = [], 1, []
            for _ in range(SERVED_TURNS):
                sent = list(msgs)
                turns.append(stream_turn(client, msgs, tools))
                q = next_messages(msgs, turns[-1], q)
            return turns, sent
        finally:
            srv.stop()

    turns, last_sent = benchmark.pedantic(loop, rounds=1, iterations=1)
    srv = Server()  # the last turn cold: a new server, nothing stored
    try:
        cold = stream_turn(openai.OpenAI(base_url=srv.url + "/v1", api_key="x",
                                         max_retries=0), last_sent, tools)
    finally:
        srv.stop()
    last = turns[-1]
    assert cold.answer() == last.answer(), "the last turn cold gave another answer"
    at = min(BOUND_TURN, len(turns)) - 1
    b = turns[at]
    bound = b.ext["prefill_s"] + b.ext["first_round_s"] + 0.05
    rounds = [t.ext["decode_s"] / max(t.ext["rounds"], 1) for t in turns[1:]]
    per_turn = " ".join(
        f"{t.first_s * 1e3:.0f}/{(t.ext['prefill_s'] + t.ext['first_round_s']) * 1e3:.0f}"
        for t in turns[1:])
    results.add("agent_loop_served_ttft_over_bound", b.first_s / bound, "ratio",
                f"turn {at + 1} of a {len(turns)}-turn tool loop through `specdec serve`, "
                f"Chat Completions streamed: first delta {b.first_s * 1e3:.0f} ms at the "
                f"client; prefill {b.ext['prefill_s'] * 1e3:.0f} ms ({b.ext['rounds']} "
                f"rounds), first round {b.ext['first_round_s'] * 1e3:.0f} ms (mean round of "
                f"turns 2+ {statistics.mean(rounds) * 1e3:.0f} ms); bound = prefill + first "
                f"round + 50 ms; first delta/prefill+first round per turn (ms): {per_turn}")
    results.add("agent_loop_served_last_over_cold", last.first_s / cold.first_s, "ratio",
                f"turn {len(turns)}: first delta {last.first_s * 1e3:.0f} ms warm, "
                f"{cold.first_s * 1e3:.0f} ms on a new server (prefill "
                f"{cold.ext['prefill_s'] * 1e3:.0f} ms); the same answer")


def test_agent_loop_by_id_over_resend(benchmark):
    """The `plain` loop through the server: Responses continuing by id vs Chat resending."""
    from server.app import create_app
    from server.door import ServeConfig
    from specdec.engine import Engine
    from tests.serverproc import InProcess

    e = Engine.load()
    asgi = create_app(e, ServeConfig())
    app = InProcess(asgi, e)
    client = app.client()
    tools_chat = chat_tools()
    tools_resp = [{"type": "function", "name": t.name, "description": t.description,
                   "parameters": dict(t.parameters), "strict": False} for t in TOOLS]
    n = results.size(6, 12, smoke=2)

    def settle() -> None:  # the history prefill queued (in the background) and done
        while asgi.state.door.prepares.pending:
            time.sleep(0.005)
        _idle(e)

    def by_resend() -> tuple[list[str], list[int], int]:
        msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": _question(0)}]
        outs, computed, prompt, q = [], [], 0, 1
        for _ in range(n):
            calling = msgs[-1]["role"] == "user"
            r = client.chat.completions.create(
                model="default", messages=msgs, tools=tools_chat, temperature=0,
                max_tokens=MAX_TOKENS, tool_choice="required" if calling else "auto")
            settle()
            m = r.choices[0].message
            computed.append(r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens)
            prompt += r.usage.prompt_tokens
            msgs.append(m.model_dump(exclude_none=True))
            outs.append(json.dumps([m.content or "", [(c.function.name, c.function.arguments)
                                                      for c in m.tool_calls or []]]))
            for c in m.tool_calls or []:
                msgs.append({"role": "tool", "tool_call_id": c.id, "content": _result(
                    ToolCall(c.id, c.function.name, c.function.arguments))})
            if not m.tool_calls:
                msgs.append({"role": "user", "content": _question(q)})
                q += 1
        return outs, computed, prompt

    def by_id() -> tuple[list[str], list[int], int]:
        prev, items = None, [{"role": "user", "content": _question(0)}]
        outs, computed, prompt, q = [], [], 0, 1
        for _ in range(n):
            calling = items[-1].get("role") == "user"
            r = client.responses.create(
                model="default", input=items if prev else [{"role": "system", "content": SYSTEM}, *items],
                previous_response_id=prev, tools=tools_resp, temperature=0,
                max_output_tokens=MAX_TOKENS, tool_choice="required" if calling else "auto")
            settle()
            prev = r.id
            computed.append(r.usage.input_tokens - r.usage.input_tokens_details.cached_tokens)
            prompt += r.usage.input_tokens
            calls = [o for o in r.output if o.type == "function_call"]
            text = "".join(c.text for o in r.output if o.type == "message" for c in o.content)
            outs.append(json.dumps([text, [(c.name, c.arguments) for c in calls]]))
            items = [{"type": "function_call_output", "call_id": c.call_id,
                      "output": _result(ToolCall(c.call_id, c.name, c.arguments))}
                     for c in calls]
            if not calls:
                items = [{"role": "user", "content": _question(q)}]
                q += 1
        return outs, computed, prompt

    try:
        def both():
            e.kv_store.clear()
            a = by_resend()
            e.kv_store.clear()
            return a, by_id()
        (ra, rc, rp), (ia, ic, ip) = benchmark.pedantic(both, rounds=1, iterations=1)
        assert ia == ra, "by id and by resend gave other answers"
        results.add("agent_loop_by_id_over_resend_computed", sum(ic) / max(sum(rc), 1),
                    "ratio", f"{n} turns of the plain loop through the server (in process): "
                    f"by id {sum(ic)} of {ip} prompt positions computed (per turn {ic}), "
                    f"resending the history {sum(rc)} of {rp} ({rc}); the same answers")
    finally:
        app.stop()
