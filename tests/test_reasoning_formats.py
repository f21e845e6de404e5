"""Every reasoning protocol (specdec/reasoning.py), each read from a template of its family's
shape written here (tests/templates/), on a small random-weight model with that family's
tokenizer: OpenAI Harmony (gpt-oss: the analysis channel, `<|end|>`, then the final
channel's header), Gemma 4's thought channel (`<|channel>thought` ... `<channel|>`) and
Seed-OSS's think tags (`<seed:think>` ... `</seed:think>`). In each the output opens the
reasoning and may answer at once instead.

Per format: the protocol `render_thinking` reads from the rendered template; plain decoding
equals the oracle (which applies the budget rule itself) and every proposer cell and the same
request inside a batch equal plain, greedy and seeded, on the reference BLAS, with the
reasoning ended by the model, by the budget mid-thought, by the budget at once, or skipped;
every answer validates (the budget rule ends the reasoning in time). A budget spent
inside the reasoning still ends in a valid answer; opted out of the rule, in an empty answer
and "length". Without thinking, a constrained prompt ends with the format's own answer
header (Harmony's final channel), checked on the prompt and output bytes. The answer may hold
the format's markers inside a JSON string.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest

from oracle import BudgetOracle, ThinkingRule, reference_decode
from specdec import blas
from specdec.engine import Engine
from specdec.grammar import Constraint
from specdec.models import load
from specdec.reasoning import Thinking, marker_ids, split_reasoning
from tests import tally
from tests.exactness import MODES, cells_vs
from tests.families import make_family
from tests.test_families import CELLS
from tests.test_reasoning import MESSAGES, NATURAL_BIASES, SCHEMA

TEMPLATES = Path(__file__).parent / "templates"
MAX_TOKENS = 60
# format -> (tokenizer kind, template, end-of-generation tokens, the protocol it reads)
FORMATS = {
    "harmony": ("harmony", "tools_harmony.jinja", ("<|return|>", "<|endoftext|>", "<|call|>"),
                Thinking(close="<|end|>", open="<|channel|>analysis<|message|>",
                         header="<|start|>assistant<|channel|>final<|message|>",
                         direct="<|channel|>final<|message|>", name="harmony")),
    "gemma": ("gemma4", "gemma4_style.jinja", ("<turn|>", "<eos>"),
              Thinking(close="<channel|>", open="<|channel>thought", header="", direct="",
                       name="gemma")),
    "seed": ("seed-oss", "seed_oss_style.jinja", ("<seed:eos>",),
             Thinking(close="</seed:think>", open="<seed:think>", header="", direct="")),
}
# how reasoning ends -> budget (the natural end searches a bias on the end marker)
ENDS = {"at-once": 0, "budget": 7, "natural": 40, "skipped": 40}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, (kind, template, eos, _) in FORMATS.items():
        # A Qwen 3 model with a flat head (the reasoning text varies) under the family's
        # tokenizer and template: the format is the tokenizer's and the template's.
        d = make_family("qwen3", tmp_path_factory.mktemp("formats") / name, scale=1.0,
                        template=(TEMPLATES / template).read_text(), tokenizer=kind, eos=eos)
        target = load(str(d))
        engines = {"self": Engine(target, target), "none": Engine(target, None)}
        engines["self"].compiler = engines["none"].compiler
        engines["self"].kv_store = engines["none"].kv_store
        out[name] = (target, engines)
    return out


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_protocol_is_read_from_the_rendered_template(models, fmt):
    _, engines = models[fmt]
    _, thinking = engines["none"].chat_prompt_thinking(MESSAGES, budget=3, optional=True)
    assert thinking == dataclasses.replace(FORMATS[fmt][3], budget=3)
    _, asked = engines["none"].chat_prompt_thinking(MESSAGES, budget=3)  # it must reason
    assert asked == dataclasses.replace(FORMATS[fmt][3], budget=3, direct=None)


def _choice_tokens(e: Engine, thinking: Thinking) -> tuple[int, int | None]:
    """The first tokens where opening the reasoning and answering at once part: the open
    marker's, and the direct header's (None where the direct branch has no header)."""
    tk = e.target.tokenizer  # the model's own tokenization of the markers
    o = tk.encode(thinking.open, add_special_tokens=False)
    d = tk.encode(thinking.direct or "", add_special_tokens=False)
    at = next(i for i, a in enumerate(o) if i >= len(d) or d[i] != a)
    return o[at], d[at] if at < len(d) else None


def _choice_token(e: Engine, thinking: Thinking) -> int:
    return _choice_tokens(e, thinking)[0]


def _text(target, tokens) -> str:
    return target.tokenizer.decode(list(tokens), skip_special_tokens=False)


def _rule(target, thinking: Thinking, close_ids) -> ThinkingRule:
    """The budget rule as the oracle reads it, from the output's text."""
    def opened(toks):
        return next((i + 1 for i in range(len(toks))
                     if _text(target, toks[:i + 1]).startswith(thinking.open)), None)

    return ThinkingRule(thinking.budget, close_ids,
                        lambda toks: thinking.close in _text(target, toks)[len(thinking.open):],
                        opened)


