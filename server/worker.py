"""The engine's scheduler, adapted to asyncio handlers: one thread owns the models and runs
rounds over every active request (continuous batching); each request's events travel back
through its job's asyncio queue. A job whose client went away is cancelled within one round.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from specdec.decode import GrammarStateError
from specdec.distributed import for_replicas
from specdec.engine import Engine, Request
from specdec.scheduler import DeadlineExceeded, Event, Scheduler, Ticket
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
    """Runs jobs on the engine's scheduler, up to `max_batch` at once.

    Events posted to `job.events`: ("token", id, text_delta), ("done", finish_reason, text,
    stats, seconds), ("error", exception). `submit` raises `scheduler.QueueFull` when
    `max_queue` jobs already wait for a slot.
    """

    def __init__(self, engine: Engine, max_batch: int = 8, max_queue: int = 64,
                 request_timeout_s: float | None = None, channel: Any = None,
                 on_fatal: Any = None) -> None:
        self.engine, self.request_timeout_s = engine, request_timeout_s
        self.channel = channel  # a sharded target: rounds are published to the other ranks
        self.scheduler = Scheduler(engine.models, max_batch=max_batch, max_queue=max_queue,
                                   kv_store=engine.kv_store,
                                   publish=channel.publish if channel is not None else None,
                                   on_fatal=on_fatal)

    @property
    def queue_depth(self) -> int:
        return self.scheduler.queue_depth

    def submit(self, job: Job) -> None:
        engine, req = self.engine, job.request
        stats = SpecStats()

        def sink(ev: Event) -> None:
            if ev.error is not None:
                e = ev.error
                if isinstance(e, GrammarStateError):  # an internal fault: keep what locates it
                    g = req.grammar
                    log.error("grammar state error at output token %s: %s\nconstraint: %s\n"
                              "grammar: %s", e.position, e.detail or e, req.constraint,
                              g.text if g else None)
                elif isinstance(e, DeadlineExceeded):
                    log.warning("request stopped: %s", e)
                else:
                    log.error("generation failed: %r", e)
                job.post("error", e)
            elif ev.final:
                job.post("done", ev.finish, ev.full_text, ev.stats, ev.seconds)
            else:
                job.post("token", ev.tokens[0], ev.text, ev.logprobs)

        self.scheduler.submit(Ticket(start=lambda: engine.new_state(req, stats),
                                     text=engine.text_stream(req), sink=sink,
                                     cancelled=job.cancelled,
                                     timeout_s=self.request_timeout_s,
                                     request=for_replicas(req) if self.channel else None))

    def stop(self) -> None:
        self.scheduler.stop()
