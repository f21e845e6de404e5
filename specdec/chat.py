"""Chat-template rendering: messages → prompt text, with the no-think switch for constraints.

A constraint's own grammar masks from the first generated token, so it can never close a
reasoning block the template opened. Constrained requests therefore render with the
template's no-think switch; a template that opens a think block with no switch raises
`TemplateThinksError` (the Preparer then renders the request as one that thinks). A request
that asks for thinking renders with `render_thinking` instead: its grammar holds the think
block, then the constraint (`reasoning.think_grammar`); where the template leaves opening
the block to the model, the output must open it (asked for, thinking is not skipped).
"""

from __future__ import annotations

from typing import Any

from .errors import (ChatTemplateError, ReasoningConflictError, RequestError,  # noqa: F401
                     TemplateThinksError, ThinkingUnsupportedError)
from .reasoning import (GEMMA, HARMONY, OTHER_TAGS, THINK_TAG, Protocol, Thinking,
                        find_protocol, think_tag)

# Template variables that turn reasoning on or off in the common families (Qwen 3, GLM, Gemma:
# enable_thinking; DeepSeek V3.1: thinking; Granite: reasoning).
NO_THINK_KWARGS: dict[str, Any] = {"enable_thinking": False, "thinking": False,
                                   "reasoning": False}
# A probe conversation rendered to read a template's reasoning markers: the assistant turn as
# a template writes it in the history (its reasoning under every name templates read).
PROBE_USER = {"role": "user", "content": "Probe question."}
PROBE_THOUGHT = "Probe reasoning."
PROBE_ANSWER = "Probe answer."


def _assistant(thought: str) -> dict[str, Any]:
    return {"role": "assistant", "content": PROBE_ANSWER, "reasoning_content": thought,
            "thinking": thought, "reasoning": thought}


def _quiet_render(tokenizer: Any, messages: list[dict[str, Any]], template: str | None,
                  kwargs: dict[str, Any], gen: bool) -> str:
    """A probe render; "" where the template refuses the probe."""
    try:
        return _render(tokenizer, messages, template, kwargs, gen)
    except ChatTemplateError:
        return ""


def _between(text: str, start: str, end: str, at: int = 0) -> str | None:
    """The text between `start` (from `at`) and the next `end` after it, or None."""
    i = text.find(start, at)
    j = text.find(end, i + len(start)) if i >= 0 else -1
    return text[i + len(start):j] if j >= 0 else None


def _opened(tail: str, proto: Protocol) -> bool | None:
    """Whether a generation prompt leaves the protocol's reasoning open (True), closed it
    (False), or holds neither marker (None)."""
    o, c = tail.rfind(proto.open), tail.rfind(proto.close)
    if o < 0 and c < 0:
        return None
    return o > c


def render_thinking(tokenizer: Any, messages: list[dict[str, Any]], *,
                    template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                    budget: int | None = None, protocol: str | None = None,
                    optional: bool = False) -> tuple[str, Thinking]:
    """Render for a request that reasons before its (constrained) answer: the template's
    thinking switch on; returns the prompt text and the reasoning protocol the output
    follows. The protocol is read from what the template renders (`reasoning.find_protocol`
    over its generation prompt with thinking on and off, and an assistant turn with
    reasoning in the history), never from its source; `protocol` names one instead
    (`protocol_named`). The header after the reasoning is the one the template writes.
    Where the template leaves opening the reasoning to the output, the output opens it
    (asked for, thinking is not skipped), unless `optional`: then it may answer at once
    instead (`Thinking.direct`).

    Raises:
        ThinkingUnsupportedError: the template writes no reasoning markers, or closes the
            reasoning before the reply.
        ChatTemplateError: malformed messages or a template that fails to render.
    """
    kwargs = {**(template_kwargs or {}), **{k: True for k in NO_THINK_KWARGS}}
    text = _render(tokenizer, messages, template, kwargs, True)
    head = _render(tokenizer, messages, template, kwargs, False)
    tail = text[len(head):] if text.startswith(head) else text[-200:]
    off = {**(template_kwargs or {}), **NO_THINK_KWARGS}
    off_text = _quiet_render(tokenizer, messages, template, off, True)
    off_tail = off_text[len(head):] if off_text.startswith(head) else off_text[-200:]
    hist = _quiet_render(tokenizer, [PROBE_USER, _assistant(PROBE_THOUGHT)], template, kwargs,
                         False)
    proto = protocol_named(protocol) if protocol else find_protocol(tail, off_tail, hist)
    if proto is None:
        raise ThinkingUnsupportedError(
            "thinking was asked for, but this model's chat template writes no reasoning "
            "markers (think tags, Gemma or Harmony channels); ask without thinking, or name "
            "the format with --reasoning-format")
    after = proto.after
    if PROBE_THOUGHT in hist:  # the header as the template writes it after the reasoning
        between = _between(hist, proto.close, PROBE_ANSWER, hist.find(PROBE_THOUGHT))
        if between is not None and len(between) <= 64 and PROBE_THOUGHT not in between:
            after = between
    opened = _opened(tail, proto)
    if opened is False:
        raise ThinkingUnsupportedError(
            "this model's chat template closes the reasoning before the reply even with "
            "its thinking switch on; it cannot think here")
    if opened:
        return text, Thinking(close=proto.close, budget=budget, header=after, name=proto.name)
    return text, Thinking(close=proto.close, open=proto.open, budget=budget, header=after,
                          direct=proto.direct if optional else None, name=proto.name)


