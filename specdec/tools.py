"""Tool calls as a grammar, in the model's own format.

A model writes calls the way its chat template renders them in the history. `detect` reads
that format off the template: it renders a probe conversation (a turn with text, with one
call, with two calls, with arguments of one and two keys) and keeps the markup around the
probe's name, arguments and id as a `ToolFormat` -- literal segments, no knowledge of model
names. A template that renders no calls gets `GENERIC` (calls as one JSON envelope,
`{"tool_calls": [...]}`, described to the model in a system message: `generic_messages`).

`tools_grammar` turns a format, the tools and the tool choice into one llguidance grammar
for the whole answer: with "auto", free text (or the `response_format` answer) that never
contains the format's call marker, or text then calls, or calls; the name is one of the
tools', the arguments match that tool's `parameters`, then the format's closing markup, more
calls where `parallel_tool_calls`, and the end of the turn. So the bytes generated for a call
are the bytes the template renders for that call in the history (but the whitespace around
a raw value's closing tag, which the model may leave out: `XmlParams`).

`CallParser` reads an answer back as text and calls, incrementally (a stream's deltas),
holding back text that could still be the start of call markup, so markup never reaches
`content` half-written.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from .errors import GrammarError
from .reasoning import Markup, find_protocol
from .schema_rewrite import rewrite


ID = "\x00"  # where a call's id sits in a segment
ID_CHARS = "[A-Za-z0-9]"
_ALNUM = string.ascii_letters + string.digits  # ID_CHARS' characters

# -- the format ------------------------------------------------------------------------------


@dataclass(frozen=True)
class XmlParams:
    """Arguments written as one element per parameter (Qwen3-Coder's
    `<parameter=KEY>\\nVALUE\\n</parameter>\\n`): after the name, `first` opens the first
    parameter, `next` closes one and opens the next, `last` closes the last one and the call,
    `empty` ends a call without parameters; `mid` sits between a key and its value; `value_end`
    (the common start of `next` and `last`) ends a value. String values are written raw, the
    others as JSON.

    A raw value cannot hold its element's closing tag: it ends at the first one, whatever
    whitespace the model wrote before it (the families' own parsers read it so: `read`),
    and between the tag and the markup after it stands the template's whitespace or none
    (`closing`). A value the grammar writes whole (JSON, an enum) ends with `value_end`, so
    such a call is the bytes the template renders for it."""

    first: str
    mid: str
    next: str
    last: str
    empty: str

    @property
    def value_end(self) -> str:
        return _common_prefix(self.next, self.last)

    @property
    def closing(self) -> tuple[str, str, str, str]:
        """`value_end` as (lead, tag, gap, after): the whitespace before the closing tag,
        the tag (up to its `>`), the whitespace after it, the start of the markup that
        follows (Qwen3-Coder's `\\n`, `</parameter>`, `\\n` and none)."""
        end = self.value_end
        body = end.lstrip()
        n = body.find(">") + 1 or len(re.split(r"\s", body, maxsplit=1)[0])
        rest = body[n:]
        after = rest.lstrip()
        return end[:len(end) - len(body)], body[:n], rest[:len(rest) - len(after)], after

    def read(self, raw: str) -> str:
        """A raw value as written between its markup and its closing tag, read back as the
        family's own parser reads it: where the template pads values with whitespace
        (Qwen3-Coder's newlines), one of the padding before the tag is dropped (the rest is
        the value's); where it writes them flush against their tags (GLM), the whitespace
        around the value is (vLLM's qwen3_coder and glm4_moe parsers)."""
        lead = self.closing[0]
        if lead or self.mid != self.mid.rstrip():
            return raw.removesuffix(lead)
        return raw.strip()


@dataclass(frozen=True)
class ToolFormat:
    """How one chat template writes an assistant turn: literal segments around the text,
    the calls' names and arguments (`ID` marks where a call's id is written).

    Attributes:
        source: "template" (read off the chat template) or "generic".
        text_open: before the turn's text.
        first: before the first call's name in a turn without text.
        after_text: between the text and the first call's name; None: calls cannot
            follow text in one turn.
        name_end: between a call's name and its arguments.
        between: between one call's arguments and the next call's name; None: one call per
            turn.
        close: after the last call's arguments (the end of turn excluded: the model ends
            with its end-of-turn token).
        marker: the text that starts call markup; the turn's text never contains it.
        arguments: how a call's arguments reach the template: "string" (the JSON text as
            sent) or "object" (parsed).
        xml: arguments as XML-style parameters, else None (JSON).
        id_len: characters of a call id the format writes (0: none).
    """

    source: str
    text_open: str
    first: str
    after_text: str | None
    name_end: str
    between: str | None
    close: str
    marker: str
    arguments: Literal["string", "object"] = "object"
    xml: XmlParams | None = None
    id_len: int = 0

    @property
    def parallel(self) -> bool:
        return self.between is not None

    def segments(self) -> tuple[str, ...]:
        return tuple(s for s in (self.text_open, self.first, self.after_text, self.name_end,
                                 self.between, self.close) if s is not None)

    def write(self, calls: Sequence[tuple[str, str, str]], text: str = "") -> str:
        """An assistant turn's text (end of turn excluded) with these (id, name, arguments
        JSON) calls, as the model writes it."""
        if not calls:
            return self.text_open + text
        out = (self.text_open + text + self.after_text if text and self.after_text is not None
               else self.first)
        for i, (cid, name, args) in enumerate(calls):
            if i:
                out += self._fill(self.between or "", calls[i - 1][0])
            out += name + self._fill(self.name_end, cid) + self._args(args)
        return out + self._fill(self.close, calls[-1][0])

    def _fill(self, segment: str, cid: str) -> str:
        return segment.replace(ID, cid)

    def _args(self, args: str) -> str:
        if self.xml is None:
            return args
        x = self.xml
        value = json.loads(args)
        if not value:
            return x.empty
        parts = [k + x.mid + (v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))
                 for k, v in value.items()]
        return x.first + x.next.join(parts) + x.last


GENERIC = ToolFormat(
    source="generic", text_open="", first='{"tool_calls": [{"name": "', after_text=None,
    name_end='", "arguments": ', between='}, {"name": "', close="}]}",
    marker='{"tool_calls": [')

GENERIC_SYSTEM = (
    "You can call functions. They are described in JSON Schema inside <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n\nTo call functions, answer with only a JSON object:\n"
    '{{"tool_calls": [{{"name": <function-name>, "arguments": <args-json-object>}}]}}\n'
    "Their results come back inside <tool_response></tool_response> tags. Otherwise answer "
    "in text.")


def generic_messages(messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]],
                     system: bool = True) -> list[dict[str, Any]]:
    """A conversation for a template without tool support: the tools described in the
    system message (`system` False: at the start of the first user turn, for templates
    without a system role), calls written into the assistant's text in `GENERIC`'s format,
    and tool results as a user turn of `<tool_response>` blocks (consecutive ones merged)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [(c["id"], c["function"]["name"], _args_text(c["function"]["arguments"]))
                     for c in m["tool_calls"]]
            out.append({"role": "assistant",
                        "content": GENERIC.write(calls, m.get("content") or "")})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool", None)
    if tools:
        text = GENERIC_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False)
                                                     for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        elif system:
            out.insert(0, {"role": "system", "content": text})
        else:
            at = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
            if at is None:
                out.insert(0, {"role": "user", "content": text})
            else:
                out[at] = {**out[at], "content": f"{text}\n\n{out[at]['content']}"}
    return out


def _args_text(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


# -- detection --------------------------------------------------------------------------------

Render = Callable[[list[dict[str, Any]], list[dict[str, Any]], bool], str]

PROBE_USER = {"role": "user", "content": "probe question"}
PROBE_TEXT = "probe answer text"
PROBE_NAMES = ("probe_fn_alpha", "probe_fn_beta")
PROBE_IDS = ("a1b2c3d4e", "f5g6h7i8j")  # nine alphanumerics: what Mistral's templates check
PROBE_ARGS = ({"probe_key": "probe_val"}, {"probe_key": "probe_val", "probe_key2": "probe_v2"})
PROBE_TOOLS = [{"type": "function", "function": {
    "name": n, "description": "A probe.",
    "parameters": {"type": "object", "properties": {"probe_key": {"type": "string"},
                                                    "probe_key2": {"type": "string"}}}}}
    for n in PROBE_NAMES]


def detect(render: Render, end_texts: Sequence[str] = ()) -> ToolFormat:
    """The tool-call format a chat template renders (`GENERIC` if it renders no calls).

    Args:
        render: (messages, tools, add_generation_prompt) -> the template's text.
        end_texts: the model's end-of-turn tokens as text (dropped from a call's end: the
            model ends its turn with one of them).
    """
    try:
        fmt = _detect(render, tuple(end_texts))
    except Exception:  # a template that cannot render the probes has no usable format
        return GENERIC
    return fmt or GENERIC


def _turn(render: Render, msg: dict[str, Any]) -> str | None:
    """What the template writes for an assistant turn (after the generation prompt; where
    the generation prompt ends by opening the reasoning, as an always-thinking template's
    does, after what comes before that marker: the turn the history holds has no reasoning)."""
    try:
        head = render([PROBE_USER], PROBE_TOOLS, True)
        full = render([PROBE_USER, msg], PROBE_TOOLS, False)
    except Exception:
        return None
    if full.startswith(head):
        return full[len(head):]
    proto = find_protocol(head[-80:])
    at = head.rstrip().rfind(proto.open) if proto is not None else -1
    if at >= 0 and not head[at + len(proto.open):].strip() and full.startswith(head[:at]):
        return full[at:]
    return None


def _call(i: int, args: Any, as_string: bool) -> dict[str, Any]:
    return {"id": PROBE_IDS[i], "type": "function", "function": {
        "name": PROBE_NAMES[i], "arguments": json.dumps(args) if as_string else args}}


def _detect(render: Render, end_texts: tuple[str, ...]) -> ToolFormat | None:
    text_turn = _turn(render, {"role": "assistant", "content": PROBE_TEXT})
    if text_turn is None or PROBE_TEXT not in text_turn:
        return None
    text_open, _, turn_end = text_turn.partition(PROBE_TEXT)
    for as_string in (True, False):
        found = _detect_args(render, as_string, text_open, turn_end, end_texts)
        if found is not None:
            return found
    return None


def _detect_args(render: Render, as_string: bool, text_open: str, turn_end: str,
                 end_texts: tuple[str, ...]) -> ToolFormat | None:
    def calls(*specs: tuple[int, Any], content: str | None = None) -> str | None:
        return _turn(render, {"role": "assistant", "content": content, "tool_calls": [
            _call(i, a, as_string) for i, a in specs]})

    one = calls((0, PROBE_ARGS[0]))
    if one is None or PROBE_NAMES[0] not in one:
        return None
    n = one.index(PROBE_NAMES[0])
    first, rest = one[:n], one[n + len(PROBE_NAMES[0]):]
    args = json.dumps(PROBE_ARGS[0], ensure_ascii=False)
    xml: XmlParams | None = None
    if args in rest:
        name_end, _, tail = rest.partition(args)
    else:  # parameters as elements? (the JSON object is not written)
        xml_found = None if as_string else _detect_xml(calls, first, rest)
        if xml_found is None:
            return None
        xml, name_end, tail = xml_found
    two = calls((0, PROBE_ARGS[0]), (1, PROBE_ARGS[0]))
    between = None
    if two is not None and two.startswith(first + PROBE_NAMES[0]) and PROBE_NAMES[1] in two:
        one_call = PROBE_NAMES[0] + name_end + (args if xml is None else _xml1(xml))
        if two.startswith(first + one_call):
            b, _, rest2 = two[len(first + one_call):].partition(PROBE_NAMES[1])
            if rest2 == name_end.replace(PROBE_IDS[0], PROBE_IDS[1]) + \
                    (args if xml is None else _xml1(xml)) + tail.replace(PROBE_IDS[0],
                                                                        PROBE_IDS[1]):
                between = b
    with_text = calls((0, PROBE_ARGS[0]), content=PROBE_TEXT)
    after_text = None
    if with_text is not None and with_text.startswith(text_open + PROBE_TEXT):
        a, sep, rest3 = with_text[len(text_open + PROBE_TEXT):].partition(PROBE_NAMES[0])
        if sep and first + PROBE_NAMES[0] + rest3 == one:
            after_text = a
    if between is not None and any(t and t in between for t in end_texts):
        between = None  # each call its own turn (Harmony): the model ends with the first
    close = tail
    if turn_end and close.endswith(turn_end):  # what ends every assistant turn
        close = close[:-len(turn_end)]
    while True:  # the model ends with its end-of-turn token
        t = next((t for t in end_texts if t and close.endswith(t)), None)
        if t is None:
            break
        close = close[:-len(t)]
    id_len = 0
    segs = [first, name_end, close, between, after_text]
    if any(s is not None and PROBE_IDS[0] in s for s in segs):
        id_len = len(PROBE_IDS[0])
    if between is not None and PROBE_IDS[1] in between:
        return None  # a format that writes a call's id before the call: not supported
    def fix(s: str | None) -> Any:
        return None if s is None else s.replace(PROBE_IDS[0], ID)

    marker = _marker(first)
    if not first or not name_end or not marker:  # a name written bare: nothing to anchor on
        return None
    return ToolFormat("template", text_open, fix(first), fix(after_text), fix(name_end),
                      fix(between), fix(close), marker, "string" if as_string else "object",
                      xml, id_len)


def _xml1(x: XmlParams) -> str:
    return x.first + "probe_key" + x.mid + "probe_val" + x.last


def _detect_xml(calls: Callable[..., str | None], first: str, rest: str
                ) -> tuple[XmlParams, str, str] | None:
    """(parameters, name_end, tail) for a format that writes each argument as an element."""
    key, val = "probe_key", "probe_val"
    if key not in rest or val not in rest:
        return None
    two = calls((0, PROBE_ARGS[1]))
    empty = calls((0, {}))
    if two is None or empty is None:
        return None
    name = PROBE_NAMES[0]
    lead = first + name
    if not two.startswith(lead) or not empty.startswith(lead):
        return None
    k = rest.index(key)
    opener, after_key = rest[:k], rest[k + len(key):]
    mid, _, last = after_key.partition(val)
    body2 = two[len(lead):]
    head = opener + key + mid + val
    if not body2.startswith(head):
        return None
    nxt, _, tail2 = body2[len(head):].partition("probe_key2")
    if tail2 != mid + "probe_v2" + last:
        return None
    empty_rest = empty[len(lead):]
    # name_end: what every call writes after its name, whatever its parameters
    name_end = _common_prefix(opener, empty_rest)
    x = XmlParams(first=opener[len(name_end):], mid=mid, next=nxt, last=last,
                  empty=empty_rest[len(name_end):])
    # the call's tail beyond its parameters: what `last` and `empty` share at their ends
    tail = _common_suffix(x.last, x.empty)
    x = replace(x, last=x.last[:len(x.last) - len(tail)], empty=x.empty[:len(x.empty)
                                                                       - len(tail)])
    return x, name_end, tail


def _marker(first: str) -> str:
    """The start of call markup: the first line of what opens a call, up to its JSON."""
    line = first.split("\n", 1)[0].strip()
    cut = line.find("{")
    line = line[:cut].strip() if cut > 0 else line
    return line or first


def _common_prefix(a: str, b: str) -> str:
    """The common start of two segments, never ending inside a tag: a tag is often one token
    (GLM's `<arg_key>`), which a segment boundary must not split."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    lt = a.rfind("<", 0, n)
    return a[:lt] if lt > a.rfind(">", 0, n) else a[:n]


def _common_suffix(a: str, b: str) -> str:
    """The common end of two segments, never starting inside a tag (`_common_prefix`)."""
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    tail = a[len(a) - n:]
    gt = tail.find(">")
    return tail[gt + 1:] if gt >= 0 and not 0 <= tail.find("<") < gt else tail


# -- the grammar ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolSpec:
    """One callable tool as the grammar takes it."""

    name: str
    parameters: Mapping[str, Any]
    strict: bool = False


JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Lark:
    """Writes segments as Lark expressions: text as string literals, the tokenizer's special
    tokens by id, a call id as its rule."""

    def __init__(self, markup: Markup) -> None:
        self.pieces = markup.pieces  # text runs and special-token ids (ID kept as text)

    def expr(self, s: str) -> str:
        parts: list[str] = []
        for p in self.pieces(s):
            if isinstance(p, int):
                parts.append(f"<[{p}]>")
                continue
            for j, q in enumerate(p.split(ID)):
                if j:
                    parts.append("call_id")
                if q:
                    parts.append(json.dumps(q))
        return " ".join(parts) if parts else '""'

    def is_text(self, s: str) -> bool:
        return all(isinstance(p, str) for p in self.pieces(s))


def _rx(text: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else f"\\x{ord(c):02x}" if ord(c) < 128
                   else c for c in text)


def tools_grammar(fmt: ToolFormat, tools: Sequence[ToolSpec], *, text: bool,
                  answer: str | None, parallel: bool, markup: Markup) -> str:
    """The llguidance grammar (TopLevelGrammar JSON) for an answer that is text (when
    `text`: free, or `answer` -- another grammar's text, a response format -- when given)
    or calls of `tools` in `fmt` (several when `parallel` and the format allows)."""
    lk = Lark(markup)
    rules: list[str] = []
    marker_text = lk.is_text(fmt.marker)
    no_marker = f" & ~/(?s:.*){_rx(fmt.marker)}(?s:.*)/" if marker_text else ""
    alts: list[str] = []
    calls = "calls" if parallel and fmt.between is not None else "call"
    if text:
        if answer is not None:
            alts.append(f"{lk.expr(fmt.text_open)} @answer")
        else:
            alts.append(f"{lk.expr(fmt.text_open)} FREE")
            # Calls only open a turn, with text markup (Llama 3.1's JSON, the generic
            # envelope): a turn that starts like that markup is a call.
            lead = lk.pieces(fmt.first)[0] if fmt.first else ""
            if fmt.after_text is None and not fmt.text_open and isinstance(lead, str):
                no_marker += f" & ~/{_rx(lead[0])}(?s:.*)/"
            rules.append(f"FREE: /(?s:.*)/{no_marker}")
            if fmt.after_text is not None:
                alts.append(f"{lk.expr(fmt.text_open)} {_text_then(lk, fmt, rules)} "
                            f"{calls} {lk.expr(fmt.close)}")
    alts.append(f"{lk.expr(fmt.first)} {calls} {lk.expr(fmt.close)}")
    rules.insert(0, "start: " + " | ".join(alts))
    if calls == "calls":
        rules.append(f"calls: call | call {lk.expr(fmt.between or '')} calls")
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, t in enumerate(tools):
        rules.append(f"call_{i}: {json.dumps(t.name)} {lk.expr(fmt.name_end)} "
                     f"{_args_rule(fmt, t, i, rules, lk)}")
    if fmt.id_len:
        rules.append(f"call_id: /{ID_CHARS}{{{fmt.id_len}}}/")
    grammars: list[dict[str, Any]] = [{"lark_grammar": "\n".join(rules)}]
    if answer is not None:
        sub = answer.strip()
        subs = json.loads(sub)["grammars"] if sub.startswith("{") else [{"lark_grammar": answer}]
        grammars += [{**subs[0], "name": "answer"}, *subs[1:]]
    return json.dumps({"grammars": grammars})


def json_calls_schema(fmt: ToolFormat, tools: Sequence[ToolSpec], parallel: bool
                      ) -> dict[str, Any] | None:
    """The calls as one JSON schema, for a format whose calls are one JSON value written with
    the grammar's separators (the generic envelope, Llama 3.1's object); else None.

    A text answer under a JSON response format and such calls both start with `{`: one JSON
    schema (`anyOf` of the two) holds both, where two grammars side by side could not.
    """
    if fmt.text_open or fmt.id_len or fmt.xml is not None or any(
            "$ref" in json.dumps(t.parameters) for t in tools):  # refs are root-relative
        return None
    name, args = "__specdec_name__", '{"__specdec_args__": 0}'
    one = fmt.write([("", name, args)])
    two = fmt.write([("", name, args), ("", name, args)]) if fmt.between else None
    try:
        shape = json.loads(one)
        shape2 = json.loads(two) if two is not None else None
    except ValueError:
        return None
    if json.dumps(shape, ensure_ascii=False) != one:
        return None
    def walk(v: Any, v2: Any) -> dict[str, Any] | None:
        if v == name:
            return {"_name": True}
        if v == {"__specdec_args__": 0}:
            return {"_args": True}
        if isinstance(v, dict):
            props = {}
            for k, x in v.items():
                sub = walk(x, v2.get(k) if isinstance(v2, dict) else None)
                if sub is None:
                    return None
                props[k] = sub
            if any("_name" in p for p in props.values()):  # the call object
                return {"_call": props}
            return {"type": "object", "properties": props, "required": list(props),
                    "additionalProperties": False}
        if isinstance(v, list) and len(v) == 1:
            item = walk(v[0], v2[0] if isinstance(v2, list) and v2 else None)
            if item is None:
                return None
            many = parallel and isinstance(v2, list) and len(v2) == 2
            return {"type": "array", "items": item, "minItems": 1,
                    **({} if many else {"maxItems": 1})}
        if isinstance(v, (str, int, float, bool)) or v is None:
            return {"const": v}
        return None

    tree = walk(shape, shape2)
    if tree is None:
        return None

    def fill(node: Any) -> Any:
        if isinstance(node, dict) and "_call" in node:
            props = node["_call"]
            alts = []
            for t in tools:
                p = {k: ({"const": t.name} if "_name" in v else _arguments(t)
                         if "_args" in v else v) for k, v in props.items()}
                alts.append({"type": "object", "properties": p, "required": list(p),
                             "additionalProperties": False})
            return alts[0] if len(alts) == 1 else {"anyOf": alts}
        if isinstance(node, dict):
            return {k: fill(v) for k, v in node.items()}
        if isinstance(node, list):
            return [fill(v) for v in node]
        return node

    return fill(tree)


def _text_then(lk: Lark, fmt: ToolFormat, rules: list[str]) -> str:
    """The rule for text followed by the markup that opens the first call after text: the
    text up to that markup's first special token (or its end) is one lexeme that ends at the
    first place the markup appears (and never holds the marker before it)."""
    pieces = lk.pieces(fmt.after_text or "")
    lead = pieces[0] if pieces and isinstance(pieces[0], str) else ""
    lead_text = lead.split(ID)[0]
    rest = fmt.after_text[len(lead_text):] if fmt.after_text else ""
    if lk.is_text(fmt.marker):
        ban = f" & ~/(?s:.*){_rx(fmt.marker)}(?s:.*){_rx(lead_text)}/" if fmt.marker in \
            lead_text else f" & ~/(?s:.*){_rx(fmt.marker)}(?s:.*)/"
    else:
        ban = ""
    rules.append(f"TEXT_CALL: /(?s:.*){_rx(lead_text)}/{ban}")
    lazy = not rest or isinstance(lk.pieces(rest)[0], str)
    rules.append(f"text_call{'[lazy]' if lazy else ''}: TEXT_CALL")
    return "text_call" + (f" {lk.expr(rest)}" if rest else "")


def _schema(t: ToolSpec, schema: Mapping[str, Any]) -> str:
    opts = dict(JSON_OPTIONS)
    if not t.strict:
        opts.update(lenient=True, coerce_one_of=True)
    s = dict(rewrite(dict(schema)))  # the keywords the compiler does not hold, rewritten
    s["x-guidance"] = {**opts, **dict(s.get("x-guidance") or {})}
    return "%json " + json.dumps(s, ensure_ascii=False)


_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties",
                   "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
               "unevaluatedProperties", "propertyNames")


