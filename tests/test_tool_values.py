"""Where a raw argument value ends, and call ids the model writes (`specdec.tools`).

- In the formats that write each argument as an element (Qwen3-Coder's
  `<parameter=k>\\nv\\n</parameter>`, GLM's `<arg_key>k</arg_key><arg_value>v</arg_value>`), a
  raw (string) value ends at its first closing tag, with or without the whitespace the
  template puts around the tag: the grammar lets nothing else follow it than the next
  argument or the end of the call, and the reader gives the value stripped as the family's
  own parser (vLLM's qwen3_coder, glm4_moe) strips it, streamed or not. Through the tiny
  models of both formats, a forced call whose values are free text is made, its values end
  at their tags, plainly decoded it equals the oracle, and the next turn renders it.
- Ids the model writes (Mistral's nine characters) are unique within an answer: a repeated
  one is replaced by one derived from it, the same in a stream's deltas and in the final
  message, through the real server and the OpenAI client; the next turn renders the calls
  and their results with those ids.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from llguidance import LLMatcher

from specdec import blas
from specdec.engine import Engine
from specdec.events import ToolCallDelta
from specdec.models import load
from specdec.request import GenerateRequest, Message, Tool, ToolCall
from specdec.sampling import SamplingParams
from specdec.tools import CallParser, ToolFormat, XmlParams
from tests import tally
from tests.families import make_tool_family
from tests.test_tools import ASK, CLOCK, WEATHER, _shared, marker_bias, oracle_tokens, run_text

NOTE = Tool("take_note", "Write a note down.", {
    "type": "object", "properties": {"text": {"type": "string"}, "topic": {"type": "string"}},
    "required": ["text", "topic"]})
STRINGS = {"take_note": frozenset({"text", "topic"})}

# What `detect` reads off tests/templates/tools_qwen3_coder.jinja and tools_glm.jinja
# (checked below against the tiny models' templates).
QWEN3_CODER = ToolFormat(
    "template", "", "<tool_call>\n<function=", "\n\n<tool_call>\n<function=", ">\n",
    "</function>\n</tool_call>\n<tool_call>\n<function=", "</function>\n</tool_call>",
    "<tool_call>", xml=XmlParams("<parameter=", ">\n", "\n</parameter>\n<parameter=",
                                 "\n</parameter>\n", ""))
GLM = ToolFormat(
    "template", "\n", "\n<tool_call>", "\n<tool_call>", "\n", "</tool_call>\n<tool_call>",
    "</tool_call>", "\n<tool_call>", xml=XmlParams("<arg_key>", "</arg_key>\n<arg_value>",
                                                   "</arg_value>\n<arg_key>",
                                                   "</arg_value>\n", ""))
FORMATS = {"qwen3_coder": QWEN3_CODER, "glm": GLM}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-values")
    made: dict[str, Engine] = {}

    def get(key: str) -> Engine:
        if key not in made:
            made[key] = Engine(load(str(make_tool_family(key, root / key))))
        return made[key]
    yield get
    for e in made.values():
        e.close()


def opened(fmt: ToolFormat) -> str:
    """A take_note call up to its first value."""
    assert fmt.xml is not None
    return fmt.first + "take_note" + fmt.name_end + fmt.xml.first + "text" + fmt.xml.mid


# (format, what the model writes after `opened`, the arguments read, or None: the grammar
# refuses it, at the text after the first closing tag)
CASES = [
    ("qwen3_coder", "Paris\n</parameter>\n<parameter=topic>\nx\n</parameter>\n</function>"
     "\n</tool_call>", {"text": "Paris", "topic": "x"}),
    ("qwen3_coder", "Paris</parameter><parameter=topic>\nx</parameter></function>\n"
     "</tool_call>", {"text": "Paris", "topic": "x"}),
    ("qwen3_coder", "Paris \n\n</parameter>\n<parameter=topic>\n\nx \n</parameter>\n"
     "</function>\n</tool_call>", {"text": "Paris \n", "topic": "\nx "}),
    ("qwen3_coder", "a </param</parameter>\n<parameter=topic>\n</parameter>\n</function>\n"
     "</tool_call>", {"text": "a </param", "topic": ""}),
    ("qwen3_coder", "Paris</parameter>\n<description>The weather.</description>\n"
     "</function>\n</tool_call>", None),
    ("qwen3_coder", "Paris</parameter>\nThat is all.", None),
    ("glm", "Paris</arg_value>\n<arg_key>topic</arg_key>\n<arg_value>x</arg_value>\n"
     "</tool_call>", {"text": "Paris", "topic": "x"}),
    ("glm", "Paris</arg_value><arg_key>topic</arg_key>\n<arg_value>x</arg_value></tool_call>",
     {"text": "Paris", "topic": "x"}),
    ("glm", "\n Paris\n</arg_value>\n<arg_key>topic</arg_key>\n<arg_value> x y </arg_value>\n"
     "</tool_call>", {"text": "Paris", "topic": "x y"}),
    ("glm", "Paris</arg_value>\n</arg_value>\n</tool_call>", None),
]


@pytest.mark.parametrize("key, written, want", CASES)
def test_the_grammar_ends_a_raw_value_at_its_first_closing_tag(engine, key, written, want):
    e = engine(key)
    fmt = e.tool_format()
    assert fmt == FORMATS[key]
    req = e.prepare(GenerateRequest(messages=ASK, tools=(NOTE,), tool_choice="required",
                                    max_tokens=8, close_at_budget=False))
    text = opened(fmt) + written
    m = LLMatcher(e.compiler.tokenizer, req.grammar.text, log_level=0)
    taken = ""
    for t in e.encode(text):
        if not m.consume_token(t):
            break
        taken += e.decode_text([t])
    if want is None:  # refused right after the tag and the template's whitespace
        tag = fmt.xml.closing[1]
        assert taken != text and tag in taken, (taken, m.get_error())
        assert len(taken) <= len(opened(fmt)) + written.index(tag) + len(tag) + 2, taken
        return
    assert taken == text and m.is_accepting(), m.get_error()
    _, _, calls = req.calls.parse(text, final=True)
    assert [(c.name, json.loads(c.arguments), c.done) for c in calls] == [
        ("take_note", want, True)]


@pytest.mark.parametrize("key, written, want", [c for c in CASES if c[2] is not None])
def test_the_reader_gives_a_raw_value_stripped_as_the_family_strips_it_streamed_or_not(
        key, written, want):
    fmt = FORMATS[key]
    text = opened(fmt) + written
    parser = CallParser(fmt, STRINGS, ("take_note",))
    _, _, calls = parser.parse(text, final=True)
    assert [(c.name, json.loads(c.arguments), c.done) for c in calls] == [
        ("take_note", want, True)]
    # streamed in pieces of three characters: the call's deltas join to the same arguments
    got = run_text(fmt, [text[i:i + 3] for i in range(0, len(text), 3)], names=("take_note",))
    deltas = [ev for ev in got if isinstance(ev, ToolCallDelta)]
    assert json.loads("".join(d.arguments for d in deltas)) == want
    assert [(c.name, json.loads(c.arguments)) for c in got[-1].tool_calls] == [
        ("take_note", want)]


def test_a_value_that_leaves_out_the_templates_padding_reads_as_its_parser_reads_it():
    # Qwen3-Coder's parser drops one newline after `>` and one before `</parameter>`; GLM's
    # strips the value; the grammar writes Qwen3-Coder's opening newline with the key.
    assert QWEN3_CODER.xml.read("a\n\n") == "a\n" and QWEN3_CODER.xml.read(" a ") == " a "
    assert GLM.xml.read("\n a \t\n") == "a"
    assert QWEN3_CODER.xml.closing == ("\n", "</parameter>", "\n", "")
    assert GLM.xml.closing == ("", "</arg_value>", "\n", "")


@pytest.mark.parametrize("key", ["qwen3_coder", "glm"])
def test_a_forced_call_with_free_text_values_ends_them_at_their_tags(engine, key):
    # The tiny models write free text (whitespace, mostly) into a raw value until the budget
    # rule closes it with the format's value end: the value has text before its tag, the
    # call is complete, plain decoding equals the oracle, and the next turn renders it.
    assert blas.active() == "reference"
    e = engine(key)
    fmt = e.tool_format()
    base = GenerateRequest(messages=ASK, tools=(NOTE,), tool_choice="required",
                           max_tokens=400, spec=None)
    minimum = e.prepare(base).closing.minimum
    for extra, sampling in ((40, SamplingParams()), (80, SamplingParams(1.0, seed=3))):
        req = e.prepare(dataclasses.replace(base, max_tokens=minimum + extra,
                                            sampling=sampling))
        done = e.generate(req)
        same = oracle_tokens(e, req) == done.tokens
        tally.record("tool values: plain vs oracle", same)
        assert same, key
        assert len(done.tool_calls) == 1, done
        call = done.tool_calls[0]
        generated = e.decode_text(done.tokens)
        tag = fmt.xml.closing[1]
        start = len(opened(fmt))
        raw = generated[start:generated.index(tag, start)]
        lead = fmt.xml.closing[0]  # the model's text, then (the template's padding and) the tag
        assert generated.startswith(opened(fmt)) and raw.removesuffix(lead), generated
        args = json.loads(call.arguments)
        assert set(args) == {"text", "topic"} and args["text"] == fmt.xml.read(raw)
        assert not any(tag in v or "<" in v for v in args.values()), args
        then = ASK + (Message("assistant", "", tool_calls=(call,)),
                      Message("tool", "noted", tool_call_id=call.id, name=call.name))
        nxt = e.prepare(GenerateRequest(messages=then, tools=(NOTE,), max_tokens=8,
                                        close_at_budget=False))
        prompt = e.decode_text(nxt.prompt_ids)
        assert fmt.xml.mid + args["text"] in prompt and "noted" in prompt


def test_a_model_that_closes_a_value_without_the_templates_newline_makes_its_call(engine):
    # GLM's </arg_value> is one token: pushed, the tiny model closes each value at once and
    # goes on to the next key without the newline the template writes there.
    e = engine("glm")
    tag = e.compiler.markup.ids("</arg_value>")
    done = e.generate(e.prepare(GenerateRequest(
        messages=ASK, tools=(NOTE,), tool_choice="required", max_tokens=80,
        close_at_budget=False, sampling=SamplingParams(logit_bias=((tag[0], 15.0),)))))
    generated = e.decode_text(done.tokens)
    assert "</arg_value><arg_key>" in generated, generated
    assert done.finish_reason == "tool_calls" and len(done.tool_calls) == 1, done
    assert json.loads(done.tool_calls[0].arguments) == {"text": "", "topic": ""}


# -- call ids the model writes ------------------------------------------------------------

MISTRAL_TEXT = ('[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}, "id": '
                '"123456789"}, {"name": "get_time", "arguments": {"zone": "CET"}, "id": '
                '"123456789"}, {"name": "get_time", "arguments": {"zone": "UTC"}, "id": '
                '"abcdefghi"}]')


def test_a_repeated_model_written_id_is_made_unique_the_same_streamed_or_not():
    fmt = ToolFormat("template", " ", '[TOOL_CALLS] [{"name": "', None, '", "arguments": ',
                     ', "id": "\x00"}, {"name": "', ', "id": "\x00"}]', "[TOOL_CALLS] [",
                     id_len=9)
    _, _, calls = CallParser(fmt, names=("get_time",)).parse(MISTRAL_TEXT, final=True)
    ids = [c.id for c in calls]
    assert ids[0] == "123456789" and ids[2] == "abcdefghi" and len(set(ids)) == 3, ids
    assert all(len(i) == 9 and i.isascii() and i.isalnum() for i in ids), ids
    # the same answer read again, and streamed a few characters at a time
    assert [c.id for c in CallParser(fmt).parse(MISTRAL_TEXT, final=True)[2]] == ids
    got = run_text(fmt, [MISTRAL_TEXT[i:i + 5] for i in range(0, len(MISTRAL_TEXT), 5)])
    streamed = {ev.index: ev.id for ev in got if isinstance(ev, ToolCallDelta)}
    assert [streamed[i] for i in range(3)] == ids == [c.id for c in got[-1].tool_calls]


def test_parallel_calls_of_a_model_that_repeats_its_id_get_unique_ids_on_the_wire(tmp_path):
    # The tiny Mistral model writes one id for every call of an answer; through the real
    # server and the OpenAI client, the message's first id is the model's, the others
    # differ, the stream's are the message's, and the next turn renders each call and its
    # result under its id (the template checks nine alphanumerics).
    from server.app import create_app
    from server.door import ServeConfig
    from tests.serverproc import InProcess

    e = Engine(load(str(make_tool_family("mistral", tmp_path / "m"))))
    fmt = e.tool_format()
    more = fmt.between[len(_shared(fmt.between, fmt.close)):]
    bias = marker_bias(e, 100) + ((e.encode(more)[0], 8.0),)  # two calls or more
    generated = e.decode_text(e.generate(e.prepare(GenerateRequest(
        messages=ASK, tools=(WEATHER, CLOCK), max_tokens=120,
        sampling=SamplingParams(logit_bias=bias)))).tokens)
    written = [generated[i + 7:i + 16] for i in range(len(generated))
               if generated.startswith('"id": "', i)]
    assert len(written) >= 2 and len(set(written)) == 1, generated  # the model repeats it
    srv = InProcess(create_app(e, ServeConfig()), e)
    try:
        client = srv.client()
        body = dict(model="default", messages=[{"role": m.role, "content": m.content}
                                               for m in ASK],
                    tools=[{"type": "function", "function": {
                        "name": t.name, "description": t.description,
                        "parameters": dict(t.parameters)}} for t in (WEATHER, CLOCK)],
                    max_tokens=120, temperature=0, logit_bias={str(t): v for t, v in bias})
        calls = client.chat.completions.create(**body).choices[0].message.tool_calls
        streamed: dict[int, str] = {}
        for chunk in client.chat.completions.create(stream=True, **body):
            for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                if tc.id:
                    streamed[tc.index] = tc.id
    finally:
        srv.stop()
    ids = [c.id for c in calls]
    assert len(ids) == len(written) and ids[0] == written[0] and len(set(ids)) == len(ids)
    assert all(len(i) == 9 and i.isascii() and i.isalnum() for i in ids), ids
    assert [streamed[i] for i in range(len(ids))] == ids
    then = ASK + (Message("assistant", "", tool_calls=tuple(
        ToolCall(c.id, c.function.name, c.function.arguments) for c in calls)),) + tuple(
        Message("tool", f'"result {k}"', tool_call_id=c.id, name=c.function.name)
        for k, c in enumerate(calls))
    prompt = e.decode_text(e.prepare(GenerateRequest(
        messages=then, tools=(WEATHER, CLOCK), max_tokens=8, close_at_budget=False)).prompt_ids)
    for k, c in enumerate(calls):
        assert f'"id": "{c.id}"' in prompt
        assert f'"result {k}", "call_id": "{c.id}"' in prompt
