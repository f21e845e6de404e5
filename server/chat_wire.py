"""OpenAI Chat Completions' and Completions' wire shapes as pydantic models: the request
bodies, which are the only parser of those two endpoints (`chat.to_request` turns a parsed
body into the neutral request), and the responses the OpenAPI document describes.

Types are strict, as the document says (no "1" for 1, no 1 for true); an integer may be
written 3.0. A body's fields the models do not name follow every API's policy
(`door.Unmodeled`): the ones OpenAI clients send that cannot change the answer (`user`,
`metadata`, `store`, ...) are accepted and ignored (`IGNORED`), the ones that would change
it are refused unless given their no-op value (`NOOP`), any other is a 400 naming it. A
message's, a tool's or an option object's own extra fields are accepted (clients send an
earlier answer back whole: `refusal`, `annotations`, ...).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Strict, Tag
from pydantic_core import PydanticCustomError

from specdec.types import FinishReason

from .door import Extensions, Float, Int, Seed, Unmodeled, integral, within_context
from .openapi import GENERATE_RESPONSES, sse

# -- requests ---------------------------------------------------------------------------------
# Fields OpenAI clients send that cannot change the answer: accepted and ignored.
IGNORED = frozenset({"metadata", "user", "store", "service_tier", "safety_identifier",
                     "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options"})
CHANGES = "it would change the output, and this server does not implement it"
# Fields that change what a request means and that this server does not implement: a 400
# naming them (never silently ignored), unless given their no-op value.
NOOP: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": ((None, []), "legacy function calling is not implemented: give tools"),
    "function_call": ((None, "none"), "legacy function calling is not implemented: give "
                                      "tool_choice"),
    "presence_penalty": ((None, 0, 0.0), CHANGES), "frequency_penalty": ((None, 0, 0.0), CHANGES),
    "repetition_penalty": ((None, 1, 1.0), CHANGES), "min_p": ((None, 0, 0.0), CHANGES),
    "best_of": ((None, 1), CHANGES), "echo": ((None, False), CHANGES),
    "suffix": ((None, ""), CHANGES), "prediction": ((None,), CHANGES),
    "audio": ((None,), "text output only"), "modalities": ((None, ["text"]), "text output only"),
    "verbosity": ((None, "medium"), "only the default verbosity"),
    "web_search_options": ((None,), "web search is not available here"),
    "moderation": ((None,), "moderation is not implemented"),
    "guided_decoding_backend": ((None,), CHANGES), "guided_whitespace_pattern": ((None,), CHANGES),
    # llama.cpp's top-level constraint fields: the constraint goes in `structured_outputs`
    **{k: ((None,), f'give it as structured_outputs: {{"{kind}": ...}}')
       for k, kind in (("grammar", "grammar"), ("json_schema", "json"), ("regex", "regex"))}}
CHAT_UNMODELED = Unmodeled(IGNORED, NOOP)
COMPLETION_UNMODELED = Unmodeled(IGNORED, {
    **NOOP, "response_format": ((None,), "/v1/completions takes no response_format; use "
                                         "structured_outputs"),
    "tools": ((None, []), "/v1/completions takes no tools")})
FAIL_FAST = Field(fail_fast=True)  # a long list's first bad item is its error, not every one
TOKEN_ID_DIGITS = 20  # a logit_bias key: a token id, written in at most this many digits


def _integral_items(v: Any) -> Any:
    """`integral` over a list at once (a prompt of token ids may be long: a list without
    floats is passed on as it is)."""
    if not isinstance(v, list) or float not in set(map(type, v)):
        return v
    return [integral(x) for x in v]


def _bias(v: Any) -> Any:
    """logit_bias: every key a token id in ASCII digits (no "²", no 5000 digits), every
    value a finite number; the first offender is the error (not one error per key)."""
    if not isinstance(v, dict):
        return v
    for k, b in v.items():
        if not (isinstance(k, str) and 0 < len(k) <= TOKEN_ID_DIGITS and k.isascii()
                and k.isdigit()):
            raise PydanticCustomError("logit_bias_key", "key {key} is not a token id (at "
                                      "most {n} ASCII digits)",
                                      {"key": repr(k[:24]) + ("..." if len(k) > 24 else ""),
                                       "n": TOKEN_ID_DIGITS})
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (-100 <= b <= 100):
            raise PydanticCustomError("logit_bias_value", "the bias of token {key} must be a "
                                      "number in [-100, 100]", {"key": k})
    return v


def _count(v: Any) -> Any:
    """An integer for a literal count (a literal 1 takes true as well, so true is refused
    here)."""
    if isinstance(v, bool):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return integral(v)


def _prompt_kind(v: Any) -> str:
    """Which of the prompt's forms a value is, by its JSON type (so that a bad token id is
    reported as such, not as every other form's mismatch)."""
    if isinstance(v, list) and v and isinstance(v[0], (str, list)):
        return "texts" if isinstance(v[0], str) else "batch"
    return "text" if isinstance(v, str) else "ids"


def _any_of(schema: dict[str, Any]) -> None:
    """The prompt's forms are documented as `anyOf`, as a plain union is (they are
    disjoint, so `oneOf` says no more)."""
    if "oneOf" in schema:
        schema["anyOf"] = schema.pop("oneOf")