def protocol_named(name: str) -> Protocol:
    """A reasoning protocol by name: `harmony`, `gemma`, or a think tag (`think`, or the
    open tag itself, `<seed:think>`).

    Raises:
        RequestError: an unknown name.
    """
    if name == "harmony":
        return HARMONY
    if name == "gemma":
        return GEMMA
    tag = "<think>" if name == "think" else name
    if THINK_TAG.fullmatch(tag) or tag in dict(OTHER_TAGS):
        return think_tag(tag)
    raise RequestError(f"unknown reasoning format {name!r}: harmony, gemma, think, or a "
                       "think tag such as <seed:think>", param="reasoning_format")


NO_TEMPLATE = ("this model has no chat template (its files carry none, as some GGUF files): "
               "serve it with --chat-template FILE (or chat_template in a models file) to "
               "chat with it; /v1/completions takes a prompt as is without one")


def _render(tokenizer: Any, messages: list[dict[str, Any]], template: str | None,
            kwargs: dict[str, Any], gen: bool) -> str:
    _check_messages(messages)
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(NO_TEMPLATE)
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


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], *, constrained: bool,
                template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                answer_header: bool = True) -> str:
    """Render chat messages into the prompt text, ending with the assistant's turn opener.

    A constrained request renders with the template's no-think switch; where the format's
    answer has a header of its own (Harmony's final channel; the closed empty think block
    of a family that opens one itself), the prompt ends with it (`answer_header`), as the
    template writes it before an answer without reasoning, so the constraint starts where
    the answer does.

    Args:
        tokenizer: Hugging Face tokenizer carrying the chat template.
        messages: OpenAI-style `[{"role", "content"}]`.
        constrained: a grammar will mask from the first token, so reasoning is switched off.
        template: a Jinja template overriding the model's.
        template_kwargs: extra template variables (the caller's `chat_template_kwargs`).
        answer_header: end a constrained prompt with the format's answer header (not for
            tool calls, whose format writes its own channel headers).
    Raises:
        ChatTemplateError: malformed messages or a template that fails to render.
        ReasoningConflictError: constrained, and the template opens a reasoning block it has
            no switch for, or the caller asked for thinking.
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
    if not constrained:
        return text
    head = _render(tokenizer, messages, template, kwargs, False)
    tail = text[len(head):] if text.startswith(head) else text[-200:]
    hist = _quiet_render(tokenizer, [PROBE_USER, _assistant("")], template, kwargs, False)
    proto = find_protocol(tail, hist)
    opened = _opened(tail, proto) if proto is not None else None
    if opened:
        plain = _quiet_render(tokenizer, messages, template, dict(template_kwargs or {}), True)
        why = ("has no switch to turn reasoning off (rendering with enable_thinking, thinking "
               "or reasoning false changes nothing)" if plain == text
               else "has a no-think switch that did not close it")
        raise TemplateThinksError(
            "this model's chat template opens a reasoning block for the reply and " + why +
            "; a structured-output constraint would never let it close: ask for thinking "
            "(reasoning_effort, or chat_template_kwargs enable_thinking) to answer after it")
    if answer_header and proto is not None and opened is None:
        base = _quiet_render(tokenizer, [PROBE_USER], template, kwargs, True)
        if base and hist.startswith(base) and PROBE_ANSWER in hist:
            header = hist[len(base):hist.index(PROBE_ANSWER, len(base))]
            if proto.close in header or (proto.direct and proto.direct in header):
                text += header
    return text
