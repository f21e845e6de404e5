"""Parsed Chat Completions / Completions bodies (`chat_wire`, the only parser) → the neutral
`GenerateRequest`. Pure: no model, no HTTP. What is checked here is what one field's type
cannot say: parameters refused by name, one constraint at most, thinking asked for and
turned off at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdec.grammar import Constraint
from specdec.request import GenerateRequest, Message, NamedTool, Tool, ToolCall, ToolChoice
from specdec.sampling import SamplingError, SamplingParams

from .chat_wire import (AssistantTurn, ChatCompletionRequest, CompletionRequest, TextPart,
                        ToolResult, _Sampling)
from .door import spec_overrides
from .errors import bad_request, wire_param

# Parameters that change what a request means and that this server does not implement: a
# 400 naming them (never silently ignored), unless given their no-op value.
UNIMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none"),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "min_p": (None, 0, 0.0), "best_of": (None, 1),
    "echo": (None, False), "suffix": (None, ""), "prediction": (None,), "audio": (None,),
    "modalities": (None, ["text"]), "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    # llama.cpp's top-level constraint fields: the constraint goes in `structured_outputs`
    "grammar": (None,), "json_schema": (None,), "regex": (None,),
}
# vLLM's older structured-output fields, mapped onto `structured_outputs`' kinds.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "grammar": "grammar",
                    "choice": "choice", "json_object": "json_object"}
SWITCHES = ("enable_thinking", "thinking", "reasoning")  # chat_template_kwargs that think


@dataclass(frozen=True)
class Body:
    """A parsed chat or completions body: the neutral request and the wire's own options.

    Attributes:
        params: neutral field names this body spells its own way (`max_completion_tokens`
            for max_tokens), over the API's.
    """

    request: GenerateRequest
    model: str | None
    stream: bool
    include_usage: bool
    params: dict[str, str] = field(default_factory=dict)


def refuse_unimplemented(body: _Sampling) -> None:
    """A 400 naming the first parameter this server would otherwise silently ignore."""
    extra = body.model_extra or {}
    for key, noop in UNIMPLEMENTED.items():
        v = extra.get(key)
        if key in extra and not any(v == n and type(v) is type(n) or v is n for n in noop):
            hint = (f"; give it as structured_outputs: {{\"{key.replace('json_schema', 'json')}"
                    "\": ...}" if key in ("grammar", "json_schema", "regex") else "; remove it")
            raise bad_request(f"'{key}' is not supported by this server (it would change the "
                              f"output, so it is not ignored){hint}", key,
                              "unsupported_parameter")


def constraint_of(body: _Sampling) -> Constraint | None:
    """`response_format` (chat), vLLM's `structured_outputs` or its older `guided_*` fields
    → the constraint (at most one). `json_schema.strict: true` compiles strictly
    (unsupported keywords are a 400); otherwise leniently, with warnings."""
    found: list[Constraint] = []
    rf = getattr(body, "response_format", None)
    if rf is not None:
        if rf.type != "json_schema" and rf.json_schema is not None:
            raise bad_request(f"response_format.json_schema is for type 'json_schema', not "
                              f"{rf.type!r}: drop it or set the type",
                              "response_format.json_schema")
        if rf.type == "json_object":
            found.append(Constraint.json_object())
        elif rf.type == "json_schema":
            if rf.json_schema is None:
                raise bad_request("response_format.json_schema must be an object with a "
                                  "'schema'", "response_format.json_schema")
            found.append(Constraint.json_schema(rf.json_schema.schema_,
                                                lenient=not rf.json_schema.strict))
    extra = body.model_extra or {}
    guided = [k for k in GUIDED if extra.get(k) is not None]
    so = body.structured_outputs
    kinds = {k: v for k, v in (so.model_dump(by_alias=True) if so else {}).items()
             if v not in (None, False)}
    given = len(kinds) + len(guided)
    kinds.update({GUIDED[k]: extra[k] for k in guided})
    if given > 1:
        raise bad_request(f"structured_outputs has {sorted(kinds)}: give exactly one kind",
                          guided[0] if guided else "structured_outputs")
    for k, v in kinds.items():
        found.append(Constraint.json_schema(v, lenient=True) if k == "json" else
                     Constraint(STRUCTURED_KINDS[k],  # type: ignore[arg-type]
                                None if k == "json_object" else v))
    if len(found) > 1:
        raise bad_request("give either response_format or structured_outputs, not both",
                          "structured_outputs")
    return found[0] if found else None


def sampling_of(body: _Sampling) -> SamplingParams:
    """Temperature defaults to 1, as OpenAI's does."""
    bias = tuple(sorted((int(k), float(v)) for k, v in (body.logit_bias or {}).items()))
    twice = next((t for (t, _), (u, _) in zip(bias, bias[1:]) if t == u), None)
    if twice is not None:
        raise bad_request(f"logit_bias names token {twice} twice (its keys are token ids)",
                          "logit_bias")
    try:
        return SamplingParams(1.0 if body.temperature is None else body.temperature,
                              1.0 if body.top_p is None else body.top_p, body.top_k or 0,
                              body.seed, bias)
    except SamplingError as e:
        raise bad_request(str(e), wire_param(e, {})) from e


