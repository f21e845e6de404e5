"""OpenAI Chat Completions' and Completions' wire shapes as pydantic models: the request
bodies, which are the only parser of those two endpoints (`protocol` turns a parsed body
into the neutral request), and the responses the OpenAPI document describes.

Types are strict, as the document says (no "1" for 1, no 1 for true); an integer may be
written 3.0. Extra request fields are allowed (OpenAI clients send `user`, `metadata`,
`store`, ...): the ones that would change the output are refused by name
(`protocol.UNIMPLEMENTED`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from .openapi import GENERATE_RESPONSES

# -- requests ---------------------------------------------------------------------------------


def _integral(v: Any) -> Any:
    """JSON Schema's integer includes 3.0 (generators and some clients write it so)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


Int = Annotated[int, BeforeValidator(_integral)]


class _Wire(BaseModel):
    model_config = ConfigDict(strict=True)  # as the document says: no "1" for 1, no 1 for true


class _Open(_Wire):
    model_config = ConfigDict(extra="allow")


class TextPart(_Wire):
    type: Literal["text"]
    text: str


Content = str | list[TextPart]


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
    tool_calls: list[CallInHistory] | None = None


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
    choice: list[str] | None = None
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
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=0)
    seed: Int | None = Field(None, ge=0, le=2**64 - 1)
    stop: Annotated[str, Field(min_length=1)] | Annotated[
        list[Annotated[str, Field(min_length=1)]], Field(max_length=4)] | None = Field(
        None, description="a non-empty string, or up to 4 of them")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Annotated[Literal[1], BeforeValidator(_integral)] | None = Field(
        None, description="one choice per request")
    logit_bias: Annotated[dict[Annotated[str, Field(pattern="^[0-9]+$")],
                               Annotated[float, Field(ge=-100, le=100)]],
                          Field(json_schema_extra={"additionalProperties": False})] | None = Field(
        None, description="token id (a string of digits) -> bias in [-100, 100]")
    structured_outputs: StructuredOutputs | None = None
    num_draft_tokens: Int | None = Field(None, ge=0, le=16, description="0: plain decoding")
    draft_masking: bool | None = None
    prompt_lookup: bool | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
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


class CompletionRequest(_Sampling):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[
        list[Annotated[Int, Field(ge=0)]], Field(min_length=1)] | Annotated[
        list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)] | Annotated[
        list[Annotated[list[Annotated[Int, Field(ge=0)]], Field(min_length=1)]],
        Field(min_length=1, max_length=1)] = Field(
        description="one prompt: text, or token ids of the model's vocabulary (or a list "
                    "holding one of them)")
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


FinishReason = Literal["stop", "length", "tool_calls"] | None


class ChatChoice(BaseModel):
    index: int
    finish_reason: FinishReason
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
    finish_reason: FinishReason
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


SSE = {"text/event-stream": {
    "description": "with stream: true, server-sent events: each `data` a JSON chunk "
                   "(chat.completion.chunk / text_completion; an error object after a "
                   "failure), then `[DONE]`",
    "schema": {"type": "object", "required": ["data"],
               "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}
CHAT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": ChatCompletion, "content": SSE}, **GENERATE_RESPONSES}
COMPLETION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": Completion, "content": SSE}, **GENERATE_RESPONSES}