def closed(schema: Any) -> Any:
    """A tool's parameter schema with every object that does not say `additionalProperties`
    admitting only the properties it names (xgrammar's default for tools in vLLM and
    SGLang): a model cannot add a property the tool never named, nor grow a free object
    until the budget ends. A name the object requires without describing it is one it names
    (any value): closing must not refuse what the tool requires. `additionalProperties:
    true` or a schema keeps an object open; the branches of an `allOf` are left as they are
    (closing each would refuse the others' properties)."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {k: closed(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(v) for v in out[key]]
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), Mapping):
            out[key] = closed(out[key])
    is_object = out.get("type") == "object" or (
        isinstance(out.get("type"), list) and "object" in out["type"]) or (
        "type" not in out and "properties" in out)
    if is_object and "additionalProperties" not in out and "allOf" not in out \
            and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
        named, required = out.get("properties", {}), out.get("required")
        if isinstance(named, Mapping) and isinstance(required, list):
            missing = [k for k in required if isinstance(k, str) and k not in named]
            if missing:
                out["properties"] = {**named, **{k: {} for k in missing}}
    return out


def _arguments(t: ToolSpec) -> dict[str, Any]:
    """A tool's parameters as the arguments' schema: an object, whatever it leaves out; its
    objects closed to the properties they name (`closed`)."""
    schema = closed(dict(t.parameters))
    if "type" not in schema and not any(k in schema for k in ("anyOf", "oneOf", "allOf",
                                                              "$ref", "enum", "const")):
        schema["type"] = "object"
    return schema


def _args_rule(fmt: ToolFormat, t: ToolSpec, i: int, rules: list[str], lk: Lark) -> str:
    if fmt.xml is None:
        return _schema(t, _arguments(t))
    x = fmt.xml
    props = t.parameters.get("properties") or {}
    if not isinstance(props, Mapping):
        props = {}
    required = {r for r in (t.parameters.get("required") or ()) if isinstance(r, str)}
    defs = {k: t.parameters[k] for k in ("$defs", "definitions") if k in t.parameters}
    end = x.value_end
    # A raw value ends at the first closing tag, the template's whitespace after it or none;
    # a value the grammar writes whole (JSON, an enum) ends as the template ends it.
    _, tag, gap, after = x.closing
    rest = (f"({lk.expr(gap)})? " if gap else "") + lk.expr(after)
    if lk.is_text(tag):  # the value and its tag: one lazy lexeme
        rules.append(f"VALUE_{i}: /(?s:.*){_rx(tag)}/")
        rules.append(f"value_{i}[lazy]: VALUE_{i}")
        rules.append(f"raw_{i}: value_{i} {rest}")
    else:  # a special token closes it: free text never holds one
        rules.append(f"VALUE_{i}: /(?s:.*)/")
        rules.append(f"raw_{i}: VALUE_{i} {lk.expr(tag)} {rest}")
    if not props:  # any keys, string values
        rules.append(f"KEY_{i}: /[A-Za-z_][A-Za-z0-9_.-]*/")
        param = f'KEY_{i} {lk.expr(x.mid)} raw_{i}'
        rules.append(f"params_{i}: {lk.expr(x.empty)} | {lk.expr(x.first)} {param} "
                     f"more_{i}")
        rules.append(f"more_{i}: {lk.expr(x.last[len(end):])} | "
                     f"{lk.expr(x.next[len(end):])} {param} more_{i}")
        return f"params_{i}"
    keys = list(props)
    n = len(keys)
    for j, k in enumerate(keys):
        sub = {**(props[k] if isinstance(props[k], Mapping) else {}), **defs}
        loose = sorted(set(sub) - {"type", "enum", "title", "description", "$defs",
                                   "definitions", "default", "examples"})
        if t.strict and sub.get("type") == "string" and loose:
            raise GrammarError("tools", f"tool {t.name!r}: parameter {k!r} is written raw in "
                               f"this model's format, which cannot enforce {loose}; drop "
                               "strict or those keywords")
        if sub.get("type") == "string" and isinstance(sub.get("enum"), list):
            value = "(" + " | ".join(json.dumps(str(v)) for v in sub["enum"]) + \
                f") {lk.expr(end)}"
        elif sub.get("type") == "string":
            value = f"raw_{i}"
        else:
            value = f"{_schema(t, closed(sub))} {lk.expr(end)}"
        rules.append(f"p_{i}_{j}: {json.dumps(k)} {lk.expr(x.mid)} {value}")
    for j in range(n, -1, -1):
        for started in (0, 1):
            name = f"s_{i}_{j}_{started}"
            if j == n:
                body = lk.expr(x.last[len(end):]) if started else lk.expr(x.empty)
            else:
                opener = lk.expr(x.next[len(end):]) if started else lk.expr(x.first)
                body = f"{opener} p_{i}_{j} s_{i}_{j + 1}_1"
                if keys[j] not in required:
                    body += f" | s_{i}_{j + 1}_{started}"
            rules.append(f"{name}: {body}")
    return f"s_{i}_0_0"


# -- reading an answer back -------------------------------------------------------------------


@dataclass
class ParsedCall:
    """A call read from the answer so far."""

    index: int
    id: str
    name: str
    arguments: str = ""  # its JSON text so far (whole once `done`)
    done: bool = False


@dataclass
class CallParser:
    """Reads an answer written in `fmt` (the grammar's output) back as text and calls.

    `parse(answer so far)` gives the text, how much of it is certain (text that could still
    be the start of call markup is not), and the calls begun so far: a call's name is known
    once complete (the markup after it begun, where the tools' names are given); JSON
    arguments grow as they arrive; XML parameters and a call whose id the format writes
    after its arguments are known once the call is complete. An id the model wrote that an
    earlier call of the answer has already is made unique (`_unique_id`).

    Attributes:
        fmt: the format.
        string_keys: per tool name, the parameters whose values XML writes raw (strings).
        names: the tools' names: an answer that opens like a call but names none of them
            is text (a JSON answer under Llama 3.1's format, say).
    """

    fmt: ToolFormat
    string_keys: Mapping[str, frozenset[str]] = field(default_factory=dict)
    names: tuple[str, ...] = ()  # the tools' names (none given: any name)
    _ids: dict[int, str] = field(default_factory=dict, init=False, repr=False)

    def parse(self, s: str, final: bool = False, cut: bool = False
              ) -> tuple[str, int, list[ParsedCall]]:
        """(text, how much of it is certain, calls) of the answer `s` so far; `final`: it is
        all there; `cut`: max_tokens ended it (what could be the start of markup is
        dropped from the text, never reported as text)."""
        f = self.fmt
        if s.startswith(f.first) and self._names_a_tool(s[len(f.first):]):
            return "", 0, self._calls(s, len(f.first), final)
        if s.startswith(f.text_open):
            body = s[len(f.text_open):]
        elif f.text_open.isspace():  # a detokenizer drops a leading space (SentencePiece)
            body = s
        elif not final and (f.text_open.startswith(s) or f.first.startswith(s)):
            return "", 0, []  # the answer's opening markup is still being written
        else:
            body = s
        if f.after_text is not None:
            lead = f.after_text.split(ID)[0]
            at = body.find(lead) if lead else -1
            if at >= 0:
                return body[:at], at, self._calls(body, at + len(lead), final,
                                                   expect=f.after_text[len(lead):])
        marks = [f.marker] + ([f.after_text.split(ID)[0]] if f.after_text else [])
        if not f.text_open:
            marks.append(f.first)
        if final and not cut:
            return body, len(body), []
        body = body[:len(body) - _held(body, marks)] if cut else body
        return body, len(body) - (0 if cut else _held(body, marks)), []

    def _names_a_tool(self, rest: str) -> bool:
        """Whether what follows a call's opening markup can still be a tool's name."""
        if not self.names:
            return True
        ends = [n + self.fmt.name_end.split(ID)[0] for n in self.names]
        return any(rest.startswith(e) or e.startswith(rest) for e in ends)

    def _named(self, rest: str) -> str | None:
        """The tool `rest` names when it is one tool's whole name followed by the start of
        the markup after a name (a name is known before that markup is complete: the
        call's first delta need not wait for it); None: not yet, or no tool names given."""
        lead = self.fmt.name_end.split(ID)[0]
        if not lead or not self.names:
            return None
        found = [n for n in self.names
                 if len(rest) > len(n) and rest.startswith(n) and lead.startswith(rest[len(n):])]
        return found[0] if len(found) == 1 else None

    def _calls(self, s: str, pos: int, final: bool, expect: str = "") -> list[ParsedCall]:
        f = self.fmt
        out: list[ParsedCall] = []
        if expect:
            m = _seg(expect).match(s, pos)
            if m is None:
                return out
            pos = m.end()
        name_end = _seg(f.name_end)
        while True:
            idx = len(out)
            m = name_end.search(s, pos)
            if m is None:
                name = self._named(s[pos:])
                if name is not None:  # its name complete, the markup after it on its way
                    out.append(ParsedCall(idx, self._ids.setdefault(
                        idx, f"call_{uuid.uuid4().hex[:24]}"), name))
                return out
            call = ParsedCall(idx, self._ids.setdefault(idx, f"call_{uuid.uuid4().hex[:24]}"),
                              s[pos:m.start()])
            out.append(call)
            end, call.arguments = self._args(s, m.end(), call.name)
            if end is None:
                return out
            mb = _seg(f.between).match(s, end) if f.between is not None else None
            mm = mb or _seg(f.close).match(s, end)
            if mm is None:
                return out
            call.done = True
            if f.id_len and mm.groups():
                self._ids[idx] = call.id = _unique_id(mm.group(1), {c.id for c in out[:-1]})
            if mb is None:
                return out
            pos = mb.end()

    def _args(self, s: str, pos: int, name: str) -> tuple[int | None, str]:
        """(where the arguments end, or None while incomplete; their JSON text so far)."""
        x = self.fmt.xml
        if x is None:
            try:
                _, end = json.JSONDecoder().raw_decode(s, pos)
            except ValueError:
                return None, s[pos:]
            return end, s[pos:end]
        if s.startswith(x.empty, pos) and not s.startswith(x.first, pos):
            return pos + len(x.empty), "{}"
        if not s.startswith(x.first, pos):
            return None, ""
        pos += len(x.first)
        out: dict[str, Any] = {}
        strings = self.string_keys.get(name)
        end = x.value_end
        _, tag, gap, after = x.closing
        nxt, last = x.next[len(end):], x.last[len(end):]
        while True:
            k = s.find(x.mid, pos)
            v = s.find(tag, k + len(x.mid)) if k >= 0 else -1
            if v < 0:
                return None, ""
            key, raw = s[pos:k], x.read(s[k + len(x.mid):v])
            if strings is None or key in strings:
                out[key] = raw
            else:
                try:
                    out[key] = json.loads(raw)
                except ValueError:
                    out[key] = raw
            v += len(tag)
            if gap and s.startswith(gap, v):
                v += len(gap)
            if not s.startswith(after, v):
                return None, ""
            v += len(after)
            if s.startswith(nxt, v):
                pos = v + len(nxt)
            elif s.startswith(last, v):
                return v + len(last), json.dumps(out, ensure_ascii=False)
            else:
                return None, ""


def _unique_id(cid: str, taken: set[str]) -> str:
    """A call id the model wrote, or where an earlier call of the answer has it already,
    one of the same length and alphabet derived from it (the next turn's template takes it:
    Mistral's checks nine alphanumerics). A client matches results to calls by id; derived,
    not drawn, so every reading of one answer (a stream's deltas, the final message) gives
    the same."""
    out, n = cid, 0
    while out in taken:
        n += 1
        digest = hashlib.shake_256(f"{cid}:{n}".encode()).digest(len(cid))
        out = "".join(_ALNUM[b % len(_ALNUM)] for b in digest)
    return out


def _seg(segment: str) -> re.Pattern[str]:
    return re.compile("".join(f"({ID_CHARS}+)" if c == ID else re.escape(c) for c in segment),
                      re.S)


def _held(text: str, markers: Sequence[str]) -> int:
    """How many characters at the end of `text` could start one of `markers`."""
    hold = 0
    for m in markers:
        for k in range(min(len(m), len(text)), 0, -1):
            if text.endswith(m[:k]):
                hold = max(hold, k)
                break
    return hold
