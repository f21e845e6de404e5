"""OpenAI Responses' request body as pydantic models: the only parser of `/v1/responses`
(`responses` turns it into the neutral request), following the `openai` SDK's types; and
the fields the model does not name: those this server ignores, or refuses unless given
their no-op value (`UNMODELED`, the policy every API follows: `door.Unmodeled`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, GetCoreSchemaHandler,
                      PrivateAttr)
from pydantic import GetJsonSchemaHandler
from pydantic_core import CoreSchema, PydanticCustomError, core_schema

from .door import Extensions, Float, Int, Seed, Unmodeled, within_context

# Official fields that would change the output: their no-op values, and why others are refused.
NOOP: dict[str, tuple[tuple[Any, ...], str]] = {
    "include": ((None, []), "no includable extras (logprobs, encrypted reasoning) are given"),
    "truncation": ((None, "disabled"), "input is never truncated (too long is a 400)"),
    "prompt": ((None,), "stored prompt templates are not available"),
    "top_logprobs": ((None,), "logprobs are not implemented on this endpoint"),
    "context_management": ((None, []), "context compaction is not implemented"),
    "moderation": ((None,), "moderation is not implemented")}
IGNORED = frozenset({"metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key",
                     "prompt_cache_retention", "prompt_cache_options", "stream_options",
                     "background_options", "image", "access_programs"})
UNMODELED = Unmodeled(IGNORED, NOOP)
FAIL_FAST = Field(fail_fast=True)  # a long list's first bad item is its error, not every one


class _Wire(BaseModel):
    """Scalars as the document types them: no "1" for 1, no 1 for true."""

    model_config = ConfigDict(strict=True)

@dataclass(frozen=True)
class OneOf:
    """A `type` string that names the value it refuses (pydantic's literal error does not),
    documented as an enum."""

    allowed: tuple[str, ...]

    def check(self, v: str) -> str:
        if v not in self.allowed:
            raise PydanticCustomError("unsupported", f"type {v!r} is not supported here: "
                                      f"expected one of {list(self.allowed)}")
        return v

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler
                                     ) -> CoreSchema:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler
                                     ) -> dict[str, Any]:
        return {**handler(schema), "enum": list(self.allowed)}


class Part(_Wire):
    model_config = ConfigDict(extra="ignore")  # an echoed output's annotations, logprobs
    type: Annotated[str, OneOf(("input_text", "output_text", "reasoning_text", "summary_text"))]
    text: str


def _or_text(schema: dict[str, Any]) -> None:
    """Document what a text-or-list field's before-validator takes: a string, or the list."""
    items = {k: schema.pop(k) for k in ("type", "items") if k in schema}
    schema["anyOf"] = [{"type": "string"}, items]


Parts = Annotated[list[Part], FAIL_FAST, BeforeValidator(
    lambda v: [{"type": "input_text", "text": v}] if isinstance(v, str) else v),
    Field(json_schema_extra=_or_text)]


NEEDS = {"function_call": ("call_id", "name"), "function_call_output": ("call_id",),
         "item_reference": ("id",)}


class InputItem(_Wire):
    """One `input` item; no `type` is a message (the SDK's EasyInputMessage). Items sent back
    from an earlier output carry ids (kept where the response is stored) and statuses
    (ignored); an `item_reference` names a stored item by its `id`."""

    model_config = ConfigDict(extra="ignore")
    type: Annotated[str, OneOf(("message", "function_call", "function_call_output",
                                "reasoning", "item_reference"))] = "message"
    id: str | None = None
    role: Literal["user", "system", "developer", "assistant"] = "user"
    content: Parts = Field(default_factory=list, description="text, or text parts")
    call_id: str = ""
    name: str = ""
    arguments: str = "{}"
    output: Parts = Field(default_factory=list, description="a function call's result")
    summary: Annotated[list[Part], FAIL_FAST] = Field(default_factory=list)


class FunctionTool(_Wire):
    model_config = ConfigDict(extra="ignore")
    type: Annotated[str, OneOf(("function",))]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Wire):
    type: Annotated[str, OneOf(("function",))]
    name: str


class TextFormat(_Wire):
    model_config = ConfigDict(extra="ignore")
    type: Annotated[str, OneOf(("text", "json_object", "json_schema"))]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="false or absent: unsupported keywords "
                                                  "are warnings, not a 400")


class TextConfig(_Wire):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = Field(None, description="only the default")


class ReasoningConfig(_Wire):
    model_config = ConfigDict(extra="ignore")
    effort: str | None = Field(None, description="any but 'none' thinks before the answer")
    summary: str | None = None


def _turns(items: list[Any]) -> int:
    """Input items that cost a token each at least (a reasoning item joins the next
    assistant turn, and a template may drop it)."""
    return sum(not (isinstance(i, dict) and i.get("type") == "reasoning") for i in items)


class ConversationRef(_Wire):
    model_config = ConfigDict(extra="ignore")
    id: str


class _Request(_Wire):
    model: str | None = None
    store: bool | None = Field(None, description="absent or true: the response is stored")
    previous_response_id: str | None = None
    conversation: str | ConversationRef | None = None
    input: Annotated[list[InputItem], FAIL_FAST, BeforeValidator(
        lambda v: [{"content": v}] if isinstance(v, str) else v),
        within_context("input items", _turns)] = Field(
        description="text, or a list of items", json_schema_extra=_or_text)
    instructions: str | None = None
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], FAIL_FAST] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice = "auto"
    parallel_tool_calls: bool | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: Float | None = Field(None, ge=0, le=100, description="default 1")
    top_p: Float | None = Field(None, gt=0, le=1)
    reasoning: ReasoningConfig | None = None
    stream: bool | None = None
    background: bool | None = Field(None, description="true: answered at once (queued), "
                                    "then polled, streamed or cancelled by id; needs store")
    max_tool_calls: Int | None = Field(None, ge=0, description="accepted and ignored: "
                                                               "built-in tools only")
    seed: Seed = None
    top_k: Int | None = Field(None, ge=0)


class ResponsesRequest(Extensions, _Request):
    """The body of `POST /v1/responses` (unknown fields are refused by name after parsing)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=UNMODELED.document)
    max_thinking_tokens: Int | None = Field(None, ge=0, description="implies thinking")
    chat_template_kwargs: dict[str, Any] | None = None
    # what the request continues and keeps (`responses.Turn`), once read from the store
    _turn: Any = PrivateAttr(None)

    @property
    def turn(self) -> Any:
        return self._turn

    @turn.setter
    def turn(self, value: Any) -> None:
        self._turn = value
