"""Chat-template rendering: messages → prompt text, with the no-think switch for constraints.

A constraint's own grammar masks from the first generated token, so it can never close a
reasoning block the template opened. Constrained requests therefore render with the
template's no-think switch; a template that opens a think block with no switch is refused
(`ReasoningConflictError`) instead of producing wrong output. A request that asks for
thinking renders with `render_thinking` instead: its grammar holds the think block, then
the constraint (`reasoning.think_grammar`).
"""

from __future__ import annotations

import re
from typing import Any

from .errors import RequestError
from .reasoning import Thinking

# Template variables that turn reasoning off in the common families (Qwen3, Granite, ...).
NO_THINK_KWARGS: dict[str, Any] = {"enable_thinking": False, "thinking": False,
                                   "reasoning": False}
THINK_OPEN = ("<think>", "<|begin_of_thought|>", "<thinking>", "<reasoning>")
THINK_CLOSE = ("</think>", "<|end_of_thought|>", "</thinking>", "</reasoning>")


class ChatTemplateError(RequestError):
    """The messages cannot be rendered with this model's chat template."""

    param = "messages"


class ReasoningConflictError(ChatTemplateError):
    """A constrained request would start inside a reasoning block."""

    code = "reasoning_conflict"


class ThinkingUnsupportedError(ChatTemplateError):
    """Thinking was asked for, and the chat template has no think block."""

    param, code = "thinking", "thinking_unsupported"


def think_markers(template: str) -> tuple[str, str] | None:
    """The (open, close) think markers a chat template uses, or None."""
    return next(((o, c) for o, c in zip(THINK_OPEN, THINK_CLOSE)
                 if c in template or o in template), None)


def render_thinking(tokenizer: Any, messages: list[dict[str, Any]], *,
                    template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                    budget: int | None = None) -> tuple[str, Thinking]:
    """Render for a request that thinks before its (constrained) answer: the template's
    thinking switch on; returns the prompt text and the think block the output must hold
    (opened by the prompt, or by the output's first token).

    Raises:
        ThinkingUnsupportedError: the template has no think block, or closes it itself.
        ChatTemplateError: malformed messages or a template that fails to render.
    """
    source = template or getattr(tokenizer, "chat_template", None) or ""
    markers = think_markers(source if isinstance(source, str) else str(source))
    if markers is None:
        raise ThinkingUnsupportedError(
            "thinking was asked for, but this model's chat template has no think block "
            f"(none of {list(THINK_OPEN)}); ask without thinking")
    kwargs = {**(template_kwargs or {}), **{k: True for k in NO_THINK_KWARGS}}
    text = _render(tokenizer, messages, template, kwargs, True)
    head = _render(tokenizer, messages, template, kwargs, False)
    tail = text[len(head):] if text.startswith(head) else text[-200:]
    opened = _opens_think(tail)
    if not opened and markers[1] in tail:
        raise ThinkingUnsupportedError(
            "this model's chat template closes the think block before the reply even with "
            "enable_thinking; it cannot think here")
    return text, Thinking(close=markers[1], open=None if opened else markers[0], budget=budget)


def _render(tokenizer: Any, messages: list[dict[str, Any]], template: str | None,
            kwargs: dict[str, Any], gen: bool) -> str:
    _check_messages(messages)
    try:
        return str(tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen, chat_template=template,
            **kwargs))
    except Exception as e:  # jinja errors surface as many types
        raise ChatTemplateError(f"chat template failed to render: {e}") from e


def _check_messages(messages: list[dict[str, Any]]) -> None:
    if not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"messages[{i}] needs a string 'role'")
        if not isinstance(m.get("content", ""), str) and not (
                m.get("content") is None and (m.get("tool_calls") or m["role"] == "assistant")):
            raise ChatTemplateError(f"messages[{i}].content must be a string")


def _opens_think(generation_prompt: str) -> bool:
    """True when the text after the last message leaves a reasoning block open."""
    last_open = max((generation_prompt.rfind(t) for t in THINK_OPEN), default=-1)
    if last_open < 0:
        return False
    last_close = max((generation_prompt.rfind(t) for t in THINK_CLOSE), default=-1)
    return last_close < last_open


def template_has_switch(template: str) -> bool:
    """Whether the template reads one of the known no-think variables."""
    return any(re.search(rf"\b{k}\b", template) for k in NO_THINK_KWARGS)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], *, constrained: bool,
                template: str | None = None, template_kwargs: dict[str, Any] | None = None
                ) -> str:
    """Render chat messages into the prompt text, ending with the assistant's turn opener.

    Args:
        tokenizer: Hugging Face tokenizer carrying the chat template.
        messages: OpenAI-style `[{"role", "content"}]`.
        constrained: a grammar will mask from the first token, so reasoning is switched off.
        template: a Jinja template overriding the model's.
        template_kwargs: extra template variables (the caller's `chat_template_kwargs`).
    Raises:
        ChatTemplateError: malformed messages or a template that fails to render.
        ReasoningConflictError: constrained, and the template opens a think block it has no
            switch for, or the caller asked for thinking.
    """
    _check_messages(messages)
    kwargs = dict(template_kwargs or {})
    if constrained:
        asked = [k for k in NO_THINK_KWARGS if kwargs.get(k)]
        if asked:
            raise ReasoningConflictError(
                f"chat_template_kwargs {asked} asks for reasoning: render with "
                "`render_thinking` so the constraint applies after the think block")
        kwargs.update(NO_THINK_KWARGS)

    text = _render(tokenizer, messages, template, kwargs, True)
    if constrained:
        head = _render(tokenizer, messages, template, kwargs, False)
        tail = text[len(head):] if text.startswith(head) else text[-200:]
        if _opens_think(tail):
            source = template or getattr(tokenizer, "chat_template", None) or ""
            why = ("has a no-think switch that did not close it" if template_has_switch(source)
                   else "has no switch to turn reasoning off (e.g. enable_thinking)")
            raise ReasoningConflictError(
                "this model's chat template opens a reasoning block for the reply and " + why +
                "; a structured-output constraint would never let it close: ask for thinking "
                "(reasoning_effort, or chat_template_kwargs enable_thinking) to answer after it")
    return text
