"""Errors on the wire: one mapping from `specdec.errors.SpecdecError` to an HTTP status, and
the two error shapes the APIs answer in (OpenAI's, Anthropic's). Each API module names its
own fields (`param` maps from the engine's neutral names); nothing here reads message text.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse

from specdec.errors import ModelsBusy, SpecdecError

STATUS = {"invalid_request": 400, "unauthorized": 401, "not_found": 404, "not_allowed": 405,
          "conflict": 409, "too_large": 413, "unavailable": 503, "timeout": 504, "internal": 500}
KIND_OF = {status: kind for kind, status in STATUS.items()}
RETRY_AFTER_S = 1


class WireError(SpecdecError):
    """An error found at the HTTP layer or by an API's parser: its `param` is already the
    API's own field name; `status` picks its kind (`KIND_OF`; another 5xx is internal,
    another 4xx an invalid request)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message, param=param, code=code)
        self.kind = KIND_OF.get(status, "internal" if status >= 500 else "invalid_request")
        self.headers = headers or {}


class StoreError(SpecdecError):
    """The response store refused a write (`TooLarge`, `Duplicate`): a 400."""


class TooLarge(StoreError):
    """The write would take a unit (a conversation, a chain of responses) past its bound;
    `bound` the bound in bytes."""

    code = "store_bound_exceeded"

    def __init__(self, message: str, bound: int) -> None:
        super().__init__(message)
        self.bound = bound


class Duplicate(StoreError):
    """An item id twice in one context (OpenAI's message); `item_id` the id."""

    def __init__(self, item_id: str, param: str | None = "input") -> None:
        super().__init__(f"Duplicate item found with id {item_id}.", param=param)
        self.item_id = item_id


class StoreUnavailable(SpecdecError):
    """The response store failed (its file, its lock, its disk): not the request's fault."""

    kind = "unavailable"
    code = "store_unavailable"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> WireError:
    return WireError(400, message, param=param, code=code)


def status_of(e: SpecdecError) -> int:
    """The HTTP status of an error: its kind's, and nothing else."""
    return STATUS[e.kind]


def wire_param(e: SpecdecError, params: Mapping[str, str]) -> str | None:
    """The API's name for the field at fault (`params`: neutral name -> wire name; a dotted
    or indexed name maps by its first part when it has no entry of its own)."""
    if e.param is None or isinstance(e, WireError):
        return e.param
    if e.param in params:
        return params[e.param].removesuffix("[]")
    head, _, rest = e.param.partition(".")
    base = head.partition("[")[0]  # "messages[2]": an index into the neutral conversation
    if base in params and params[base]:
        # The index holds only where the API says its list is the conversation itself
        # ("messages[]"); else the field is named without it.
        wired = params[base]
        wired = head if wired == base + "[]" else wired.removesuffix("[]")
        return wired + ("." + rest if rest else "")
    return rest or head


def headers_of(e: SpecdecError) -> dict[str, str]:
    if isinstance(e, WireError):
        return e.headers
    return {"Retry-After": str(RETRY_AFTER_S)} if e.code in ("queue_full", "models_busy") else {}


def ref_of(e: BaseException) -> str:
    """A short reference for a fault, the same in its client's answer and in the server's
    log line (set on first use)."""
    ref = getattr(e, "ref", None)
    if ref is None:
        ref = secrets.token_hex(4)
        setattr(e, "ref", ref)
    return str(ref)


def message_of(e: SpecdecError) -> str:
    """The error's message for its client. An internal fault's text (an exception's, a
    parser state's) stays in the server log: the client gets where it happened, if known,
    and the log line's reference."""
    if e.code == "queue_full":
        return f"the server is at capacity: {e}; retry after {RETRY_AFTER_S}s"
    if e.kind == "internal" and not isinstance(e, WireError):
        position = getattr(e, "position", None)
        where = f" at output token {position}" if isinstance(position, int) else ""
        after = "; no output past that point was emitted" if where else ""
        return (f"internal error{where} (ref {ref_of(e)}): the server failed on this "
                f"request{after}; its log has the details")
    return str(e)


# -- OpenAI's shape: {"error": {"message", "type", "param", "code"}} ---------------------------
OPENAI_TYPES = {"invalid_request": "invalid_request_error",
                "unauthorized": "authentication_error", "not_found": "not_found_error",
                "not_allowed": "invalid_request_error", "too_large": "invalid_request_error",
                "conflict": "invalid_request_error",
                "unavailable": "server_error", "timeout": "server_error",
                "internal": "server_error"}


def openai_body(e: SpecdecError, params: Mapping[str, str]) -> dict[str, Any]:
    kind = OPENAI_TYPES[e.kind]
    return {"error": {"message": message_of(e), "type": kind, "param": wire_param(e, params),
                      "code": None if e.code == "invalid_request" else e.code}}


def openai_response(e: SpecdecError, params: Mapping[str, str]) -> JSONResponse:
    return JSONResponse(openai_body(e, params), status_code=status_of(e), headers=headers_of(e))


# -- Anthropic's shape: {"type": "error", "error": {"type", "message"}} ------------------------
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 409: "invalid_request_error",
                   413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                   504: "timeout_error"}


def anthropic_body(e: SpecdecError, params: Mapping[str, str]) -> dict[str, Any]:
    """Anthropic's error object; the field at fault leads the message (its shape has no
    `param`), and our `code` rides along as an extra key."""
    status = status_of(e)
    param = wire_param(e, params)
    message = message_of(e)
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return {"type": "error", "error": {
        "type": ANTHROPIC_TYPES.get(status, "api_error" if status >= 500
                                    else "invalid_request_error"),
        "message": message, "code": None if e.code == "invalid_request" else e.code}}


def anthropic_response(e: SpecdecError, params: Mapping[str, str]) -> JSONResponse:
    return JSONResponse(anthropic_body(e, params), status_code=status_of(e),
                        headers=headers_of(e))


class NoRoom(ModelsBusy):
    """No room for a model now (`fleet.Fleet`); `waitable`: unpinned models hold it, and room
    comes once they are idle."""

    def __init__(self, message: str, waitable: bool) -> None:
        super().__init__(message)
        self.waitable = waitable
