"""Chat-template rendering: messages → prompt text, with the no-think switch for constraints."""

from __future__ import annotations

from typing import Any

# Template variables that turn reasoning off in the common families (Qwen3, Granite, ...).
NO_THINK_KWARGS: dict[str, Any] = {"enable_thinking": False, "thinking": False,
                                   "reasoning": False}


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with this model's chat template."""


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
        kwargs.update(NO_THINK_KWARGS)
    try:
        return str(tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True,
            chat_template=template, **kwargs))
    except Exception as e:  # jinja errors surface as many types
        raise ChatTemplateError(f"chat template failed to render: {e}") from e
