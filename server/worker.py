"""One thread owns the MLX model; HTTP handlers talk to it through queues.

Exceptions travel back through the job's queue; a job whose client went away is cancelled
between tokens.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from specdec.decode import GrammarStateError
from specdec.engine import Engine, Request
from specdec.speculative import SpecStats

log = logging.getLogger("specdec.server")


@dataclass
class Job:
    request: Request
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def post(self, kind: str, *payload: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, *payload))


class EngineWorker:
    """Runs jobs one at a time on a dedicated thread.

    Events posted to `job.events`: ("token", id, text_delta), ("done", finish_reason, text,
    timings, seconds), ("error", exception).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="specdec-engine", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return self._jobs.qsize()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            try:
                self._run(job)
            except GrammarStateError as e:  # an internal fault: keep what locates it
                g = job.request.grammar
                log.error("grammar state error at output token %s: %s\nconstraint: %s\n"
                          "grammar: %s", e.position, e.detail or e,
                          job.request.constraint, g.text if g else None)
                job.post("error", e)
            except Exception as e:  # travels to the handler, never kills the worker
                log.exception("generation failed")
                job.post("error", e)

    def _run(self, job: Job) -> None:
        timings = SpecStats()
        t0 = time.perf_counter()
        gen = self.engine.run(job.request, timings)
        while True:
            if job.cancelled.is_set():
                gen.close()
                return
            try:
                tok, delta = next(gen)
            except StopIteration as end:
                finish, text = end.value
                job.post("done", finish, text, timings, time.perf_counter() - t0)
                return
            job.post("token", tok, delta)
