"""Background responses (`background: true` on `POST /v1/responses`), OpenAI's semantics.

The request is answered at once: the response object, status `queued` (with `stream: true`,
its events as they come). The run goes on whether or not its client stays (`Run.detached`):
`GET /v1/responses/{id}` polls it (the output so far while it runs), `POST
/v1/responses/{id}/cancel` stops it (status `cancelled`, what it wrote so far kept; idempotent:
a response already ended is answered as it is), `GET /v1/responses/{id}?stream=true
&starting_after=N` replays its events after sequence number N and then follows it live.

Stored from the start: the response is written `queued` before the answer goes out, and
written again when it ends (completed or incomplete: added to its conversation as any turn;
cancelled or failed: not), so a poll after a restart finds it; a server that stops with
background responses running marks them `failed` when it starts again
(`Store.interrupted`), never leaving one `in_progress`. Each one's events stay in memory
while it runs and for the `KEPT` background responses that ended last (`KEPT_EVENTS` events
at most; a resume after that, or after a restart, is a 400 saying so: retrieve the response
instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from specdec.events import Failed

from .door import Door, Run, SSEEvent, request_headers, sse
from .errors import WireError, bad_request

log = logging.getLogger("specdec.server")

TERMINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})
KEPT = 256  # ended background responses whose events stay for a resume, at most
KEPT_EVENTS = 100_000  # and their events in all (a long answer's stream is one per delta)


@dataclass
class Job:
    """One background response: its run, its writer (`responses.Writer`: its events and
    output so far, `final` once it ended; `cancel`, `fail_all`), its events, and whether it
    ended."""

    writer: Any
    run: Run
    events: list[SSEEvent] = field(default_factory=list)
    status: str = "queued"
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    cancelled: bool = False

    @property
    def rid(self) -> str:
        return self.writer.head["id"]

    @property
    def owner(self) -> str:
        return self.writer.turn.owner

    @property
    def ended(self) -> bool:
        return self.status in TERMINAL

    def add(self, events: list[SSEEvent]) -> None:
        if events:
            self.events.extend(events)
            self.changed.set()
            self.changed = asyncio.Event()

    def snapshot(self) -> dict[str, Any]:
        """The response as it stands (the writer's final object once it ended)."""
        w = self.writer
        if w.final is not None:
            return w.final
        return {**w.head, "status": self.status, "output": copy.deepcopy(w.items)}

    async def follow(self, after: int) -> AsyncIterator[str]:
        """Its events after sequence number `after` (the event at index n has sequence
        number n), then the new ones as they come, until it ends."""
        at = after + 1
        while True:
            while at < len(self.events):
                name, data = self.events[at]
                yield sse(name, data)
                at += 1
            if self.ended:
                return
            await self.changed.wait()


class Backgrounds:
    """The background responses of one server: running, and the `KEPT` that ended last."""

    def __init__(self, door: Door) -> None:
        self.door = door
        self.jobs: OrderedDict[str, Job] = OrderedDict()

    def get(self, rid: str, owner: str) -> Job | None:
        job = self.jobs.get(rid)
        return job if job is not None and job.owner == owner else None

    async def start(self, writer: Any, run: Run, stream: bool) -> Response:
        """Take `run` over: store it queued, drive it in a task, answer now."""
        turn, store = writer.turn, self.door.store
        assert store is not None  # (`Turn.of` refuses background without a store)
        run.detached = True
        job = Job(writer, run)
        try:
            await self.door.stored(store.put_turn, job.snapshot(), turn.own, stored=True,
                                   parent=turn.parent, conversation=turn.conversation,
                                   upto=turn.upto, owner=turn.owner, final=False,
                                   runner=self.door.runner)
        except BaseException:
            run.close()
            raise
        self.jobs[job.rid] = job
        job.add(writer.opening())
        job.status = "in_progress"
        job.task = asyncio.get_running_loop().create_task(self._drive(job))
        headers = {**writer.headers(), **request_headers(run.request)}
        if stream:
            return StreamingResponse(job.follow(-1), media_type="text/event-stream",
                                     headers=headers)
        return JSONResponse({**job.snapshot(), "status": "queued"}, headers=headers)

    async def _drive(self, job: Job) -> None:
        w = job.writer
        try:
            async with contextlib.aclosing(job.run.events()) as events:
                async for ev in events:
                    job.add(w.feed(ev))
                    if isinstance(ev, Failed):
                        await self._keep(job)  # failed: kept, its conversation untouched
            if w.final is None:  # the run ended without an answer (stopped by the server)
                job.add(w.fail_all("the server stopped this response"))
                await self._keep(job)
        except asyncio.CancelledError:
            if w.final is None:  # (one that ended meanwhile stays as it ended)
                job.add(w.cancel())
                await self._keep(job)
        except Exception as e:  # never a background task's silent death
            log.exception("background response %s failed", job.rid)
            job.add(w.fail_all(f"the server failed while writing this response: {e}"))
            await self._keep(job)
        finally:
            job.status = (w.final or {}).get("status", "failed")
            job.changed.set()
            self._ended(job)

    async def _keep(self, job: Job) -> None:
        """Store an unsuccessful end (cancelled or failed: not added to its conversation;
        a completed or incomplete one the writer keeps as every turn)."""
        turn, store = job.writer.turn, self.door.store
        assert store is not None and job.writer.final is not None
        try:
            await self.door.stored(store.put_turn, job.writer.final, turn.own, stored=True,
                                   parent=turn.parent, conversation=turn.conversation,
                                   upto=turn.upto, owner=turn.owner, final=False,
                                   runner=self.door.runner)
        except Exception as e:  # (logged and counted by `stored`; the answer stands)
            log.error("background response %s's end was not stored: %s", job.rid, e)
        finally:
            turn.ended()

    def _ended(self, job: Job) -> None:
        """Keep the events of the background responses that ended last: at most `KEPT`
        of them and `KEPT_EVENTS` events in all (the oldest go first)."""
        self.jobs.move_to_end(job.rid)
        ended = [j for j in self.jobs.values() if j.ended]
        events = sum(len(j.events) for j in ended)
        while ended and (len(ended) > KEPT or events > KEPT_EVENTS):
            gone = ended.pop(0)
            events -= len(gone.events)
            del self.jobs[gone.rid]

    async def cancel(self, rid: str, owner: str) -> dict[str, Any] | None:
        """Stop a running background response; its object once stopped (None: not one
        running here)."""
        job = self.get(rid, owner)
        if job is None:
            return None
        if not job.ended and job.writer.final is None and job.task is not None:
            job.cancelled = True
            job.task.cancel()
            await asyncio.wait([job.task])
        return job.snapshot()

    def stream(self, rid: str, owner: str, after: int | None, stored: dict[str, Any]
               ) -> Response:
        """A background response's events after `after`, then live (`Job.follow`).

        Raises:
            WireError: 400 for a response not created in the background, or one whose
                events are no longer kept here; 409 for one another server runs.
        """
        if not stored.get("background"):
            raise bad_request(f"response {rid!r} was not created with background: true; only "
                              "a background response can be streamed by id", "stream")
        job = self.get(rid, owner)
        if job is None:
            elsewhere(rid, stored)
            raise bad_request(f"the events of response {rid!r} are no longer kept (it ended "
                              "before this server's last restart, or long ago): retrieve it "
                              "without stream", "stream")
        if after is not None and after < 0:
            raise bad_request("starting_after must be a sequence number (>= 0)",
                              "starting_after")
        return StreamingResponse(job.follow(-1 if after is None else after),
                                 media_type="text/event-stream")


def elsewhere(rid: str, stored: dict[str, Any]) -> None:
    """Raise a 409 for a background response stored as running that this server does not
    run (another replica sharing the store does: only that one can stop or stream it)."""
    if stored.get("status") in ("queued", "in_progress"):
        raise WireError(409, f"response {rid!r} is running on another server sharing this "
                        "store: send this request to that server (deploy/haproxy.cfg routes "
                        "it there by the response's id)", code="response_running_elsewhere")