def _in_batch(e: Engine, req, neighbours) -> object:
    """The request decoded among neighbours (submitted first, still decoding)."""
    streams = [e.submit(n) for n in neighbours]
    got = e.generate(req)
    for s in streams:
        for _ in s:
            pass
    return got


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_plain_equals_oracle_and_every_cell_equals_plain_across_the_end_of_reasoning(
        models, fmt):
    assert blas.active() == "reference"
    target, engines = models[fmt]
    e = engines["none"]
    constraint = Constraint.json_schema(SCHEMA)
    neighbours = [e.prepare(e.chat_prompt([{"role": "user", "content": p}], constrained=False),
                            max_tokens=24, sampling=MODES["seeded"])
                  for p in ("Count to five.", "A city as JSON.")]
    bad: list[str] = []
    seen: set[str] = set()
    for end, budget in ENDS.items():
        ids, thinking = e.chat_prompt_thinking(MESSAGES, budget=budget,
                                               optional=end == "skipped")
        close_ids, special = marker_ids(e.compiler.markup, thinking.close)
        assert special and len(close_ids) == 1  # one token: a natural end can be biased to
        opener = len(e.target.tokenizer.encode(thinking.open, add_special_tokens=False))
        choice, direct = _choice_tokens(e, thinking)

        def natural(n: int, thought: bool = True) -> bool:
            return opener + 1 - (not thought) < n < opener + budget

        def fits(n: int, text: str, thought: bool = True) -> bool:
            if end == "skipped":
                return n == 0 and not text.startswith(thinking.open)
            if not text.startswith(thinking.open):
                return False
            # (the budget's end marker waits for a character the budget cut: up to 3 more
            # tokens of a byte-level vocabulary; where it comes is the oracle's to check)
            return {"at-once": n == opener + 1,
                    "budget": opener + budget + 1 <= n <= opener + budget + 4,
                    "natural": natural(n, thought)}[end]

        for mode, base in MODES.items():
            tried = []
            for ob in (-100.0,) if end == "skipped" else (0.0, 2.0, 4.0, 8.0, 16.0):
                # (skipped: the direct header's own token raised too, where it has one: the
                # open marker's text may be spelled with other tokens)
                db = 100.0 if end == "skipped" and direct is not None else 0.0
                for cb in NATURAL_BIASES if end == "natural" else (0.0, -4.0, -16.0):
                    params = dataclasses.replace(base, logit_bias=tuple(
                        (t, x) for t, x in ((close_ids[0], cb), (choice, ob), (direct, db))
                        if x))
                    want = e.generate(e.prepare(ids, constraint=constraint, sampling=params,
                                                max_tokens=MAX_TOKENS, spec=None,
                                                thinking=thinking))
                    n = e.reasoning_tokens(want.tokens, thinking)
                    tried.append((n, params, want))
                    if fits(n, _text(target, want.tokens)):
                        break
                if fits(tried[-1][0], _text(target, tried[-1][2].tokens)):
                    break
            else:
                tried = [x for x in tried if fits(x[0], _text(target, x[2].tokens), False)]
            assert tried, f"{end} {mode}: no bias gives this end"
            n, params, want = tried[-1]
            seen.add(end)
            g = e.compiled(e.prepare(ids, constraint=constraint, thinking=thinking))
            ref = reference_decode(target.model, ids, vocab_size=target.vocab_size,
                                   eos_token_ids=target.eos_token_ids, max_tokens=MAX_TOKENS,
                                   matcher=g.matcher(), temperature=params.temperature,
                                   top_k=params.top_k, top_p=params.top_p,
                                   seed=params.seed or 0, logit_bias=params.logit_bias,
                                   thinking=_rule(target, thinking, close_ids),
                                   budget=BudgetOracle.of(e.compiler.tokenizer,
                                                          target.vocab_size,
                                                          target.eos_token_ids, MAX_TOKENS))
            same = list(want.tokens) == list(ref.tokens)
            tally.record(f"reasoning formats: plain vs oracle ({fmt})", same)
            if not same:
                bad.append(f"{end} {mode}: plain {want.tokens} != oracle {ref.tokens}")
            reasoning, answer = split_reasoning(_text(target, want.tokens), thinking)
            assert answer is not None and want.reasoning == reasoning, (end, want.text)
            assert thinking.close not in reasoning and want.text == answer
            jsonschema.validate(json.loads(answer), SCHEMA)  # in time: the budget rule
            bad += cells_vs(engines, CELLS, want, f"reasoning formats: spec cells vs plain "
                            f"({fmt})", f"{end} {mode}", ids, constraint=constraint,
                            sampling=params, max_tokens=MAX_TOKENS, thinking=thinking)[0]
            got = _in_batch(e, e.prepare(ids, constraint=constraint, sampling=params,
                                         max_tokens=MAX_TOKENS, spec=None, thinking=thinking),
                            neighbours)
            same = (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason)
            tally.record(f"reasoning formats: needle in a batch vs plain ({fmt})", same)
            if not same:
                bad.append(f"{end} {mode} in a batch: {got.tokens} != {want.tokens}")
    assert not bad, "\n".join(bad)
    assert seen == set(ENDS)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_budget_spent_in_the_reasoning_still_ends_in_a_valid_answer(models, fmt):
    """No thinking budget, the output opening its reasoning and a token budget a little
    above the constraint's minimum (room for the think markup): the budget rule ends the
    reasoning in time and the answer validates ("length": the budget forced the close), by every engine alike. Opted
    out (`close_at_budget=False`), the budget runs out inside the reasoning: an empty answer
    and "length"."""
    target, engines = models[fmt]
    e = engines["none"]
    ids, thinking = e.chat_prompt_thinking(MESSAGES, budget=None)
    choice = _choice_token(e, thinking)
    constraint = Constraint.json_schema(SCHEMA)
    sampling = dataclasses.replace(MODES["seeded"], logit_bias=((choice, 16.0),))
    minimum = e.prepare(ids, constraint=constraint, max_tokens=MAX_TOKENS,
                        thinking=thinking).closing.minimum
    want = None
    for eng in engines.values():
        spec = None if eng is e else "default"
        got = eng.generate(eng.prepare(ids, constraint=constraint, max_tokens=minimum + 16,
                                       sampling=sampling, thinking=thinking, spec=spec))
        assert _text(target, got.tokens).startswith(thinking.open)
        assert got.finish_reason == "length" and got.stats.counters.budget_steered, got
        jsonschema.validate(json.loads(got.text), SCHEMA)
        assert want is None or got.tokens == want.tokens
        want = got
        cut = eng.generate(eng.prepare(ids, constraint=constraint, max_tokens=12,
                                       sampling=sampling, thinking=thinking, spec=spec,
                                       close_at_budget=False))
        assert cut.finish_reason == "length" and cut.text == "", cut
        assert _text(target, cut.tokens).startswith(thinking.open)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_without_thinking_the_answer_begins_with_the_formats_header(models, fmt):
    """The prompt and output bytes: the answer header where the format has one (Harmony's
    final channel), then the answer; no reasoning markers in between."""
    target, engines = models[fmt]
    e = engines["none"]
    ids = e.chat_prompt(MESSAGES, constrained=True)
    prompt = _text(target, ids)
    got = e.generate(e.prepare(ids, constraint=Constraint.json_schema(SCHEMA), max_tokens=40,
                               spec=None))
    whole = prompt + _text(target, got.tokens)
    turn = {"harmony": "<|start|>assistant<|channel|>final<|message|>",
            "gemma": "<|turn>model\n", "seed": "<seed:bos>assistant\n"}[fmt]
    assert prompt.endswith(turn), prompt[-80:]
    assert whole == prompt + got.text and got.reasoning is None
    assert got.finish_reason == "stop", got
    jsonschema.validate(json.loads(got.text), SCHEMA)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_answer_may_hold_the_formats_markers_inside_a_json_string(models, fmt):
    target, engines = models[fmt]
    e = engines["none"]
    _, thinking = e.chat_prompt_thinking(MESSAGES, budget=4)
    note = f"{thinking.open} and {thinking.close}"
    schema = {"type": "object", "properties": {"note": {"const": note}}, "required": ["note"],
              "additionalProperties": False}
    ids, thinking = e.chat_prompt_thinking(MESSAGES, budget=4, optional=True)
    choice, direct = _choice_tokens(e, thinking)
    # Reasoning first, then (where reasoning is optional) an answer straight away (towards the direct header's token where
    # it has one: the open marker's text could be spelled otherwise).
    for thought, bias in ((True, (choice, 16.0)),
                          (False, (choice, -100.0) if direct is None else (direct, 16.0))):
        got = e.generate(e.prepare(
            ids, constraint=Constraint.json_schema(schema), max_tokens=80,
            sampling=dataclasses.replace(MODES["greedy"], logit_bias=(bias,)),
            thinking=thinking, spec=None))
        assert got.finish_reason == "stop", got
        assert json.loads(got.text) == {"note": note}, got.text
        assert note not in got.reasoning and (got.reasoning != "") == thought, got.reasoning