def tools_of(body: ChatCompletionRequest) -> tuple[tuple[Tool, ...], ToolChoice]:
    """`tools` + `tool_choice` → (the tools, the neutral choice: "auto" when tools are given
    without one). The engine decides what each choice means (`Engine.prepare`)."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs a non-empty 'tools' list", "tools")
        return (), "none"
    tools = tuple(Tool(t.function.name, t.function.description, strict=t.function.strict is True,
                       **({"parameters": t.function.parameters}
                          if t.function.parameters is not None else {}))
                  for t in body.tools)
    if choice is None:
        return tools, "auto"
    return tools, choice if isinstance(choice, str) else NamedTool(choice.function.name)


def _text(content: str | list[TextPart] | None) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content or ())


def messages_of(body: ChatCompletionRequest) -> tuple[Message, ...]:
    """The conversation: content as text (parts joined; an assistant's null is ""),
    developer as system, an assistant's `tool_calls` and `tool` results as the turns' calls
    and results (the engine decides whether it can render them)."""
    out = []
    for m in body.messages:
        role = "system" if m.role == "developer" else m.role
        calls: tuple[ToolCall, ...] = ()
        reasoning = call_id = None
        if isinstance(m, AssistantTurn):
            calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments)
                          for c in m.tool_calls or ())
            extra = m.model_extra or {}  # vLLM's name, then the newer one
            r = extra.get("reasoning_content", extra.get("reasoning"))
            reasoning = r if isinstance(r, str) else None
        if isinstance(m, ToolResult):
            call_id = m.tool_call_id
        out.append(Message(role, _text(m.content), reasoning, calls, call_id,  # type: ignore
                           m.name if not isinstance(m, ToolResult) else None))
    return tuple(out)


def _common(body: _Sampling, max_tokens: int | None
            ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The request fields chat and completions share, and the wire's own options."""
    refuse_unimplemented(body)
    so = body.stream_options
    return {"constraint": constraint_of(body), "sampling": sampling_of(body),
            "max_tokens": max_tokens, "stop": (body.stop,) if isinstance(body.stop, str)
            else tuple(body.stop or ()), "spec": spec_overrides(
                body.num_draft_tokens, body.draft_masking, body.prompt_lookup)}, {
        "model": body.model, "stream": bool(body.stream),
        "include_usage": bool(so is not None and so.include_usage)}


def to_chat(body: ChatCompletionRequest) -> Body:
    """A parsed /v1/chat/completions body as the neutral request.

    Raises:
        WireError: 400 naming the offending field.
    """
    fields, wire = _common(body, body.max_completion_tokens or body.max_tokens)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    kwargs = dict(body.chat_template_kwargs or {})
    effort, budget = body.reasoning_effort, body.max_thinking_tokens
    asked = [k for k in SWITCHES if kwargs.get(k)]
    off = effort == "none" or any(kwargs.get(k) is False for k in SWITCHES)
    thinking = bool(asked) or effort not in (None, "none") or budget is not None
    if thinking and off:
        raise bad_request("the request both asks for thinking and turns it off "
                          "(reasoning_effort 'none' or a false chat_template_kwargs switch)",
                          "reasoning_effort" if effort is not None else "chat_template_kwargs")
    if thinking:
        kwargs = {k: v for k, v in kwargs.items() if k not in asked}
    tools, choice = tools_of(body)
    return Body(GenerateRequest(
        messages=messages_of(body), tools=tools, tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        template_kwargs=kwargs, thinking=thinking, thinking_budget=budget,
        reasoning_effort=effort if effort not in (None, "none") else None, **fields), **wire,
        params={"max_tokens": "max_completion_tokens"} if body.max_completion_tokens else {})


def to_completion(body: CompletionRequest) -> Body:
    """A parsed /v1/completions body (one prompt: text or token ids) as the neutral
    request."""
    if (body.model_extra or {}).get("response_format") is not None:
        raise bad_request("/v1/completions takes no response_format; use structured_outputs",
                          "response_format")
    if (body.model_extra or {}).get("tools") not in (None, []):
        raise bad_request("/v1/completions takes no tools", "tools")
    fields, wire = _common(body, body.max_tokens)
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    return Body(GenerateRequest(prompt=prompt if isinstance(prompt, str) else tuple(prompt),
                                logprobs=body.logprobs, **fields), **wire)
