"""OpenAI Chat Completions / Completions bodies → the neutral `GenerateRequest`. Pure: no
model, no HTTP. Field names of those two APIs live here and in `chat`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.grammar import Constraint
from specdec.request import GenerateRequest, Message, NamedTool, Tool, ToolCall
from specdec.sampling import SamplingError, SamplingParams
from specdec.speculative import DraftConfigError, SpecConfig

from . import openapi
from .errors import bad_request, wire_param
from .openapi import check

# Parameters that change what a request means and that this server does not implement: a
# 400 naming them (never silently ignored), unless given their no-op value.
UNIMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none"),

    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "min_p": (None, 0, 0.0), "best_of": (None, 1),
    "echo": (None, False), "suffix": (None, ""), "prediction": (None,), "audio": (None,),
    "modalities": (None, ["text"]), "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
}
# vLLM's older structured-output fields, mapped onto `structured_outputs`.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI's reasoning_effort values: "none" turns thinking off, every other one on.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")

STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "grammar": "grammar",
                    "choice": "choice", "json_object": "json_object"}


@dataclass(frozen=True)
class Body:
    """A parsed chat or completions body: the neutral request and the wire's own options."""

    request: GenerateRequest
    model: str | None
    stream: bool
    include_usage: bool


def _typed(body: dict[str, Any], key: str, types: tuple[type, ...], default: Any) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    if int in types and float not in types and isinstance(v, float) and v.is_integer():
        return int(v)  # JSON Schema's integer: 5.0 is one
    names = " or ".join("number" if t is float else t.__name__ for t in types)
    if (isinstance(v, bool) and bool not in types) or not isinstance(v, types):
        raise bad_request(f"'{key}' must be {names}, got {type(v).__name__}", key)
    return v


def parse_constraint(body: dict[str, Any], allow_response_format: bool = True
                     ) -> Constraint | None:
    """`response_format` or vLLM-style `structured_outputs` → Constraint (at most one).

    `json_schema.strict: true` compiles strictly (unsupported keywords are a 400); otherwise
    leniently, and what was not enforced is reported as warnings.
    """
    found: list[Constraint] = []
    rf = body.get("response_format")
    if rf is not None:
        if not allow_response_format:
            raise bad_request("/v1/completions takes no response_format; use "
                              "structured_outputs", "response_format")
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise bad_request("'response_format' must be an object with a 'type'",
                              "response_format")
        t = rf["type"]
        if t != "json_schema" and rf.get("json_schema") is not None:
            raise bad_request(f"response_format.json_schema is for type 'json_schema', not "
                              f"{t!r}: drop it or set the type", "response_format.json_schema")
        if t == "json_object":
            found.append(Constraint.json_object())
        elif t == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise bad_request("response_format.json_schema must be an object with a "
                                  "'schema'", "response_format.json_schema")
            strict = js.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise bad_request("response_format.json_schema.strict must be a boolean",
                                  "response_format.json_schema.strict")
            found.append(Constraint.json_schema(js["schema"], lenient=not strict))
        elif t != "text":
            raise bad_request(f"unknown response_format.type {t!r}: expected text, "
                              "json_object or json_schema", "response_format.type")
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("'structured_outputs' must be an object", "structured_outputs")
        unknown = [k for k in so if k not in STRUCTURED_KINDS]
        if unknown:
            raise bad_request(f"unknown structured_outputs key(s) {unknown}: expected one of "
                              f"{sorted(STRUCTURED_KINDS)}", "structured_outputs")
        kinds = [k for k in STRUCTURED_KINDS if so.get(k) not in (None, False)]
        if len(kinds) > 1:
            raise bad_request(f"structured_outputs has {kinds}: give exactly one kind",
                              "structured_outputs")
        if kinds:
            k = kinds[0]
            if k == "json":
                found.append(Constraint.json_schema(so[k], lenient=True))
            else:
                found.append(Constraint(STRUCTURED_KINDS[k],  # type: ignore[arg-type]
                                        None if k == "json_object" else so[k]))
    if len(found) > 1:
        raise bad_request("give either response_format or structured_outputs, not both",
                          "structured_outputs")
    return found[0] if found else None


def parse_sampling(body: dict[str, Any]) -> SamplingParams:
    temperature = float(_typed(body, "temperature", (int, float), 1.0))
    top_p = float(_typed(body, "top_p", (int, float), 1.0))
    top_k = int(_typed(body, "top_k", (int,), 0))
    seed = _typed(body, "seed", (int,), None)
    raw_bias = _typed(body, "logit_bias", (dict,), {})
    bias = []
    for k, v in raw_bias.items():
        if not (isinstance(k, str) and k.isdigit()) or isinstance(v, bool) or \
                not isinstance(v, (int, float)):
            raise bad_request(f"logit_bias must map token ids (strings of digits) to numbers; "
                              f"got {k!r}: {v!r}", "logit_bias")
        bias.append((int(k), float(v)))
    try:
        return SamplingParams(temperature, top_p, top_k, seed, tuple(sorted(bias)))
    except SamplingError as e:
        raise bad_request(str(e), wire_param(e, {})) from e