def test_protocols_are_read_from_rendered_text_not_template_source():
    from specdec.reasoning import find_protocol

    # A suffixed tag: its close repeats the suffix; Seed-OSS's tag; the older spellings.
    assert (find_protocol("<|im_start|>assistant\n<think:v2>\n").close) == "</think:v2>"
    assert find_protocol("x<seed:think>y").close == "</seed:think>"
    assert find_protocol("a <|begin_of_thought|>").close == "<|end_of_thought|>"
    # The first marker written wins; channel formats before tags.
    assert find_protocol("<|channel|>final<|message|>hi<think>").name == "harmony"
    assert find_protocol("<|turn>model\n<|channel>thought\n").name == "gemma"
    assert find_protocol("no markers here") is None


def test_an_always_thinking_template_thinks_then_answers_unasked(tmp_path):
    """MiniMax's shape: the generation prompt always opens the think block; a comment names
    enable_thinking, which the template does not read. A constrained prompt alone cannot be
    rendered (the error says there is no switch); a constrained request that does not ask
    for thinking is served: it thinks, within the default thinking budget, then answers
    under the constraint."""
    from specdec.chat import TemplateThinksError
    from specdec.request import GenerateRequest, Message

    template = ("{#- enable_thinking is not read by this template -#}"
                "{%- for m in messages %}{{ ']~b]' + m.role + '\\n' + m.content + '[e~[\\n' }}"
                "{%- endfor %}{%- if add_generation_prompt %}{{ ']~b]ai\\n<think>\\n' }}"
                "{%- endif %}")
    d = make_family("qwen3", tmp_path / "minimax", think=True, scale=1.0, template=template)
    e = Engine(load(str(d)), None)
    with pytest.raises(TemplateThinksError, match="has no switch"):
        e.chat_prompt(MESSAGES, constrained=True)
    _, thinking = e.chat_prompt_thinking(MESSAGES)  # asking for it works: the prompt opened it
    assert thinking.open is None and thinking.close == "</think>"
    req = e.prepare(GenerateRequest(messages=(Message("user", MESSAGES[0]["content"]),),
                                    constraint=Constraint.json_schema(SCHEMA), max_tokens=60))
    assert req.thinking is not None and req.thinking.open is None
    assert req.thinking.budget == min(e.defaults.max_thinking_tokens, 30)
    got = e.generate(req)
    assert got.reasoning is not None and "</think>" not in got.text
    jsonschema.validate(json.loads(got.text), SCHEMA)


