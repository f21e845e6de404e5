"""The protocol-neutral request: what every API (Chat Completions, Responses, Messages, the
CLI) translates its wire format into, and what `Engine.prepare` validates, renders and
compiles. Field names here are the `param` names of `errors.SpecdecError`.

Defaults live here and in `Engine.prepare`, once: a field left None takes the engine's
default (`EngineDefaults`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .grammar import Constraint
from .sampling import SamplingParams

Role = Literal["system", "user", "assistant", "tool"]
NO_PARAMETERS: Mapping[str, Any] = {"type": "object", "properties": {},
                                    "additionalProperties": False}


@dataclass(frozen=True)
class ToolCall:
    """A call the assistant made: `arguments` is JSON text (an object)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Message:
    """One turn of the conversation.

    Attributes:
        role: system, user, assistant, or tool (a tool's result).
        content: the text (for a tool turn: the result).
        reasoning: an assistant turn's thinking, where the client sent it back.
        tool_calls: an assistant turn's calls.
        tool_call_id: a tool turn: the call it answers.
        name: a tool turn: the tool's name, where known.
    """

    role: Role
    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class Tool:
    """A function the model may call; `parameters` is a JSON schema object."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(NO_PARAMETERS))
    strict: bool = False


@dataclass(frozen=True)
class NamedTool:
    """`tool_choice` that forces a call of this tool."""

    name: str


ToolChoice = Literal["auto", "required", "none"] | NamedTool
SpecOverrides = Literal["default"] | None | Mapping[str, Any]


@dataclass(frozen=True)
class GenerateRequest:
    """One request, as every API means it.

    Attributes:
        messages: the conversation, rendered with the chat template; or
        prompt: text used as is (no template) or token ids (exactly one of the two).
        constraint: what the answer must match (None: free text).
        tools, tool_choice: functions the model may call, in its chat template's own
            format (`tools`): "auto" text or calls, "required" calls, a `NamedTool` one call
            of it, "none" ignores the tools.
        parallel_tool_calls: whether more than one call may be made in the turn.
        sampling: temperature, top_p, top_k, seed, logit_bias.
        max_tokens: most output tokens (None: the engine's default, within the context).
        stop: strings that end the answer (not included in it).
        thinking: think before the answer (a template with a think block; else a 400);
            thinking_budget: most thinking tokens (None: the engine's default share).
        reasoning_effort: passed to templates that read it.
        logprobs: None, or each token's logprob and its top `logprobs` alternatives.
        spec: "default" (the engine's speculative settings), None (plain decoding), or
            overrides of `SpecConfig` fields.
        template_kwargs: extra chat-template variables.
    """

    messages: tuple[Message, ...] = ()
    prompt: str | tuple[int, ...] | None = None
    constraint: Constraint | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    sampling: SamplingParams = SamplingParams()
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    thinking: bool = False
    thinking_budget: int | None = None
    reasoning_effort: str | None = None
    logprobs: int | None = None
    spec: SpecOverrides = "default"
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
