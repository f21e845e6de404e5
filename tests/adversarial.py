"""What a hostile or careless client sends: one request body per entry, for one API, each
saying what an honest server answers. Used by tests/test_adversarial.py (every entry against
one server) and tests/loadfault.py (a share of the load-with-faults mix).

Every entry's answer is a 4xx in its API's error shape, or a 200 whose output is bounded by a
small `max_tokens`; never a 5xx, never a hang. Where either is honest (a grammar the server
may serve or refuse as too complex) the entry allows both, and names the 4xx's code where one
is promised. Bodies are built on first use (some are megabytes) and sent as JSON text written
here (`Entry.content`), so a value `json` writes but strict encoders refuse (NaN) goes out
as written.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Api = Literal["chat", "completions", "responses", "messages"]
PATHS: dict[str, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
                         "responses": "/v1/responses", "messages": "/v1/messages"}
VOCAB = 49152  # the embedded model's logits width: ids at or past it are out of range
MAX_TOKENS = 4  # a 200's bound: small, so the corpus is quick and every 200 is bounded
MSG = [{"role": "user", "content": "Answer briefly."}]


@dataclass(frozen=True)
class Expect:
    """An honest answer: a 200 (`ok`), and/or a 4xx (`status`, None: any 4xx) whose error
    code is `code` (None: any code)."""

    ok: bool = False
    refused: bool = True
    status: int | None = 400
    code: str | None = None

    def __str__(self) -> str:
        no = f"{self.status or '4xx'}" + (f" {self.code}" if self.code else "")
        return " or ".join((["200 (bounded)"] if self.ok else []) + ([no] if self.refused else []))


OK = Expect(ok=True, refused=False)


def refused(code: str | None = None, status: int | None = 400) -> Expect:
    return Expect(status=status, code=code)


def ok_or(code: str | None = None, status: int | None = 400) -> Expect:
    return Expect(ok=True, status=status, code=code)


TOO_COMPLEX = "grammar_too_complex"  # a grammar over its budget (the scheduler's code)


@dataclass(frozen=True)
class Entry:
    """One hostile request.

    Attributes:
        name: short id (a test's id). api: which API it is a body for.
        expect: what an honest server answers. why: what the client does wrong.
        build: the body (called once; bodies can be large).
    """

    name: str
    api: Api
    expect: Expect
    why: str
    build: Callable[[], dict[str, Any]]

    @property
    def path(self) -> str:
        return PATHS[self.api]

    @functools.cached_property
    def body(self) -> dict[str, Any]:
        return self.build()

    @functools.cached_property
    def content(self) -> bytes:
        """The body as JSON text (NaN written as `json` writes it)."""
        return json.dumps(self.body).encode()

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def max_tokens(self) -> int | None:
        """The output bound a 200 must respect."""
        b = self.body
        return b.get("max_tokens") or b.get("max_output_tokens") or b.get(
            "max_completion_tokens")


# -- builders ---------------------------------------------------------------------------------
def chat(**fields: Any) -> Callable[[], dict[str, Any]]:
    return lambda: {"messages": MSG, "max_tokens": MAX_TOKENS, "temperature": 0, **fields}


def grammar(text: str, **fields: Any) -> Callable[[], dict[str, Any]]:
    return chat(structured_outputs={"grammar": text}, **fields)


def regex(pattern: str) -> Callable[[], dict[str, Any]]:
    return chat(structured_outputs={"regex": pattern})


def schema_body(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def schema(make: Callable[[], Any], **fields: Any) -> Callable[[], dict[str, Any]]:
    return lambda: {**chat(**fields)(), "response_format": schema_body(make())}


def responses(**fields: Any) -> Callable[[], dict[str, Any]]:
    return lambda: {"input": "Answer briefly.", "max_output_tokens": MAX_TOKENS,
                    "temperature": 0, **fields}


def messages(**fields: Any) -> Callable[[], dict[str, Any]]:
    return lambda: {"model": "default", "messages": MSG, "max_tokens": MAX_TOKENS,
                    "temperature": 0, **fields}


def late(make: Callable[[], dict[str, Any]], **lazy: Callable[[], Any]
         ) -> Callable[[], dict[str, Any]]:
    """`make()` with fields whose values are built when the body is."""
    return lambda: {**make(), **{k: f() for k, f in lazy.items()}}


def enum_schema(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {"pick": {"enum": [f"value_{i}" for i in range(n)]}},
            "required": ["pick"], "additionalProperties": False}


def ref_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string", "maxLength": 8}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested_by_refs(n: int) -> dict[str, Any]:
    """Arrays nested `n` deep through a chain of refs: a shallow body, a deep grammar."""
    defs: dict[str, Any] = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}}
                            for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested_arrays(depth: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        s = {"type": "array", "items": s, "maxItems": 2}
    return s


TREE = {"$defs": {"node": {"type": "object", "properties": {
    "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    "required": ["v", "kids"], "additionalProperties": False}}, "$ref": "#/$defs/node"}
ENDLESS = {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/a"}},
                           "required": ["b"], "additionalProperties": False}},
           "$ref": "#/$defs/a"}  # every instance holds another: none is finite


def wide_object(n: int) -> dict[str, Any]:
    props = {f"field_{i}": {"type": "string", "maxLength": 4} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def tool(i: int, params: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Does task number {i} of the catalogue.",
        "parameters": params or {"type": "object", "properties": {
            "city": {"type": "string"}, "count": {"type": "integer"}}, "required": ["city"]}}}


def tools(n: int) -> list[dict[str, Any]]:
    return [tool(i) for i in range(n)]


def flat_tools(n: int) -> list[dict[str, Any]]:
    """Responses' tool shape: the function's fields at the tool's top level."""
    return [{"type": "function", **tool(i)["function"]} for i in range(n)]


def anthropic_tools(n: int) -> list[dict[str, Any]]:
    return [{"name": f"tool_{i}", "description": f"Does task number {i}.",
             "input_schema": tool(i)["function"]["parameters"]} for i in range(n)]


AMBIGUOUS = "start: e\ne: e e | /[a-z]/"  # every split of the text is a parse: exponential
EXPRESSIONS = 'start: e\ne: e "+" e | e "*" e | "(" e ")" | /[0-9]+/'
NO_EOS = {"0": -100, "2": -100}  # the embedded model's end-of-output ids, banned
BIG = 10 ** 400  # a number no parameter takes; as JSON, 401 digits

# -- the corpus -------------------------------------------------------------------------------
ENTRIES: tuple[Entry, ...] = (
    # Grammars whose masks grow with the output (ambiguous, nested repetitions).
    Entry("grammar_ambiguous_short", "chat", ok_or(TOO_COMPLEX),
          "an exponentially ambiguous Lark grammar, a few tokens", grammar(AMBIGUOUS)),
    Entry("grammar_ambiguous_long", "chat", ok_or(TOO_COMPLEX),
          "the same grammar, the end of output banned: its masks grow with every token",
          grammar(AMBIGUOUS, max_tokens=32, logit_bias=NO_EOS)),
    Entry("grammar_ambiguous_stream", "chat", ok_or(TOO_COMPLEX),
          "the same, streamed: a failure is an error event",
          grammar(AMBIGUOUS, max_tokens=16, logit_bias=NO_EOS, stream=True,
                  stream_options={"include_usage": True})),
    Entry("grammar_ambiguous_expressions", "chat", ok_or(TOO_COMPLEX),
          "binary operators without precedence", grammar(EXPRESSIONS, max_tokens=16)),
    Entry("grammar_nested_optional_repetition", "chat", ok_or(TOO_COMPLEX),
          "optional items in nested stars", grammar('start: (("a"? "b"?)*)*', max_tokens=16)),
    Entry("grammar_nested_star_rules", "chat", ok_or(TOO_COMPLEX),
          "rules of stars of nullable rules",
          grammar('start: x*\nx: y*\ny: "a"? | "b"*', max_tokens=16)),
    Entry("grammar_dead_end", "chat", refused(),
          "compiles and its first mask allows text, but nothing can follow it",
          grammar('start: "ab" /[^\\s\\S]/')),
    Entry("grammar_no_base_case", "chat", ok_or(),
          "a rule that only recurses: no finite text matches", grammar('start: "a" start')),
    Entry("grammar_not_lark", "chat", refused("invalid_grammar"), "not a grammar",
          grammar("start: (((")),
    # Pathological regular expressions.
    Entry("regex_alternation_star", "chat", OK, "(a|aa)*b: backtracking's worst case",
          regex("(a|aa)*b")),
    Entry("regex_nested_quantifiers", "chat", OK, "((a*)*)*b", regex("((a*)*)*b")),
    Entry("regex_overlapping_pluses", "chat", OK, "(x+x+)+y", regex("(x+x+)+y")),
    Entry("regex_dot_star_repeated", "chat", OK, "(.*){1000}", regex("(.*){1000}")),
    Entry("regex_counted_million", "chat", ok_or(), "a{1000000}", regex("a{1000000}")),
    Entry("regex_counted_nested", "chat", ok_or(), "((a{100}){100}){100}: a million states",
          regex("((a{100}){100}){100}")),
    Entry("regex_lookbehind", "chat", refused("invalid_grammar"), "a construct no DFA has",
          regex("(?<=a)b")),
    Entry("schema_pattern_pathological", "chat", ok_or(), "a string pattern (a|aa)*b{1,100000}",
          schema(lambda: {"type": "string", "pattern": "^(a|aa)*b{1,100000}$"})),
    # JSON schemas: huge enums, ref chains and cycles, recursion, nesting.
    Entry("schema_enum_20k", "chat", ok_or(), "an enum of 20,000 strings",
          schema(lambda: enum_schema(20_000))),
    Entry("schema_enum_50k_integers", "chat", ok_or(), "an enum of 50,000 integers",
          schema(lambda: {"enum": list(range(50_000))})),
    Entry("choice_10k", "chat", ok_or(), "10,000 choices",
          chat(structured_outputs={"choice": [f"option number {i}" for i in range(10_000)]})),
    Entry("schema_ref_chain_1000", "chat", ok_or(), "$ref -> $ref -> ... 1000 deep",
          schema(lambda: ref_chain(1000))),
    Entry("schema_ref_cycle", "chat", refused("invalid_grammar"),
          "two $defs that only refer to each other", schema(lambda: {
              "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
              "$ref": "#/$defs/a"})),
    Entry("schema_self_ref", "chat", refused("invalid_grammar"), '{"$ref": "#"}',
          schema(lambda: {"$ref": "#"})),
    Entry("schema_recursive_tree", "chat", OK, "a recursive tree of nodes (its minimum is 12)",
          schema(lambda: TREE, max_tokens=16)),
    Entry("schema_endless_object", "chat", ok_or(),
          "an object that must hold itself: no finite instance", schema(lambda: ENDLESS)),
    Entry("schema_nested_near_depth_limit", "chat", ok_or(),
          "arrays nested 122 deep: the body 126 levels deep, its limit 128",
          schema(lambda: nested_arrays(122))),
    Entry("schema_nested_past_depth_limit", "chat", refused(),
          "arrays nested 130 deep: the body past its nesting limit",
          schema(lambda: nested_arrays(130))),
    Entry("schema_nested_by_refs_1000", "chat", ok_or(),
          "arrays nested 1000 deep through refs (a shallow body)",
          schema(lambda: nested_by_refs(1000))),
    Entry("schema_2000_required_properties", "chat", ok_or(),
          "an object with 2,000 required properties", schema(lambda: wide_object(2000))),
    # logit_bias: every token, out of range, keys and values no token id or bias is.
    Entry("logit_bias_every_token", "chat", ok_or(), "a bias for every token id",
          late(chat(), logit_bias=lambda: {str(i): 1.0 for i in range(VOCAB)})),
    Entry("logit_bias_every_token_banned", "chat", ok_or(), "every token id at -100",
          late(chat(), logit_bias=lambda: {str(i): -100 for i in range(VOCAB)})),
    Entry("logit_bias_out_of_range", "chat", refused(), "ids past the vocabulary",
          chat(logit_bias={str(VOCAB): 5, "99999999999": 1})),
    Entry("logit_bias_superscript_key", "chat", refused(), "the key '²' (a Unicode digit)",
          chat(logit_bias={"²": 1})),
    Entry("logit_bias_5000_digit_key", "chat", refused(), "a key 5000 digits long",
          chat(logit_bias={"9" * 5000: 1})),
    Entry("logit_bias_bad_keys", "chat", refused(), "keys that are no integer",
          chat(logit_bias={"-1": 1, "abc": 2, "1.5": 3})),
    Entry("logit_bias_nan", "chat", refused(), "a NaN bias", chat(logit_bias={"1": float("nan")})),
    # Numbers no parameter takes.
    Entry("temperature_400_digits", "chat", refused(), "temperature as a 401-digit integer",
          chat(temperature=BIG)),
    Entry("top_p_400_digits", "chat", refused(), "top_p as a 401-digit integer", chat(top_p=BIG)),
    Entry("temperature_nan", "chat", refused(), "temperature NaN", chat(temperature=float("nan"))),
    Entry("top_k_huge", "chat", ok_or(), "top_k 10^20 (past every vocabulary)",
          chat(top_k=10 ** 20, temperature=0.7, seed=1)),
    Entry("seed_past_64_bits", "chat", refused(), "seed 2^70", chat(seed=2 ** 70)),
    Entry("max_tokens_billion", "chat", refused("context_length_exceeded"), "max_tokens 10^9",
          chat(max_tokens=10 ** 9)),
    Entry("max_tokens_400_digits", "chat", refused(), "max_tokens as a 401-digit integer",
          chat(max_tokens=BIG)),
    Entry("n_million", "chat", refused(), "n = 1,000,000 choices", chat(n=1_000_000)),
    # Stop strings: thousands, and long ones.
    Entry("stop_thousands", "chat", refused(), "5,000 stop strings",
          chat(stop=[f"stop-{i}" for i in range(5000)])),
    Entry("stop_one_megabyte", "chat", ok_or(), "one stop string of a million characters",
          late(chat(), stop=lambda: "x" * 1_000_000)),
    Entry("messages_stop_thousands", "messages", ok_or(), "5,000 stop sequences",
          messages(stop_sequences=[f"stop-{i}" for i in range(5000)])),
    Entry("messages_stop_long", "messages", ok_or(), "ten stop sequences of 100,000 characters",
          late(messages(), stop_sequences=lambda: [chr(97 + i) * 100_000 for i in range(10)])),
    # Tools: hundreds, and huge parameter schemas.
    Entry("tools_300", "chat", refused(), "300 tools (their prompt past the context)",
          late(chat(), tools=lambda: tools(300))),
    Entry("tools_300_choice_none", "chat", ok_or(), "300 tools, tool_choice none",
          late(chat(tool_choice="none"), tools=lambda: tools(300))),
    Entry("tools_huge_parameters", "chat", refused(), "one tool with 3,000 parameters",
          late(chat(), tools=lambda: [tool(0, wide_object(3000))])),
    Entry("tools_duplicate_names", "chat", refused(), "two tools of one name",
          late(chat(), tools=lambda: [tool(0), tool(0)])),
    Entry("responses_tools_300", "responses", refused(), "300 tools",
          late(responses(), tools=lambda: flat_tools(300))),
    Entry("messages_tools_300", "messages", refused(), "300 tools",
          late(messages(), tools=lambda: anthropic_tools(300))),
    # Prompts past the context (refused before or after tokenizing: any 4xx).
    Entry("message_one_megabyte", "chat", refused(status=None),
          "a user message of a million characters", lambda: {
              **chat()(), "messages": [{"role": "user", "content": "word " * 200_000}]}),
    Entry("messages_20k", "chat", refused(status=None), "20,000 short turns",
          lambda: {**chat()(), "messages": [{"role": "user", "content": "hi"}] * 20_000}),
    Entry("completion_ids_out_of_range", "completions", refused(), "prompt ids past the vocabulary",
          lambda: {"prompt": [1, VOCAB, 10 ** 12], "max_tokens": MAX_TOKENS}),
    Entry("completion_ids_100k", "completions", refused(status=None),
          "a prompt of 100,000 token ids", lambda: {"prompt": [42] * 100_000,
                                                     "max_tokens": MAX_TOKENS}),
    # The other APIs: the same hostile values in their fields.
    Entry("responses_enum_20k", "responses", ok_or(), "an enum of 20,000 strings",
          lambda: {**responses()(), "text": {"format": {
              "type": "json_schema", "name": "x", "schema": enum_schema(20_000)}}}),
    Entry("responses_ref_cycle", "responses", refused("invalid_grammar"),
          "two $defs that only refer to each other", responses(text={"format": {
              "type": "json_schema", "name": "x", "schema": {
                  "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                  "$ref": "#/$defs/a"}}})),
    Entry("responses_max_output_tokens_billion", "responses",
          refused("context_length_exceeded"), "max_output_tokens 10^9",
          responses(max_output_tokens=10 ** 9)),
    Entry("responses_temperature_400_digits", "responses", refused(),
          "temperature as a 401-digit integer", responses(temperature=BIG)),
    Entry("messages_enum_20k", "messages", ok_or(), "an enum of 20,000 strings",
          lambda: {**messages()(), "output_config": {"format": {
              "type": "json_schema", "schema": enum_schema(20_000)}}}),
    Entry("messages_endless_object", "messages", ok_or(),
          "an object that must hold itself", messages(output_config={"format": {
              "type": "json_schema", "schema": ENDLESS}})),
    Entry("messages_max_tokens_billion", "messages", refused("context_length_exceeded"),
          "max_tokens 10^9", messages(max_tokens=10 ** 9)),
    Entry("messages_top_k_400_digits", "messages", ok_or(), "top_k as a 401-digit integer",
          messages(top_k=BIG)),
)

BY_NAME = {e.name: e for e in ENTRIES}
assert len(BY_NAME) == len(ENTRIES), "entry names are unique"


# -- judging an answer ------------------------------------------------------------------------
def judge(entry: Entry, status: int, text: str) -> str | None:
    """What is wrong with `status` and body `text` as the answer to `entry` (None: nothing):
    a 5xx; a 4xx not in the API's error shape, not allowed, or of another code; a 200 not
    allowed, malformed, or with more output than its `max_tokens`; a stream's error event
    judged as its 4xx would be. Streamed entries are Chat Completions'."""
    if status >= 500:
        return f"a {status}: {text[:300]}"
    if 400 <= status < 500:
        return _judge_error(entry, status, text)
    if status != 200:
        return f"status {status}: {text[:300]}"
    if not entry.expect.ok and not entry.stream:
        return f"a 200 where {entry.expect} was expected: {text[:300]}"
    try:
        if entry.stream:
            return _judge_stream(entry, text)
        body = json.loads(text)
        usage = body["usage"]
        n = usage["completion_tokens"] if entry.api in ("chat", "completions") else \
            usage["output_tokens"]
    except (ValueError, KeyError, TypeError) as e:
        return f"a malformed 200 ({type(e).__name__}: {e}): {text[:300]}"
    if entry.max_tokens is not None and n > entry.max_tokens:
        return f"{n} output tokens, over max_tokens {entry.max_tokens}"
    return None


def error_of(api: Api, body: Any) -> dict[str, Any] | None:
    """The error object of an API's error shape (OpenAI's `{"error": {message, type, param,
    code}}`, Anthropic's `{"type": "error", "error": {type, message}}`), or None."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return None
    err = body["error"]
    keys = {"type", "message"} if api == "messages" else {"message", "type", "param", "code"}
    if api == "messages" and body.get("type") != "error" or not keys <= set(err):
        return None
    return err


def _judge_error(entry: Entry, status: int, text: str) -> str | None:
    try:
        err = error_of(entry.api, json.loads(text))
    except ValueError:
        err = None
    if err is None:
        return f"a {status} not in the API's error shape: {text[:300]}"
    return _judge_refusal(entry.expect, f"a {status}", status, err, text)


def _judge_refusal(want: Expect, what: str, status: int | None, err: dict[str, Any],
                   text: str) -> str | None:
    if not want.refused:
        return f"{what} where a 200 was expected: {text[:300]}"
    if want.status is not None and status is not None and status != want.status:
        return f"{what} where a {want.status} was expected: {text[:300]}"
    if want.code is not None and err.get("code") != want.code:
        return f"{what} of code {err.get('code')!r}, not {want.code!r}: {text[:300]}"
    return None


def _judge_stream(entry: Entry, text: str) -> str | None:
    events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return f"a stream that does not end with [DONE]: {text[-300:]}"
    for data in events[:-1]:
        ev = json.loads(data)
        err = ev.get("error") if isinstance(ev, dict) else None
        if isinstance(err, dict):
            if err.get("type") == "server_error":
                return f"a server error event in the stream: {data[:300]}"
            return _judge_refusal(entry.expect, "an error event", None, err, data)
        usage = ev.get("usage")
        if usage and entry.max_tokens is not None and \
                usage["completion_tokens"] > entry.max_tokens:
            return f"{usage['completion_tokens']} output tokens, over {entry.max_tokens}"
    if not entry.expect.ok:
        return f"a stream where {entry.expect} was expected"
    return None