def test_reasoning_effort_and_the_budget_reach_the_template(models):
    from specdec.request import GenerateRequest, Message

    e = models["harmony"][1]["none"]
    req = e.prepare(GenerateRequest(messages=(Message("user", MESSAGES[0]["content"]),),
                                    reasoning_effort="low", thinking=True, max_tokens=20))
    assert "Reasoning: low" in _text(models["harmony"][0], req.prompt_ids)
    s = models["seed"][1]["none"]
    req = s.prepare(GenerateRequest(messages=(Message("user", MESSAGES[0]["content"]),),
                                    thinking=True, thinking_budget=5, max_tokens=20))
    assert "thinking budget is 5 tokens" in _text(models["seed"][0], req.prompt_ids)


def test_a_harmony_call_after_the_analysis_is_a_commentary_message_the_template_renders(
        models):
    """Tools with thinking on Harmony: after the analysis (`<|end|><|start|>assistant`) the
    tool grammar chooses the channel, a call's commentary header or the final channel's
    text. A call forced after reasoning is parsed, valid, the same with speculation, and
    byte for byte what the template renders for the assistant turn with that reasoning and
    call; the next turn renders both back; "auto" pushed to the final channel answers text."""
    from specdec.prepare import tool_schema
    from specdec.request import GenerateRequest, Message, Tool

    target, engines = models["harmony"]
    e = engines["none"]
    tool = Tool("get_weather", "Weather.", {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False})
    ask = (Message("user", "Weather in Paris?"),)
    fmt = e.tool_format()
    tk = target.tokenizer
    o = tk.encode(FORMATS["harmony"][3].open, add_special_tokens=False)
    c = tk.encode(fmt.first, add_special_tokens=False)
    think = next(a for a, b in zip(o, c) if a != b)  # where analysis and commentary part
    for budget in (5, 0):
        req = GenerateRequest(messages=ask, tools=(tool,), tool_choice="required",
                              thinking=True, thinking_budget=budget, max_tokens=120,
                              sampling=dataclasses.replace(MODES["greedy"],
                                                           logit_bias=((think, 16.0),)))
        plain = e.generate(e.prepare(dataclasses.replace(req, spec=None)))
        assert plain.finish_reason == "tool_calls" and len(plain.tool_calls) == 1, plain
        assert plain.text == "" and plain.usage.reasoning_tokens >= budget
        assert (plain.reasoning != "") == (budget > 0)
        call = plain.tool_calls[0]
        jsonschema.validate(json.loads(call.arguments), dict(tool.parameters))
        spec = engines["self"].generate(engines["self"].prepare(req))
        assert spec.tokens == plain.tokens
        # the template's rendering of this assistant turn: its analysis, then the call
        turn = Message("assistant", "", reasoning=plain.reasoning, tool_calls=(call,))
        schemas = [tool_schema(tool)]
        head = tk.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}],
                                      tools=schemas, tokenize=False,
                                      add_generation_prompt=True)
        from specdec.prepare import template_message

        full = tk.apply_chat_template([{"role": "user", "content": "Weather in Paris?"},
                                       template_message(turn, 1, fmt)], tools=schemas,
                                      tokenize=False, add_generation_prompt=False)
        written = _text(target, plain.tokens).removesuffix("<|call|>")
        if budget == 0:  # an analysis with no text renders as none: nothing to compare
            assert written.startswith("<|channel|>analysis<|message|><|end|>")
        else:
            assert full.startswith(head) and full[len(head):].startswith(written), (
                full[len(head):], written)
            nxt = e.prepare(GenerateRequest(messages=ask + (turn, Message(
                "tool", '{"temp": 21}', tool_call_id=call.id, name=call.name)),
                tools=(tool,), max_tokens=8, close_at_budget=False))  # (its prompt is read)
            assert "<|start|>assistant" + written in _text(target, nxt.prompt_ids)
    # "auto" pushed towards the final channel after the analysis: a text answer
    final = next(a for a, b in zip(tk.encode("<|channel|>final", add_special_tokens=False),
                                   c) if a != b)
    got = e.generate(e.prepare(GenerateRequest(
        messages=ask, tools=(tool,), thinking=True, thinking_budget=4, max_tokens=40,
        spec=None, sampling=dataclasses.replace(MODES["greedy"], logit_bias=(
            (think, 32.0), (final, 16.0))))))
    assert not got.tool_calls and got.reasoning and got.text, got


