"""The one stand-in engine for the APIs' in-process protocol tests: what `create_app` and
`Door` use of an engine, recording each `GenerateRequest` it is given and answering with a
scripted event stream (no model, no subprocess). `post` sends one body to an app through
httpx's ASGI transport."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import httpx

from specdec.engine import EngineStatus
from specdec.errors import SpecdecError
from specdec.events import (Event, Finished, GenerationStats, RequestStream, ToolCall,
                            Usage)
from specdec.prepare import Request
from specdec.request import GenerateRequest
from specdec.scheduler import SchedulerStats
from specdec.speculative import SpecStats

PROMPT = (1, 2, 3, 4)
Script = Sequence[Event] | Callable[[GenerateRequest], Sequence[Event]]


class Tokenizer:
    """Token `t` is the text `<t>` (what `chat.logprobs_of` decodes)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"<{t}>" for t in ids)


def finished(text: str = "", reasoning: str | None = None, finish: str = "stop",
             calls: tuple[ToolCall, ...] = (), *, prompt_tokens: int = 7,
             completion_tokens: int = 5, reasoning_tokens: int | None = None, seed: int = 3,
             warnings: tuple[str, ...] = (), stop_sequence: str | None = None,
             logprobs: tuple[Any, ...] = (), tokens: tuple[int, ...] = (),
             sources: tuple[Any, ...] = ()) -> Finished:
    """A run's last event: its text, reasoning and calls, usage and stats (and the tokens
    behind them, with their logprobs and sources, where a test gives them)."""
    stats = GenerationStats(prompt_tokens, completion_tokens, 0.1, seed, 0, SpecStats(), 0.2)
    return Finished(finish, text, reasoning, calls, tokens, logprobs,  # type: ignore[arg-type]
                    Usage(prompt_tokens, completion_tokens, reasoning_tokens), stats, warnings,
                    stop_sequence, sources)


def raises(param: str, message: str = "bad") -> Callable[[GenerateRequest], Sequence[Event]]:
    """A script whose `prepare` refuses the request, naming the engine's field `param`."""
    def script(g: GenerateRequest) -> Sequence[Event]:
        raise SpecdecError(message, param=param)
    return script


class FakeEngine:
    """`script` gives the events of each request: a list, or a function of the request
    (which may raise, as `prepare` does for bad input). `seen` holds the requests
    prepared, in order.

    Args:
        name: the served model's name. prompt: the prepared request's prompt ids.
    """

    def __init__(self, script: Script = (), name: str = "fake",
                 prompt: tuple[int, ...] = PROMPT) -> None:
        self.target = SimpleNamespace(name=name, vocab_size=100, tokenizer=Tokenizer())
        self.script, self.prompt = script, prompt
        self.seen: list[GenerateRequest] = []
        self.events: list[Event] = []

    def start(self, **_: Any) -> None:
        pass

    def check_room(self) -> None:
        pass

    def status(self) -> EngineStatus:
        return EngineStatus(True, False, 0, 0, SchedulerStats(), None)

    def close(self, **_: Any) -> None:
        pass

    def prepare(self, greq: GenerateRequest) -> Request:
        self.seen.append(greq)
        self.events = list(self.script(greq) if callable(self.script) else self.script)
        return Request(self.prompt, sampling=greq.sampling, logprobs=greq.logprobs,
                       token_sources=greq.token_sources)

    def submit(self, req: Request, stream: RequestStream) -> RequestStream:
        for ev in self.events:
            stream.put(ev)
        return stream


def post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    """One request to the app, in process; the response read whole."""
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as c:
            return await c.post(path, json=body)
    return asyncio.run(go())