TokenIds = Annotated[list[Annotated[int, Strict(), Field(ge=0)]],
                     Field(min_length=1, fail_fast=True), BeforeValidator(_integral_items),
                     within_context("token ids")]


class _Wire(BaseModel):
    model_config = ConfigDict(strict=True)  # as the document says: no "1" for 1, no 1 for true


class _Open(_Wire):
    model_config = ConfigDict(extra="allow")


class TextPart(_Wire):
    type: Literal["text"]
    text: str


Content = str | Annotated[list[TextPart], FAIL_FAST]


class SystemMessage(_Open):
    role: Literal["system", "developer"]
    content: Content = Field(description="text, or a list of text parts")
    name: str | None = None


class UserMessage(_Open):
    role: Literal["user"]
    content: Content = Field(description="text, or a list of text parts")
    name: str | None = None


class CalledFunction(_Open):
    name: str
    arguments: str = Field(description="JSON text")


class CallInHistory(_Open):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantTurn(_Open):
    role: Literal["assistant"]
    content: Content | None = Field(None, description="text, a list of text parts, or null")
    name: str | None = None
    tool_calls: Annotated[list[CallInHistory], FAIL_FAST] | None = None


class ToolResult(_Open):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


ChatMessage = Annotated[SystemMessage | UserMessage | AssistantTurn | ToolResult,
                        Field(discriminator="role")]


class StreamOptions(_Open):
    include_usage: bool | None = None


class JSONSchemaFormat(_Open):
    name: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Wire):
    """vLLM's structured outputs: exactly one kind."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: Annotated[list[str], FAIL_FAST] | None = None
    json_object: bool | None = None


class FunctionDef(_Open):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Wire):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Open):
    name: str


class NamedToolChoice(_Wire):
    type: Literal["function"]
    function: NamedFunction


class _Sampling(_Open):
    model: str | None = None
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Float | None = Field(None, ge=0, le=100)
    top_p: Float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=0, description="0 (or the vocabulary size, or more) "
                                                      "disables it")
    seed: Seed = None
    stop: Annotated[str, Field(min_length=1)] | Annotated[
        list[Annotated[str, Field(min_length=1)]], Field(max_length=4)] | None = Field(
        None, description="a non-empty string, or up to 4 of them")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Annotated[Literal[1], BeforeValidator(_count)] | None = Field(
        None, description="one choice per request")
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=f"^[0-9]{{1,{TOKEN_ID_DIGITS}}}$")],
                               Annotated[Float, Field(ge=-100, le=100)]],
                          BeforeValidator(_bias),
                          Field(json_schema_extra={"additionalProperties": False})] | None = Field(
        None, description="token id (a string of digits) -> bias in [-100, 100]")
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older spellings of structured_outputs' kinds
    guided_json: dict[str, Any] | bool | str | None = Field(
        None, description="structured_outputs.json")
    guided_regex: str | None = Field(None, description="structured_outputs.regex")
    guided_choice: Annotated[list[str], FAIL_FAST] | None = Field(
        None, description="structured_outputs.choice")
    guided_grammar: str | None = Field(None, description="structured_outputs.grammar")


class SamplingFields(Extensions, _Sampling):
    """What Chat Completions and Completions both take: sampling, the constraint, and ours."""


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra=CHAT_UNMODELED.document)
    messages: Annotated[list[ChatMessage], within_context("turns")] = Field(
        min_length=1, fail_fast=True)
    max_completion_tokens: Int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], FAIL_FAST] | None = None
    tool_choice: Literal["none", "required", "auto"] | NamedToolChoice | None = Field(
        None, description="'auto' (the default with tools): text or calls, the calls under "
                          "the tools' grammar; 'required': at least one call; a named "
                          "function: one call of it; 'none': the tools are ignored")
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="any but 'none' thinks before the answer (a template with a think "
                          "block; else 400); the answer follows the constraint")
    max_thinking_tokens: Int | None = Field(
        None, ge=0, description="thinking budget (implies thinking); then the end of "
                                "thinking is forced. Default: half max_tokens, at most the "
                                "server's --max-thinking-tokens")


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra=COMPLETION_UNMODELED.document)
    prompt: Annotated[
        Annotated[str, Tag("text"), Field(min_length=1)] | Annotated[TokenIds, Tag("ids")]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Tag("texts"),
                    Field(min_length=1, max_length=1)]
        | Annotated[list[TokenIds], Tag("batch"), Field(min_length=1, max_length=1)],
        Discriminator(_prompt_kind)] = Field(
        description="one prompt: text, or token ids of the model's vocabulary (or a list "
                    "holding one of them)", json_schema_extra=_any_of)
    logprobs: Int | None = Field(None, ge=0, le=20)


# -- responses --------------------------------------------------------------------------------


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = Field(None, description="the think block, when thinking")


class ChatChoice(BaseModel):
    index: int
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None
    message: AssistantMessage


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    specdec: dict[str, Any] = Field(description="seed, speculative statistics, warnings")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None
    text: str


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    specdec: dict[str, Any]


SSE = sse("with stream: true, server-sent events: each `data` a JSON chunk "
          "(chat.completion.chunk / text_completion; an error object after a failure), then "
          "`[DONE]`")
CHAT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": ChatCompletion, "content": SSE}, **GENERATE_RESPONSES}
COMPLETION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": Completion, "content": SSE}, **GENERATE_RESPONSES}
