"""Anthropic Messages' request bodies as pydantic models: the only parser of
`/v1/messages` and `/v1/messages/count_tokens` (`messages` turns them into the neutral
request). They follow the `anthropic` SDK's shapes (2.15). A body's fields the models do not
name follow every API's policy (`door.Unmodeled`): those the official API takes that do
not change the output are accepted and ignored (`IGNORED`), those that would are refused
unless given their no-op value (`NOOP`), any other is a 400 naming it; a block's, a turn's
or a tool's unknown fields are refused by the models themselves.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from .door import Extensions, Float, Int, Seed, Unmodeled, within_context

BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking"),
          "system": ("text",)}
# A body's fields beyond the models': accepted and ignored (they do not change the output
# here), or refused unless given their no-op value.
IGNORED = frozenset({"metadata", "cache_control", "container", "diagnostics", "inference_geo",
                     "service_tier", "speed", "user_profile_id", "workspace_id"})
NOOP: dict[str, tuple[tuple[Any, ...], str]] = {
    "context_management": ((None,), "context editing is not implemented"),
    "mcp_servers": ((None, []), "MCP servers are not available here")}
UNMODELED = Unmodeled(IGNORED, NOOP)


# -- the wire: requests -----------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # no "1" for 1, no 1 for true


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # cache_control, citations, ...


FAIL_FAST = Field(fail_fast=True)  # a long list's first bad item is its error, not every one


def _as_blocks(v: Any, allowed: tuple[str, ...]) -> Any:
    """A string is one text block; a block type we do not serve is refused by name (here,
    so the error says which block, not which union member failed)."""
    if isinstance(v, str):
        return [{"type": "text", "text": v}]
    for i, b in enumerate(v if isinstance(v, list) else ()):
        kind = b.get("type") if isinstance(b, dict) else None
        if isinstance(kind, str) and kind not in allowed:
            raise PydanticCustomError(
                "unsupported_block", "block {i} is of type '{kind}', which this server does "
                "not take here (only {allowed})", {"i": i, "kind": kind,
                                                   "allowed": ", ".join(allowed)})
    return v


class TextBlock(_Block):
    type: Literal["text"]
    text: str


TextBlocks = Annotated[list[TextBlock], FAIL_FAST, BeforeValidator(  # string or blocks
    lambda v: _as_blocks(v, ("text",)), json_schema_input_type=str | list[TextBlock])]


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: TextBlocks = []  # `is_error` is ignored: the text says what failed


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str  # its `signature` is ours to ignore: we made none


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                  Field(discriminator="type")]


class Turn(_Strict):
    role: Literal["user", "assistant", "system"]
    content: Annotated[list[Block], FAIL_FAST]

    @field_validator("content", mode="before", json_schema_input_type=str | list[Block])
    @classmethod
    def _content(cls, v: Any, info: ValidationInfo) -> Any:
        return _as_blocks(v, BLOCKS.get(info.data.get("role", "user"), ()))


class ToolDef(_Strict):
    type: Literal["custom"] | None = None  # a server tool (`web_search_...`) is refused here
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool = False
    cache_control: Any = None
    eager_input_streaming: bool | None = None


class ToolChoiceIn(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool": the tool to call
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> "ToolChoiceIn":
        if (self.type == "tool") != (self.name is not None):
            raise PydanticCustomError("tool_choice", "type 'tool' takes the tool's name (and "
                                      "no other type takes one)")
        return self


class ThinkingIn(_Strict):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: Int | None = Field(None, ge=1)  # type "enabled": required
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget(self) -> "ThinkingIn":
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise PydanticCustomError("thinking", "type 'enabled' takes budget_tokens (and "
                                      "no other type takes it)")
        return self


class JSONFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: JSONFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class CountTokensBody(_Strict):
    """What a prompt is made of: `POST /v1/messages/count_tokens` (fields beyond the model's
    are checked by `UNMODELED` after parsing)."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=UNMODELED.document)
    model: str
    messages: Annotated[list[Turn], within_context("turns")] = Field(min_length=1,
                                                                      fail_fast=True)
    system: TextBlocks = []
    tools: Annotated[list[ToolDef], FAIL_FAST] = []
    tool_choice: ToolChoiceIn | None = None
    thinking: ThinkingIn | None = None
    output_config: OutputConfig | None = None
    output_format: JSONFormat | None = None  # the structured-outputs beta's spelling


class _Answer(CountTokensBody):
    max_tokens: Int = Field(ge=1)
    stop_sequences: Annotated[list[str], FAIL_FAST] = []
    stream: bool = False
    temperature: Float | None = Field(None, ge=0, le=1)
    top_p: Float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=0)
    seed: Seed = None  # ours, as the rest (`Extensions`)


class MessagesBody(Extensions, _Answer):
    """`POST /v1/messages`: a conversation to answer."""
