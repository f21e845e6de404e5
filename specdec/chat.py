"""Chat-template rendering: messages → prompt text, with the no-think switch for constraints.

A grammar masks from the first generated token, so it can never close a reasoning block the
template opened. Constrained requests therefore render with the template's no-think switch;
a template that opens a think block with no switch, or a client asking for thinking together
with a constraint, is refused (`ReasoningConflictError`) instead of producing wrong output.
"""

from __future__ import annotations

import re
from typing import Any

# Template variables that turn reasoning off in the common families (Qwen3, Granite, ...).
NO_THINK_KWARGS: dict[str, Any] = {"enable_thinking": False, "thinking": False,
                                   "reasoning": False}
THINK_OPEN = ("<think>", "<|begin_of_thought|>", "<thinking>", "<reasoning>")
THINK_CLOSE = ("</think>", "<|end_of_thought|>", "</thinking>", "</reasoning>")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with this model's chat template."""


class ReasoningConflictError(ChatTemplateError):
    """A constrained request would start inside a reasoning block."""


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
    if not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"messages[{i}] needs a string 'role'")
        if not isinstance(m.get("content", ""), str):
            raise ChatTemplateError(f"messages[{i}].content must be a string")
    kwargs = dict(template_kwargs or {})
    if constrained:
        asked = [k for k in NO_THINK_KWARGS if kwargs.get(k)]
        if asked:
            raise ReasoningConflictError(
                f"chat_template_kwargs {asked} asks for reasoning, which a structured-output "
                "constraint cannot follow (the grammar applies from the first token); drop it "
                "or the constraint")
        kwargs.update(NO_THINK_KWARGS)

    def render(gen: bool) -> str:
        try:
            return str(tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen, chat_template=template,
                **kwargs))
        except Exception as e:  # jinja errors surface as many types
            raise ChatTemplateError(f"chat template failed to render: {e}") from e

    text = render(True)
    if constrained:
        head = render(False)
        tail = text[len(head):] if text.startswith(head) else text[-200:]
        if _opens_think(tail):
            source = template or getattr(tokenizer, "chat_template", None) or ""
            why = ("has a no-think switch that did not close it" if template_has_switch(source)
                   else "has no switch to turn reasoning off (e.g. enable_thinking)")
            raise ReasoningConflictError(
                "this model's chat template opens a reasoning block for the reply and " + why +
                "; a structured-output constraint would never let it close")
    return text