def parse_spec(body: dict[str, Any]) -> dict[str, Any] | None | str:
    """The request's speculative overrides of the server's settings: "default" (none), None
    (plain decoding: num_draft_tokens=0) or {field: value} for `SpecConfig`."""
    k = _typed(body, "num_draft_tokens", (int,), None)
    masking = _typed(body, "draft_masking", (bool,), None)
    lookup = _typed(body, "prompt_lookup", (bool,), None)
    if k is None and masking is None and lookup is None:
        return "default"
    if k == 0:
        return None  # plain decoding for this request
    if k is not None:
        try:
            SpecConfig(k)
        except DraftConfigError as e:
            raise bad_request(f"num_draft_tokens: {e}", "num_draft_tokens") from e
    fields = {"k": k, "draft_masking": masking, "lookup": lookup}
    return {name: v for name, v in fields.items() if v is not None}


def check_unimplemented(body: dict[str, Any]) -> None:
    """A 400 naming the first parameter this server would otherwise silently ignore."""
    for key, noop in UNIMPLEMENTED.items():
        if key in body and not any(body[key] == v and type(body[key]) is type(v)
                                   or body[key] is v for v in noop):
            raise bad_request(f"'{key}' is not supported by this server (it would change the "
                              "output, so it is not ignored); remove it", key,
                              "unsupported_parameter")


