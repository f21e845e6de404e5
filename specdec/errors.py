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

# Whose fault, and what the caller can do; the server answers each with one HTTP status
# ("unauthorized", "not_allowed", "conflict" and "too_large" are the HTTP layer's own).
ErrorKind = Literal["invalid_request", "unauthorized", "not_found", "not_allowed", "conflict",
                    "too_large",
                    "unavailable", "timeout", "internal"]


class SpecdecError(Exception):
    """Base of specdec's errors.

    Attributes:
        code: machine-readable (e.g. "invalid_grammar", "context_length_exceeded").
        param: the request field at fault (protocol-neutral name), or None.
        kind: "invalid_request" (the caller's input), "not_found", "unavailable" (retry
            later), "timeout", or "internal" (our fault; the message says what was emitted);
            the HTTP layer adds "unauthorized", "not_allowed" and "too_large".
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


class NotFoundError(SpecdecError):
    """What was asked for does not exist here."""

    kind, code = "not_found", "not_found"


class UnavailableError(SpecdecError):
    """The engine cannot serve now; retry later."""

    kind, code = "unavailable", "unavailable"


# -- the machine and the model files ---------------------------------------------------------
class BlasError(SpecdecError, RuntimeError):
    """The requested BLAS cannot be provided on this machine."""

    kind, code, param = "internal", "blas_unavailable", "blas"


class ModelNotFoundError(NotFoundError, FileNotFoundError):
    """The requested model (or the embedded default's package) is not available."""

    code, param = "model_not_found", "model"


class ConversionError(SpecdecError, ValueError):
    """A model file cannot be converted (unsupported architecture, tensor type or layout)."""

    code, param = "unsupported_model", "model"


class ModelConfigError(SpecdecError, ValueError):
    """The served models' configuration is invalid (a models file's field, a duplicate name
    or alias, a missing path, a draft that cannot serve its target); the server does not
    start."""

    code, param = "invalid_model_config", "model"


class ModelLoadError(UnavailableError):
    """A served model failed to load on demand; the message names the model and the cause
    (the server keeps serving the others, and the next request tries again)."""

    code, param = "model_load_failed", "model"


class ModelsBusy(UnavailableError):
    """Every loaded model is in use or pinned, so none can make room for another; retry
    later."""

    code = "models_busy"


# -- a request's settings --------------------------------------------------------------------
class SamplingError(RequestError):
    """A sampling parameter outside its valid range; the message names value and range.
    `param` is "sampling.<field>" (temperature, top_p, top_k, seed, logit_bias)."""


class DraftConfigError(RequestError):
    """Speculative settings out of range, or a draft that cannot serve this target."""

    param = "spec"


class ChatTemplateError(RequestError):
    """The messages cannot be rendered with this model's chat template."""

    param = "messages"


class ReasoningConflictError(ChatTemplateError):
    """A constrained request would start inside a reasoning block."""

    code = "reasoning_conflict"


class TemplateThinksError(ReasoningConflictError):
    """The chat template opens a reasoning block for the reply and cannot switch it off (an
    always-thinking template): a constrained request there thinks, then answers."""


class ThinkingUnsupportedError(ChatTemplateError):
    """Thinking was asked for, and the chat template has no think block."""

    param, code = "thinking", "thinking_unsupported"


# -- grammars --------------------------------------------------------------------------------
class GrammarError(RequestError):
    """A constraint that cannot be compiled; the message names the offending value.

    Attributes:
        constraint_kind: the constraint kind (`json_schema`, `regex`, ...).
    """

    def __init__(self, kind: str, message: str) -> None:
        what = "tool parameters" if kind == "tools" else f"{kind} constraint"
        super().__init__(f"invalid {what}: {message}",
                         param="tools" if kind == "tools" else "constraint",
                         code="invalid_grammar")
        self.constraint_kind = kind


class SchemaNotRewritable(GrammarError):
    """A JSON schema the keyword rewrite (`schema_rewrite`) cannot hold exactly (`not` of a
    `pattern`, say). Caught there: the keyword stays as written, for the compiler to refuse
    (strict) or warn about (lenient)."""

    def __init__(self, keyword: str) -> None:
        super().__init__("json_schema", f"{keyword!r} cannot be rewritten exactly")
        self.keyword = keyword


class CompileTimeout(GrammarError):
    """A constraint that did not compile within the request's time limit."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(kind, message)
        self.code = "compile_timeout"


class GrammarStateError(SpecdecError, RuntimeError):
    """The request's matcher entered an error state mid-generation; decoding stops (fail
    closed). An internal fault, not bad input: the grammar compiled and every token fed to it
    was allowed by its own mask.

    `str(e)` is one line; llguidance's full report (parser state, grammar) is in `detail`.

    Attributes:
        position: output tokens emitted before the failing one (None when not known).
        detail: llguidance's error text, multi-line.
    """

    kind, code = "internal", "grammar_state"

    def __init__(self, reason: str, *, position: int | None = None, detail: str = "") -> None:
        where = f" at output token {position}" if position is not None else ""
        first = detail.strip().splitlines()[0] if detail.strip() else ""
        super().__init__(f"{reason}{where}" + (f": {first}" if first else ""))
        self.position = position
        self.detail = detail


class GrammarRefused(SpecdecError):
    """The request's grammar, not our code, stopped it mid-generation (a 4xx): it costs too
    much (`GrammarTooComplex`) or it cannot be completed (`GrammarDeadEnd`). Nothing past
    that point is emitted.

    Attributes:
        position: output tokens emitted before the stop.
    """

    position: int | None = None


class GrammarDeadEnd(GrammarRefused):
    """The grammar allows no token (not even the end) after output it allowed: it has a
    dead end (`start: "ab" /[^\\s\\S]/`). Compile-time probing sees only the first mask."""

    code = "invalid_grammar"

    def __init__(self, *, position: int | None = None, param: str = "constraint") -> None:
        where = f" after output token {position}" if position is not None else ""
        super().__init__(f"the grammar allows no continuation{where} (not even the end of "
                         "the output): it has a dead end", param=param)
        self.position = position


class GrammarTooComplex(GrammarRefused):
    """The request's grammar costs more than its budget (`config.MaskBudget`), or it reached
    one of llguidance's parser limits (`grammar.PARSER_LIMITS`): the request is stopped and
    nothing past that point is emitted. The client's grammar, not our fault: a 4xx.

    Attributes:
        position: output tokens emitted before the stop.
    """

    code = "grammar_too_complex"

    def __init__(self, reason: str, *, position: int | None = None,
                 param: str = "constraint") -> None:
        where = f" at output token {position}" if position is not None else ""
        super().__init__(f"the grammar is too costly to follow: {reason}{where}; simplify it "
                         "(fewer ambiguous or nested rules)", param=param)
        self.position = position


class Overspent(GrammarTooComplex):
    """The token budget's closing work went past what the request's grammar budget left
    (`budget.Spend`): the decode core stops the request with a `GrammarTooComplex` naming
    its position.

    Attributes:
        reason: what ran out.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# -- the scheduler ---------------------------------------------------------------------------
class QueueFull(UnavailableError):
    """The scheduler's waiting queue is at its bound; retry later."""

    code = "queue_full"


class SchedulerStopped(UnavailableError):
    """The scheduler stopped after a fatal error (a replica of a sharded target was lost)."""


class Cancelled(SpecdecError):
    """The caller cancelled the request (its client went away); it was stopped."""

    code = "cancelled"


class DeadlineExceeded(SpecdecError):
    """A request ran (or waited) past its time limit; it was stopped, nothing lost."""

    kind, code = "timeout", "timeout"
