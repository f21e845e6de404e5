"""The request, on the floor: what every API (Chat Completions, Responses, Messages, the
CLI) translates its wire format into (`GenerateRequest` and its parts: messages, tools, the
output `Constraint`, `SamplingParams`); preparing it makes the scheduler's `prepare.Request`. Field names here are the `param` names of
`errors.SpecdecError`. It imports nothing of ours but the floor (`types`, `errors`).

Defaults live here and in preparation, once: a field left None takes the engine's default
(`EngineDefaults`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import SamplingError
from .types import MAX_DRAFT_TOKENS, TokenId

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]
SEED_LIMIT = (1 << 64) - 1
UNGUARANTEED = "budget_unguaranteed"  # the warning of a request served without the budget rule


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match.

    Attributes:
        kind: `json_schema` (value: dict or JSON text), `json_object` (value: None),
            `regex` (value: pattern), `grammar` (value: Lark or GBNF text), `choice`
            (value: list of strings).
        value: the constraint itself.
        lenient: JSON only: ignore keywords llguidance does not implement and treat `oneOf`
            as `anyOf` (both reported as warnings) instead of refusing the schema.
    """

    kind: ConstraintKind | Literal["tools"]
    value: Any = None
    lenient: bool = False
    json_options: tuple[tuple[str, Any], ...] = field(default=())

    @staticmethod
    def json_schema(schema: dict[str, Any] | str, lenient: bool = False) -> "Constraint":
        return Constraint("json_schema", schema, lenient)

    @staticmethod
    def tools(grammar: str) -> "Constraint":
        """Text or tool calls: a grammar `tools.tools_grammar` wrote (llguidance JSON)."""
        return Constraint("tools", grammar)

    @staticmethod
    def json_object() -> "Constraint":
        return Constraint("json_object")

    @staticmethod
    def regex(pattern: str) -> "Constraint":
        return Constraint("regex", pattern)

    @staticmethod
    def grammar(text: str) -> "Constraint":
        return Constraint("grammar", text)

    @staticmethod
    def choice(options: list[str]) -> "Constraint":
        return Constraint("choice", list(options))



@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token.

    Attributes:
        temperature: 0 means greedy (masked argmax); > 0 samples.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k highest logits; 0 disables it.
        seed: randomness seed (non-negative int). Required when sampling; the generate
            wrappers draw one and report it when the caller gives none.
        logit_bias: (token id, value in [-100, 100]) pairs added to the target's logits
            before the grammar mask (so a bias never lets a banned token out).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature <= 100.0):
            raise SamplingError(f"temperature={self.temperature}: must be in [0, 100]",
                                param="sampling.temperature")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingError(f"top_p={self.top_p}: must be in (0, 1]", param="sampling.top_p")
        if self.top_k < 0:
            raise SamplingError(f"top_k={self.top_k}: must be >= 0 (0 disables it)",
                                param="sampling.top_k")
        if self.seed is not None and not (0 <= self.seed <= SEED_LIMIT):
            raise SamplingError(f"seed={self.seed}: must be in [0, 2**64)", param="sampling.seed")
        for tok, v in self.logit_bias:
            if not (isinstance(tok, int) and tok >= 0):
                raise SamplingError(f"logit_bias token {tok!r}: must be a token id >= 0",
                                    param="sampling.logit_bias")
            if not (-100.0 <= v <= 100.0):
                raise SamplingError(f"logit_bias[{tok}]={v}: must be in [-100, 100]",
                                    param="sampling.logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0




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
        token_sources: None, or each output token's source and how many tokens its grammar
            allowed there (`events.TokenSource`), with its logprob and top `token_sources`
            alternatives (0..20) in the events' logprobs.
        spec: "default" (the engine's speculative settings), None (plain decoding), or
            overrides of `SpecConfig` fields.
        template_kwargs: extra chat-template variables.
        close_at_budget: a constrained answer closes in time for `max_tokens` (`budget`:
            near the end it is steered to complete its document); False: it is cut where
            the budget ends, as plain truncation.
        continues: whether a next turn of this conversation is likely, so that its answer
            is kept in the prompt store and its history prefilled for that turn
            (`Request.keep`). None: decided from the request itself: tools in it, or an
            earlier turn in its messages (a one-shot request pays for no next turn).
        cache_scope: whose prompt and answer reuse it shares: requests of one scope
            restore each other's stored prompt states and propose from each other's earlier
            answers; none is reused across scopes, so another caller's prompts never show
            in `cached_tokens` or in timing (the server's scope: the API key's owner, and
            `prompt_cache_key` within it). "" for every request: one shared scope.
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
    token_sources: int | None = None
    spec: SpecOverrides = "default"
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    close_at_budget: bool = True
    continues: bool | None = None
    cache_scope: str = ""

    @property
    def next_turn_likely(self) -> bool:
        """`continues`, else: chat messages with tools, or with an earlier turn (an
        assistant's answer or a tool's result) in them."""
        if self.continues is not None:
            return self.continues
        return self.prompt is None and (bool(self.tools) or any(
            m.role in ("assistant", "tool") for m in self.messages))


def kv_positions(prompt_tokens: int, max_tokens: int) -> int:
    """The most KV positions a request can hold: its prompt, its output and one round's
    proposals (what admission counts against `max_kv_tokens`)."""
    return prompt_tokens + max_tokens + MAX_DRAFT_TOKENS + 1