def test_reasoning_sent_back_in_the_history_reaches_the_template_from_every_api(models):
    """An assistant turn's reasoning before its call, as each API sends it back (chat's
    `reasoning_content` or `reasoning`, a Responses reasoning item, a Messages thinking
    block), renders through the template (Harmony keeps the analysis before a call)."""
    from server.chat_wire import ChatCompletionRequest
    from server.messages import conversation
    from server.messages_wire import MessagesBody
    from server.chat import messages_of
    from server.responses import messages as responses_messages
    from server.responses_wire import ResponsesRequest
    from specdec.request import GenerateRequest, Tool

    target, engines = models["harmony"]
    e = engines["none"]
    tool = Tool("get_weather", "Weather.", {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]})
    thought = "They want Paris weather."
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chat = [ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, key: thought, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
        for key in ("reasoning_content", "reasoning")]
    resp = ResponsesRequest.model_validate({"model": "m", "input": [
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": thought}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]})
    msgs = MessagesBody.model_validate({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": thought, "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "sunny"}]}]})
    histories = [messages_of(b) for b in chat] + [responses_messages(resp), conversation(msgs)]
    for turns in histories:
        assert [m.reasoning for m in turns if m.role == "assistant"] == [thought]
        req = e.prepare(GenerateRequest(messages=turns, tools=(tool,), max_tokens=8,
                                        close_at_budget=False))  # (its prompt is read)
        prompt = _text(target, req.prompt_ids)
        assert f"<|channel|>analysis<|message|>{thought}<|end|><|start|>assistant<|channel|>" \
               f"commentary to=functions.get_weather" in prompt, prompt