def map_guided(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `guided_json`/`guided_regex`/`guided_choice`/`guided_grammar` as the
    equivalent `structured_outputs` (giving both is a 400, like any two constraints)."""
    given = [k for k in GUIDED if body.get(k) is not None]
    if not given:
        return body
    if body.get("structured_outputs") is not None:
        given.append("structured_outputs")
    if len(given) > 1:
        raise bad_request(f"give one structured output, not {given}", given[0])
    body = dict(body)
    body["structured_outputs"] = {GUIDED[given[0]]: body.pop(given[0])}
    return body


def parse_tools(body: dict[str, Any]) -> tuple[tuple[Tool, ...], Any]:
    """`tools` + `tool_choice` → (the tools, the neutral tool choice). The engine decides
    what each choice means (`Engine.prepare`): "required" or a named function makes the
    output one call; "none" ignores the tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs a non-empty 'tools' list", "tools")
        return (), "none"
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': "
                              "{'name': ..., 'parameters': {...}}}", f"tools[{i}]")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                              f"tools[{i}].function.parameters")
        desc = f.get("description")
        out.append(Tool(f["name"], desc if isinstance(desc, str) else None,
                        **({"parameters": params} if params is not None else {}),
                        strict=f.get("strict") is True))
    if choice is None:
        return tuple(out), "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == \
            "function" else None
        if not isinstance(name, str):
            raise bad_request("tool_choice must be 'auto', 'required', 'none' or "
                              "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        return tuple(out), NamedTool(name)
    if choice not in ("auto", "required", "none"):
        raise bad_request(f"tool_choice {choice!r}: expected 'auto', 'required', 'none' or "
                          "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    return tuple(out), choice


def parse_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """Chat: `logprobs` (bool) and `top_logprobs` (0..20); completions: `logprobs` (0..20,
    the number of alternatives). None when not asked for."""
    if chat:
        on = _typed(body, "logprobs", (bool,), False)
        top = _typed(body, "top_logprobs", (int,), None)
        if top is not None and not on:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        n = top if top is not None else 0
        param = "top_logprobs"
    else:
        lp = _typed(body, "logprobs", (int,), None)
        if lp is None:
            return None
        on, n, param = True, lp, "logprobs"
    if not on:
        return None
    if not 0 <= n <= 20:
        raise bad_request(f"{param}={n}: must be in [0, 20]", param)
    return n


def parse_common(body: Any, chat: bool) -> dict[str, Any]:
    """What chat and completions bodies share, as `GenerateRequest` fields (plus the wire's
    own: model, stream, include_usage)."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    check_unimplemented(body)
    body = map_guided(body)
    tools, choice = parse_tools(body) if chat else ((), "none")
    if not chat and body.get("tools") not in (None, []):
        raise bad_request("/v1/completions takes no tools", "tools")
    n = _typed(body, "n", (int,), 1)
    if n != 1:
        raise bad_request(f"n={n}: only n=1 is supported", "n")
    max_tokens = _typed(body, "max_completion_tokens", (int,), None)
    if max_tokens is None:
        max_tokens = _typed(body, "max_tokens", (int,), None)
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens={max_tokens}: must be >= 1", "max_tokens")
    stop = body.get("stop")
    stops: tuple[str, ...] = ()
    if isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop):
        stops = tuple(stop)
    elif stop is not None:
        raise bad_request("'stop' must be a string or a list of non-empty strings", "stop")
    if len(stops) > 4:
        raise bad_request(f"'stop' has {len(stops)} strings; at most 4", "stop")
    stream = bool(_typed(body, "stream", (bool,), False))
    so = _typed(body, "stream_options", (dict,), {})
    if not isinstance(so.get("include_usage", False), bool):
        raise bad_request("stream_options.include_usage must be a boolean",
                          "stream_options.include_usage")
    return {"model": _typed(body, "model", (str,), None), "stream": stream,
            "include_usage": bool(so.get("include_usage", False)),
            "constraint": parse_constraint(body, chat), "tools": tools,
            "tool_choice": choice, "sampling": parse_sampling(body), "max_tokens": max_tokens,
            "stop": stops, "spec": parse_spec(body), "logprobs": parse_logprobs(body, chat),
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False}


def _body(fields: dict[str, Any], **request: Any) -> Body:
    wire = {k: fields.pop(k) for k in ("model", "stream", "include_usage")}
    return Body(GenerateRequest(**fields, **request), **wire)


def parse_chat(body: Any) -> Body:
    """Validate a /v1/chat/completions body.

    Raises:
        WireError: 400 naming the offending field.
    """
    fields = parse_common(body, chat=True)
    messages = normalize_messages(body.get("messages"))
    kwargs = _typed(body, "chat_template_kwargs", (dict,), {})
    effort = _typed(body, "reasoning_effort", (str,), None)
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad_request(f"reasoning_effort {effort!r}: expected one of "
                          f"{list(REASONING_EFFORTS)}", "reasoning_effort")
    budget = _typed(body, "max_thinking_tokens", (int,), None)
    if budget is not None and budget < 0:
        raise bad_request(f"max_thinking_tokens={budget}: must be >= 0", "max_thinking_tokens")
    asked = [k for k in ("enable_thinking", "thinking", "reasoning") if kwargs.get(k)]
    off = effort == "none" or any(kwargs.get(k) is False for k in
                                  ("enable_thinking", "thinking", "reasoning"))
    thinking = bool(asked) or effort not in (None, "none") or budget is not None
    if thinking and off:
        raise bad_request("the request both asks for thinking and turns it off "
                          "(reasoning_effort 'none' or a false chat_template_kwargs switch)",
                          "reasoning_effort" if effort is not None else "chat_template_kwargs")
    if thinking:
        kwargs = {k: v for k, v in kwargs.items() if k not in asked}
    check(openapi.ChatCompletionRequest, body)
    return _body(fields, messages=messages, template_kwargs=kwargs, thinking=thinking,
                 thinking_budget=budget,
                 reasoning_effort=effort if effort not in (None, "none") else None)


def normalize_messages(messages: Any) -> tuple[Message, ...]:
    """OpenAI chat messages → the conversation's `Message`s.

    `content` may be a string, a list of text parts (what many clients send) or null (an
    assistant turn); other part kinds (images, audio) are a 400 naming the message, as is an
    unknown role. An assistant's `tool_calls` and `tool` messages become the turns' calls
    and results (the engine decides whether it can render them).
    """
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", where)
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role {role!r} is not supported: expected one of "
                              f"{list(ROLES)}", f"{where}.role")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or \
                        not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise bad_request(f"{where}.content[{j}]: only text parts are supported, "
                                      f"got {kind!r}", f"{where}.content")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise bad_request(f"{where}.content must be a string, a list of text parts or "
                              "(for an assistant) null", f"{where}.content")
        calls = []
        for j, c in enumerate(m.get("tool_calls") or ()):
            f = c.get("function") if isinstance(c, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str) or \
                    not isinstance(f.get("arguments", ""), str):
                raise bad_request(f"{where}.tool_calls[{j}] must be {{'id', 'type': "
                                  "'function', 'function': {'name', 'arguments'}}",
                                  f"{where}.tool_calls")
            calls.append(ToolCall(str(c.get("id") or ""), f["name"], f.get("arguments", "")))
        reasoning = m.get("reasoning_content")
        out.append(Message("system" if role == "developer" else role, content,
                           reasoning if isinstance(reasoning, str) else None, tuple(calls),
                           m.get("tool_call_id") if role == "tool" else None,
                           m.get("name") if isinstance(m.get("name"), str) else None))
    return tuple(out)


def parse_completion(body: Any) -> Body:
    """Validate a /v1/completions body (prompt: a string or a list of token ids)."""
    fields = parse_common(body, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and all(isinstance(t, float) and t.is_integer() for t in prompt
                                        if not isinstance(t, int)):
        prompt = [int(t) for t in prompt]  # JSON Schema's integer: 5.0 is one
    ok_ids = isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ok_ids:
        raise bad_request("'prompt' must be a non-empty string or a list of token ids "
                          "(one prompt per request)", "prompt")
    check(openapi.CompletionRequest, body)
    return _body(fields, prompt=prompt if isinstance(prompt, str) else tuple(prompt))
