"""Fault injection for the mid-generation grammar error path: `python -m tests.faults N ARGS`
runs `specdec ARGS` with every request's matcher failing when it consumes output token N, as
a matcher whose state went wrong would (look-ahead copies work normally, so proposals and
masks are real). The CLI and the server must report it as an internal fault and emit nothing
past it.
"""

from __future__ import annotations

import sys
from typing import Any


class FaultyMatcher:
    """An `LLMatcher` whose `consume_token` fails at output token `fail_at`."""

    def __init__(self, m: Any, fail_at: int) -> None:
        self._m, self._fail_at, self._n, self._err = m, fail_at, 0, False

    def consume_token(self, t: int) -> bool:
        if self._err or self._n >= self._fail_at:
            self._err = True
            return False
        self._n += 1
        return bool(self._m.consume_token(t))

    def is_error(self) -> bool:
        return self._err or bool(self._m.is_error())

    def get_error(self) -> str:
        if self._err:
            return (f"Parser Error: injected fault at output token {self._fail_at}\n"
                    "<state>multi-line parser state</state>")
        return str(self._m.get_error())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._m, name)


def install(fail_at: int) -> None:
    from specdec.grammar import CompiledGrammar

    # (a request decodes with `state()`: the matcher, or the matcher with the array rule)
    real = CompiledGrammar.state
    CompiledGrammar.state = lambda self: FaultyMatcher(real(self), fail_at)  # type: ignore


if __name__ == "__main__":
    install(int(sys.argv[1]))
    from specdec.cli import main

    raise SystemExit(main(sys.argv[2:]))
