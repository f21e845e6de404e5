"""The package's one error contract: every error specdec raises on purpose is a `SpecdecError`.

Each carries a machine-readable `code`, the offending request field as a protocol-neutral
`param` (the names of `request.GenerateRequest`: "messages", "constraint", "max_tokens",
"thinking", "tools", "tool_choice", "stop", "sampling.temperature", ...; None when no field is
at fault) and a `kind` saying whose fault it is. The server maps `kind` to an HTTP status and
`param` to each API's own field name, in one place per API; nothing chooses a status by
reading message text.
"""

from __future__ import annotations

from typing import Literal

ErrorKind = Literal["invalid_request", "not_found", "unavailable", "timeout", "internal"]


class SpecdecError(Exception):
    """Base of specdec's errors.

    Attributes:
        code: machine-readable (e.g. "invalid_grammar", "context_length_exceeded").
        param: the request field at fault (protocol-neutral name), or None.
        kind: "invalid_request" (the caller's input), "not_found", "unavailable" (retry
            later), "timeout", or "internal" (our fault; the message says what was emitted).
    """

    code: str = "invalid_request"
    param: str | None = None
    kind: ErrorKind = "invalid_request"

    def __init__(self, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        if param is not None:
            self.param = param
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class InternalError(SpecdecError):
    """A fault of ours (not the request's): the message says what failed."""

    kind, code = "internal", "internal_error"


class RequestError(SpecdecError, ValueError):
    """A request field outside its valid range; the message names value and range."""
