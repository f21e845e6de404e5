"""OpenAI request parsing → specdec requests. Pure: no model, no HTTP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.grammar import Constraint
from specdec.sampling import SamplingError, SamplingParams

from .errors import bad_request

STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "grammar": "grammar",
                    "choice": "choice", "json_object": "json_object"}


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, Any]]
    constraint: Constraint | None
    sampling: SamplingParams
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    template_kwargs: dict[str, Any]


def _typed(body: dict[str, Any], key: str, types: tuple[type, ...], default: Any) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in types:
        raise bad_request(f"'{key}' must be {' or '.join(t.__name__ for t in types)}", key)
    if not isinstance(v, types):
        raise bad_request(f"'{key}' must be {' or '.join(t.__name__ for t in types)}, "
                          f"got {type(v).__name__}", key)
    return v


def parse_constraint(body: dict[str, Any]) -> Constraint | None:
    """`response_format` or vLLM-style `structured_outputs` → Constraint (at most one)."""
    found: list[Constraint] = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise bad_request("'response_format' must be an object with a 'type'",
                              "response_format")
        t = rf["type"]
        if t == "json_object":
            found.append(Constraint.json_object())
        elif t == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise bad_request("response_format.json_schema must be an object with a "
                                  "'schema'", "response_format.json_schema")
            found.append(Constraint.json_schema(js["schema"]))
        elif t != "text":
            raise bad_request(f"unknown response_format.type {t!r}: expected text, "
                              "json_object or json_schema", "response_format.type")
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("'structured_outputs' must be an object", "structured_outputs")
        kinds = [k for k in STRUCTURED_KINDS if so.get(k) not in (None, False)]
        unknown = [k for k in so if k not in STRUCTURED_KINDS]
        if unknown:
            raise bad_request(f"unknown structured_outputs key(s) {unknown}: expected one of "
                              f"{sorted(STRUCTURED_KINDS)}", "structured_outputs")
        if len(kinds) > 1:
            raise bad_request(f"structured_outputs has {kinds}: give exactly one kind",
                              "structured_outputs")
        if kinds:
            k = kinds[0]
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
    try:
        return SamplingParams(temperature, top_p, top_k, seed)
    except SamplingError as e:
        raise bad_request(str(e), str(e).split("=")[0]) from e


def parse_chat(body: Any) -> ChatRequest:
    """Validate a /v1/chat/completions body.

    Raises:
        APIError: 400 naming the offending field.
    """
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
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
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    elif stop is not None:
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    stream = bool(_typed(body, "stream", (bool,), False))
    so = _typed(body, "stream_options", (dict,), {})
    kwargs = _typed(body, "chat_template_kwargs", (dict,), {})
    return ChatRequest(model=_typed(body, "model", (str,), None), messages=messages,
                       constraint=parse_constraint(body), sampling=parse_sampling(body),
                       max_tokens=max_tokens, stop=stops, stream=stream,
                       include_usage=bool(so.get("include_usage", False)),
                       template_kwargs=kwargs)
