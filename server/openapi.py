"""Chat Completions' and Completions' request and response shapes, and the OpenAPI document.

The chat handlers parse bodies themselves (`protocol.py`: every bad field is a 400 in
OpenAI's error shape, and the body-size and nesting limits apply before parsing), so these
pydantic models only document what those endpoints take and give back: `openapi()` puts
them into the app's OpenAPI document, which clients, generators and the fuzz tests read.
Extra request fields are allowed (OpenAI clients send `user`, `metadata`, `store`, ...):
the ones that would change the output are refused by name (`protocol.UNIMPLEMENTED`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# -- requests ---------------------------------------------------------------------------------


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(BaseModel):
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


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
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


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: dict[str, str]


class _Sampling(_Open):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    stop: Annotated[str, Field(min_length=1)] | Annotated[
        list[Annotated[str, Field(min_length=1)]], Field(max_length=4)] | None = Field(
        None, description="a non-empty string, or up to 4 of them")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Literal[1] | None = None
    logit_bias: Annotated[dict[Annotated[str, Field(pattern="^[0-9]+$")],
                               Annotated[float, Field(ge=-100, le=100)]],
                          Field(json_schema_extra={"additionalProperties": False})] | None = Field(
        None, description="token id (a string of digits) -> bias in [-100, 100]")
    structured_outputs: StructuredOutputs | None = None
    num_draft_tokens: int | None = Field(None, ge=0, le=16, description="0: plain decoding")
    draft_masking: bool | None = None
    prompt_lookup: bool | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "required", "auto"] | NamedToolChoice | None = Field(
        None, description="'auto' (the default with tools) is refused (400) for now: give "
                          "'required' or a named function")
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="any but 'none' thinks before the answer (a template with a think "
                          "block; else 400); the answer follows the constraint")
    max_thinking_tokens: int | None = Field(
        None, ge=0, description="thinking budget (implies thinking); then the end of "
                                "thinking is forced. Default: half max_tokens, at most the "
                                "server's --max-thinking-tokens")


class CompletionRequest(_Sampling):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[
        list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | Annotated[
        list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)] | Annotated[
        list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]],
        Field(min_length=1, max_length=1)] = Field(
        description="one prompt: text, or token ids of the model's vocabulary (or a list "
                    "holding one of them)")
    logprobs: int | None = Field(None, ge=0, le=20)


# -- responses --------------------------------------------------------------------------------


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


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


class Health(BaseModel):
    status: Literal["ok"]
    model: str
    queue_depth: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


def check(model: type[BaseModel], body: Any) -> None:
    """Refuse a body the document does not describe (a wrong type, a value out of range):
    the handlers' own parsing names most mistakes first; this catches the rest, so nothing
    the document forbids is silently accepted.

    Raises:
        APIError: 400 naming the first offending field.
    """
    from pydantic import ValidationError

    from .errors import bad_request

    try:
        model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
        raise bad_request(f"{path.lstrip('.')}: {err['msg']}", str(err["loc"][0])
                          if err["loc"] else None) from None


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    why = {400: "invalid request (OpenAI's error shape, `param` names the field)",
           401: "missing or wrong API key", 404: "unknown model or path",
           413: "request body too large", 503: "queue full (with Retry-After)",
           504: "the request's time limit passed"}
    return {c: {"model": ErrorResponse, "description": why[c]} for c in codes}


SSE = {"text/event-stream": {
    "description": "with stream: true, server-sent events: each `data` a JSON chunk "
                   "(chat.completion.chunk / text_completion; an error object after a "
                   "failure), then `[DONE]`",
    "schema": {"type": "object", "required": ["data"],
               "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}
GENERATE_RESPONSES = error_responses(400, 401, 404, 413, 503, 504)
CHAT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": ChatCompletion, "content": SSE}, **GENERATE_RESPONSES}
COMPLETION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": Completion, "content": SSE}, **GENERATE_RESPONSES}


def openapi(app: Any, bodies: dict[str, type[BaseModel]], vocab_size: int | None = None
            ) -> dict[str, Any]:
    """The app's OpenAPI document with the request bodies the handlers parse (`bodies`:
    path -> model; prompt token ids bounded by the served model's `vocab_size`)."""
    from fastapi.openapi.utils import get_openapi

    if app.openapi_schema:
        return app.openapi_schema  # type: ignore[no-any-return]
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="OpenAI-compatible constrained decoding")
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in bodies.items():
        js = model.model_json_schema(ref_template="#/components/schemas/{model}",
                                     by_alias=True)
        defs = js.pop("$defs", {})
        clash = [k for k, v in defs.items() if components.get(k, v) != v]
        assert not clash, f"two request models define components {clash} differently"
        components.update(defs)
        components[model.__name__] = js
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    if vocab_size is not None:
        ids = components["CompletionRequest"]["properties"]["prompt"]["anyOf"][1]["items"]
        ids["maximum"] = vocab_size - 1
    app.openapi_schema = doc
    return doc
