"""Continuous batching: one thread runs rounds (`core.run_round`) over every active request.

Requests join and leave at round boundaries. Each round, arriving requests' prompts advance
by at most one prefill chunk in all (one forward), so running requests stall for at most one
chunk; then one round decodes every prefilled request together (one verify forward for all).
Each emitted token goes to the request's output router (`output.Output`), which puts typed
events (`events`) into the request's stream.

Error contract: a request whose setup or grammar fails gets a `Failed` event and leaves;
the loop and the other requests carry on. `submit` raises `QueueFull` when the waiting queue
is at its bound (the server answers 503 with Retry-After).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from . import ragged
from .core import (DecodeState, Models, decode_plainly, keep_answer, mask_decisions,
                   prefill_arrivals, run_round)
from .decode import PromptKVCache
from .errors import (Cancelled, DeadlineExceeded, GrammarTooComplex,  # noqa: F401
                     InternalError, QueueFull, SchedulerStopped, SpecdecError)
from .output import Output
from .prepare import Request
from .speculative import TREE_MIN_SCORE

log = logging.getLogger("specdec.scheduler")
KEPT_LIMIT = 1024  # finished requests' kept states remembered for their history prefill
# A history prefill (background work) starts only once the engine has had no request for this
# long: an agent that sends its next turn sooner (its tool ran at once) has that turn compute
# the history's few tokens with its own, rather than wait behind a forward of their own; one
# that takes longer (a slow tool, a person typing) finds the history computed.
HISTORY_GRACE_S = 0.25


def _background(t: "Ticket") -> bool:
    """A history prefill's ticket (`Request.prefill_only`; a stand-in request: no)."""
    return getattr(t.request, "prefill_only", False) is True


@dataclass(eq=False)
class Ticket:
    """A submitted request: what the scheduler needs to run it and report back.

    Attributes:
        request: the prepared request (`prepare.Request`); the scheduler's `start` builds
            its `DecodeState` (on the scheduler thread).
        output: the request's output router (`output.Output`): it takes each emitted token
            and puts the request's events into its stream.
        cancelled: set by the caller to stop the request within one round.
        timeout_s: the request's time limit from submission (waiting included), or None;
            past it the request ends with `DeadlineExceeded` within one round.
        replica: what a sharded target's replicas need to rebuild the ticket.
    """

    request: Request
    output: Output
    cancelled: threading.Event = field(default_factory=threading.Event)
    timeout_s: float | None = None
    replica: Request | None = None
    key: int = 0  # submission number, set by `submit`
    state: DecodeState | None = None
    t0: float = 0.0

    def overdue(self, now: float) -> bool:
        return self.timeout_s is not None and now - self.t0 > self.timeout_s


@dataclass(frozen=True)
class Decisions:
    """A round's decisions that depend on time and clients, not on the requests: which
    waiting requests join (key, request), which end late, which were cancelled; which sit
    the round out (their next mask is still filling), which decode plainly from now on and
    which are stopped for their grammar's cost (key, error: `core.mask_decisions`); the
    round's token-tree branch threshold where it moved (`speculative.TreeCosts`, priced
    by rank 0's clock; None: the last round's); or stop."""

    admit: tuple[tuple[int, Request | None], ...] = ()
    late: tuple[int, ...] = ()
    gone: tuple[int, ...] = ()
    idle: tuple[int, ...] = ()
    plain: tuple[int, ...] = ()
    over: tuple[tuple[int, SpecdecError], ...] = ()
    tree_min_score: float | None = None
    stop: bool = False


def follower(models: Models, start: Callable[[Request], DecodeState],
             output: Callable[[Request], Output], max_batch: int, chunk: int = 512,
             kv_store: PromptKVCache | None = None) -> Callable[[Decisions], None]:
    """A sharded target's follower rank: a function replaying one round from the decisions
    rank 0 published (`Scheduler.follow`) on a scheduler without a thread; `output` makes
    each admitted request's output router."""
    sched = Scheduler(models, start, max_batch=max_batch, max_queue=0, chunk=chunk,
                      kv_store=kv_store, thread=False)
    return lambda d: sched.follow(d, lambda key, req: Ticket(req, output(req), key=key))


@dataclass
class SchedulerStats:
    """Counters for /metrics (read from other threads; ints and floats only)."""

    rounds: int = 0
    round_s: float = 0.0
    batch_rows_sum: int = 0
    last_batch: int = 0
    cancelled: int = 0
    timed_out: int = 0
    history_prefills: int = 0  # history prefills done (`Engine.keep_history`)
    history_computed: int = 0  # positions they computed (the rest was restored)
    history_superseded: int = 0  # dropped before they ran: their conversation's next
    # request came first (it computes the history with its own prompt)


class Scheduler:
    """Runs submitted requests in rounds on one thread that owns the models.

    Args:
        models: the `core.Models` every request decodes with.
        start: a ticket's request -> its `DecodeState` (`Engine.new_state`).
        max_batch: most requests decoding at once.
        max_queue: most requests waiting for a slot (then `submit` raises QueueFull).
        chunk: prefill chunk (tokens) an arrival advances per round.
        kv_store: prompt-state reuse across requests, or None.
        publish: called once per round, before anything of it runs, with the round's
            decisions that depend on time and clients (`Decisions`); a sharded target's
            replicas apply them to replay the round in lockstep (`distributed`). An
            exception in a published round is fatal: every request fails, `on_fatal` runs.
        thread: run the loop on a thread of its own (False: the caller drives `replay`).
        max_kv_tokens: most KV positions the decoding requests may hold together (each
            counts its prompt, max_tokens and a round's proposals: `kv_positions`); a
            request that would exceed it waits until others leave (None: no bound).
    """

    def __init__(self, models: Models, start: Callable[[Request], DecodeState],
                 max_batch: int = 8, max_queue: int = 64, chunk: int = 512,
                 kv_store: PromptKVCache | None = None,
                 publish: Callable[[Decisions], None] | None = None,
                 on_fatal: Callable[[Exception], None] | None = None,
                 thread: bool = True, max_kv_tokens: int | None = None) -> None:
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch={max_batch} must be >= 1, max_queue={max_queue} >= 0")
        self.models, self.start, self.max_batch, self.max_queue = (models, start, max_batch,
                                                                   max_queue)
        self.chunk, self.kv_store, self.max_kv_tokens = chunk, kv_store, max_kv_tokens
        self.publish, self.on_fatal = publish, on_fatal
        self.fatal: Exception | None = None
        self.round_started: float | None = None  # perf_counter at the current round's start
        self.stats = SchedulerStats()
        self._waiting: deque[Ticket] = deque()
        self._active: list[Ticket] = []
        # finished requests' kept states, by id(request), for their history prefill
        self._kept: dict[int, tuple[tuple[str, tuple[int, ...]], ...]] = {}
        self._cv = threading.Condition()
        self._quiet_since: float | None = 0.0  # since when no request is in hand (None: one
        # is); a history prefill waits `HISTORY_GRACE_S` past it
        self._stop = False
        self._keys = 0
        # The branch threshold rounds use (`TreeCosts.threshold`, to 3 decimals, so that a
        # sharded target's rank 0 publishes it only when it moves).
        self.tree_min_score = TREE_MIN_SCORE
        if thread:
            self._thread = threading.Thread(target=self._loop, name="specdec-scheduler",
                                            daemon=True)
            self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Requests waiting (history prefills, background work, not counted)."""
        return sum(not _background(t) for t in tuple(self._waiting))  # (a snapshot:
        # other threads read it while the loop changes the queue)

    @property
    def active(self) -> int:
        """Requests decoding (history prefills not counted)."""
        return sum(not _background(t) for t in tuple(self._active))

    def kept_for(self, request: Request) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """What a finished request left in the prompt store (`core.keep_answer`), taken
        (once): ("target" or "draft", key) each; () where it left nothing or is unknown."""
        with self._cv:
            return self._kept.pop(id(request), ())

    @property
    def background(self) -> int:
        """History prefills waiting or running (`Engine.keep_history`)."""
        return sum(_background(t) for t in (*tuple(self._waiting), *tuple(self._active)))

    def check_room(self) -> None:
        """Raise what `submit` would raise now for want of room (QueueFull, or
        SchedulerStopped), before a caller spends work preparing a request."""
        with self._cv:
            self._check_room()

    def _check_room(self) -> None:
        """(the caller holds `_cv`)"""
        if self.fatal is not None:  # its text is in the server log, not for clients
            raise SchedulerStopped("the server stopped after a fatal error; see its log")
        if self._stop:
            raise SchedulerStopped("the engine's scheduler has stopped")
        # A request whose caller left while it waited gives its place back now, not when
        # a round would have admitted it.
        left = [t for t in self._waiting if t.cancelled.is_set()]
        for t in left:
            self._waiting.remove(t)
            self.stats.cancelled += 1
            t.output.fail(Cancelled("the request was cancelled while it waited"))
        # Capacity: max_batch decoding plus max_queue waiting (admission lags a round).
        if self.queue_depth + self.active >= self.max_batch + self.max_queue:
            raise QueueFull(f"{self.max_batch} requests are decoding and "
                            f"{len(self._waiting)} waiting (at most {self.max_queue})")

    def submit(self, ticket: Ticket) -> None:
        """Queue a request. Raises QueueFull when `max_queue` requests already wait (a
        history prefill: when `max_batch` of them are in hand already). A request drops the
        waiting history prefills its prompt goes on from (its conversation's: it computes
        and keeps that history itself)."""
        with self._cv:
            self._check_room()
            if _background(ticket) and self.background >= self.max_batch:
                raise QueueFull(f"{self.background} history prefills are in hand")
            prompt = getattr(ticket.request, "prompt_ids", None)  # (a stand-in: none)
            if not _background(ticket) and prompt is not None:
                self._supersede(prompt)
            ticket.t0 = time.perf_counter()
            self._keys += 1
            ticket.key = self._keys
            self._waiting.append(ticket)
            self._cv.notify()

    def _supersede(self, prompt: Sequence[int]) -> None:
        """Drop the waiting history prefills whose history `prompt` starts with (the caller
        holds `_cv`)."""
        for t in [t for t in self._waiting if _background(t)]:
            head = t.request.prompt_ids[:-1]
            if len(prompt) > len(head) and tuple(prompt[:len(head)]) == tuple(head):
                self._waiting.remove(t)
                self.stats.history_superseded += 1

    def _due(self, t: Ticket, now: float) -> bool:
        """Whether waiting ticket `t` may start: a request always; a history prefill once no
        request has been in hand for `HISTORY_GRACE_S` since it was queued (the caller holds
        `_cv`)."""
        if not _background(t):
            return True
        return (self._grace_left(t, now) <= 0 and not any(
            not _background(o) for o in (*self._active, *self._waiting)))

    def _grace_left(self, t: Ticket, now: float) -> float:
        """Seconds a waiting history prefill still waits (the caller holds `_cv`)."""
        quiet = self._quiet_since
        if quiet is None:
            return HISTORY_GRACE_S
        return HISTORY_GRACE_S - (now - max(t.t0, quiet))

    def stop(self, wait_s: float = 0.0) -> None:
        """Stop the loop after its current round (a sharded target's replicas are told);
        wait up to `wait_s` seconds for it."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        thread = getattr(self, "_thread", None)
        if wait_s > 0 and thread is not None and thread is not threading.current_thread():
            thread.join(wait_s)

    # -- the loop ----------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """Whether the scheduler can serve: no fatal error, and its thread (when it has one)
        is running."""
        thread = getattr(self, "_thread", None)
        return self.fatal is None and (thread is None or thread.is_alive() or self._stop)

    def _loop(self) -> None:
        try:
            self._rounds()
        except BaseException as e:  # a fault outside any round's own handling: say so
            log.critical("the scheduler thread stopped on an internal fault; every request "
                         "now fails with 503 until the server is restarted", exc_info=True)
            self._dead(e)
        finally:
            # MLX keeps per-thread streams and a compile cache; released any later (at thread
            # exit, while the interpreter may be finalizing) they abort the process. MLX asks
            # every thread that used it to release them itself.
            mx.clear_streams()

    def _rounds(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._active:
                    now = time.perf_counter()
                    if any(self._due(t, now) for t in self._waiting):
                        break
                    # nothing to run; a history prefill waits out its grace (or a request)
                    left = [self._grace_left(t, now) for t in self._waiting]
                    self._cv.wait(max(min(left), 0.001) if left else None)
                if self._stop:
                    if self.publish is not None and self.fatal is None:
                        self._publish(Decisions(stop=True))
                    tickets = [*self._active, *self._waiting]
                    self._active, self._waiting = [], deque()
                    break
            if not self.pump():
                return
        for t in tickets:  # stopped with requests in hand: each stream ends, none hangs
            if t.state is not None:
                t.state.release()
            t.output.fail(SchedulerStopped("the engine stopped before this request finished"))

    def pump(self) -> bool:
        """One turn of the loop on the calling thread: admit waiting requests, run a round.
        The scheduler thread calls it; so does whoever iterates a stream of a scheduler
        without a thread (`Engine.submit` before `Engine.start`: the caller's thread decodes,
        as MLX work on arrays that thread made must). Returns False once the scheduler
        cannot go on (a sharded target's round failed, or it was aborted)."""
        with self._cv:
            admitted = []
            used = sum(t.request.kv_positions for t in self._active)
            # Requests in order; history prefills (background) after them, where they fit and
            # are due (`_due`): one never holds a request back.
            now = time.perf_counter()
            for t in sorted(self._waiting, key=lambda t: _background(t)):
                if len(self._active) >= self.max_batch:
                    break
                if not self._due(t, now):
                    continue
                need = t.request.kv_positions
                if (self.max_kv_tokens is not None and self._active
                        and used + need > self.max_kv_tokens):
                    if _background(t):
                        continue
                    break  # it waits (in order) until enough of the others have left
                used += need
                self._waiting.remove(t)
                admitted.append(t)
                self._active.append(t)
        try:
            with contextlib.ExitStack() as held:  # the models' forwards: one thread at a time
                for lock in ragged.model_locks(self.models.target, self.models.draft):
                    held.enter_context(lock)
                self.round_started = time.perf_counter()
                self._step(admitted)
            self.round_started = None
            with self._cv:  # (the history prefills' grace counts from here)
                busy = any(not _background(t) for t in self._active)
                if busy:
                    self._quiet_since = None
                elif self._quiet_since is None:
                    self._quiet_since = time.perf_counter()
        except Exception as e:  # a fault outside any one request: fail them all
            self.round_started = None
            if self.fatal is not None:
                return False  # aborted from outside while the round was stuck
            log.exception("scheduler round failed")
            if self.publish is not None:  # the replicas may have diverged: stop
                log.error("the sharded target failed: %s; this server is stopping", e)
                e = SchedulerStopped("the sharded target failed; this server is stopping")
            err = e if isinstance(e, SpecdecError) else InternalError(
                f"a decode round failed: {e}")
            for t in list(self._active):
                self._finish(t, error=err)
            self._active = []
            if self.publish is not None:
                self._die(e)
                return False
        return True

    def _publish(self, d: Decisions) -> None:
        assert self.publish is not None
        self.publish(d)

    def _dead(self, e: BaseException) -> None:
        """The loop itself failed: every request in hand and every later one fails at once
        (the clients are told the server cannot serve, not the fault's text)."""
        err = SchedulerStopped("the engine stopped after an internal fault; see the server "
                               "log")
        with self._cv:
            if self.fatal is None:
                self.fatal = err
            tickets = [*self._active, *self._waiting]
            self._active, self._waiting = [], deque()
        for t in tickets:
            if t.state is not None:
                t.state.release()
            t.output.fail(err)

    def _die(self, e: Exception) -> None:
        """A published round failed (a replica lost, say): fail every request, accept no
        more, and tell the owner."""
        with self._cv:
            self.fatal = e
            waiting, self._waiting = list(self._waiting), deque()
        for t in waiting:
            self._finish(t, error=e)
        if self.on_fatal is not None:
            self.on_fatal(e)

    def abort(self, e: Exception) -> None:
        """From another thread, while a round is stuck (a collective that never returns):
        fail every request now and accept no more. The loop does not run again."""
        with self._cv:
            if self.fatal is not None:
                return
            self.fatal = e
            self._stop = True
            tickets = [*self._active, *self._waiting]
            self._waiting = deque()
        for t in tickets:
            t.output.fail(e)
        if self.on_fatal is not None:
            self.on_fatal(e)

    def _late(self) -> list[Ticket]:
        """Requests past their time limit, decoding or still waiting (taken off the queue)."""
        now = time.perf_counter()
        with self._cv:
            late = [t for t in self._waiting if t.overdue(now)]
            for t in late:
                self._waiting.remove(t)
        return late + [t for t in self._active if t.overdue(now) and not t.cancelled.is_set()]

    def _step(self, admitted: list[Ticket] = ()) -> None:  # type: ignore[assignment]
        late = self._late()
        gone = [t for t in self._active if t.cancelled.is_set() and t not in late]
        ready = {id(t.state): t for t in self._active if t.state is not None
                 and t.state.ready and t not in late and t not in gone}
        v = mask_decisions(self.models.masks, [t.state for t in ready.values()])
        idle, plain = [ready[id(s)] for s in v.idle], [ready[id(s)] for s in v.plain]
        over = [(ready[id(s)], e) for s, e in v.over]
        trees = getattr(self.models, "trees", None)
        tree = round(trees.threshold(), 3) if trees is not None else TREE_MIN_SCORE
        moved, self.tree_min_score = tree != self.tree_min_score, tree
        if self.publish is not None:
            self._publish(Decisions(admit=tuple((t.key, t.replica) for t in admitted),
                                    late=tuple(t.key for t in late),
                                    gone=tuple(t.key for t in gone),
                                    idle=tuple(t.key for t in idle),
                                    plain=tuple(t.key for t in plain),
                                    over=tuple((t.key, e) for t, e in over),
                                    tree_min_score=tree if moved else None))
        self.replay(late, gone, idle, plain, over)

    def admit(self, ticket: Ticket) -> None:
        """Make a ticket active now (a replica admitting what the leader admitted)."""
        self._active.append(ticket)

    def follow(self, d: Decisions, ticket: Callable[[int, Request], Ticket]) -> None:
        """A replica's round (a sharded target's follower rank, without a thread): admit
        what the leader admitted (`ticket` builds each from its key and request), apply the
        leader's decisions and its branch threshold, and replay the round (`replay`)."""
        for key, req in d.admit:
            assert req is not None, "a leader publishes each admitted request"
            self.admit(ticket(key, req))
        by_key = {t.key: t for t in self._active}
        late, gone, idle, plain = ([by_key[k] for k in keys if k in by_key]
                                   for keys in (d.late, d.gone, d.idle, d.plain))
        over = [(by_key[k], e) for k, e in d.over if k in by_key]
        if d.tree_min_score is not None:  # priced by rank 0's clock, not this rank's
            self.tree_min_score = d.tree_min_score
        self.replay(late, gone, idle, plain, over)

    def replay(self, late: list[Ticket], gone: list[Ticket], idle: Sequence[Ticket] = (),
               plain: Sequence[Ticket] = (),
               over: Sequence[tuple[Ticket, SpecdecError]] = ()) -> None:
        """Run one round given its decisions: `late` requests end with DeadlineExceeded,
        `gone` ones (their clients left) are dropped, `over` ones end with their grammar
        budget's error, `plain` ones decode plainly from now on, `idle` ones sit the round
        out; the round's branch threshold is `tree_min_score` (a replica sets it from the
        leader's `Decisions`); everything else in the round follows from the requests
        themselves, so replicas that apply the same decisions run the same forwards."""
        for t, e in over:
            if t in self._active:
                self._finish(t, error=e)
        for t in plain:
            if t.state is not None:
                decode_plainly(t.state, "plain decoding: the grammar's masks are slow")
        for t in late:
            self.stats.timed_out += not _background(t)
            self._finish(t, error=DeadlineExceeded(
                f"the request ran past the server's time limit of {t.timeout_s:g}s"))
        for t in gone:
            if t in self._active:
                self.stats.cancelled += 1
                self._active.remove(t)
                if t.state is not None:
                    t.state.release()
                t.output.fail(Cancelled("the request was cancelled"))
        for t in list(self._active):
            if t.state is None:
                try:
                    t.state = self.start(t.request)
                except Exception as e:
                    self._finish(t, error=e if isinstance(e, SpecdecError) else InternalError(
                        f"the request could not start: {e}"))
        # Arrivals' prefill advances by at most one chunk (in all) per round, in one forward;
        # a history prefill (background work) only in a round where no request's does.
        arriving = [t for t in self._active if t.state is not None and t.state.to_prefill]
        if any(not _background(t) for t in arriving):
            arriving = [t for t in arriving if not _background(t)]
        if arriving:
            try:
                prefill_arrivals(self.models, [t.state for t in arriving], self.chunk,
                                 self.kv_store)
            except Exception as e:
                if self.publish is not None:
                    raise  # a sharded target's ranks may have diverged: the round fails
                # Only the arriving requests were in that forward: they fail, not the others.
                log.exception("a prefill forward failed")
                for t in arriving:
                    self._finish(t, error=e if isinstance(e, SpecdecError) else InternalError(
                        f"the prompt's prefill failed: {e}"))
        for t in [t for t in self._active if _background(t) and t.state is not None
                  and t.state.to_prefill == 0]:
            s = t.state
            s.finish = "stop"  # a history prefill: stored, nothing to generate
            computed = len(s.prompt) - 1 - s.stats.prompt_cached
            self.stats.history_prefills += 1
            self.stats.history_computed += computed
            if computed and self.kv_store is not None:  # its state stored: the answer's goes
                head = tuple(s.prompt[:-1])
                for role, key in t.request.supersedes:
                    model = self.models.target if role == "target" else self.models.draft
                    if key != head and model is not None:
                        self.kv_store.drop(model, key, s.reuse.scope)
            self._finish(t)
        ready = [t for t in self._active if t.state is not None and t.state.ready
                 and t not in idle]
        if ready:
            t0 = time.perf_counter()
            run_round(self.models, [t.state for t in ready], self.tree_min_score)
            spent = time.perf_counter() - t0
            self.stats.rounds += 1
            self.stats.round_s += spent
            for t in ready:
                if not t.state.stats.first_round_s:
                    t.state.stats.first_round_s = spent
            self.stats.batch_rows_sum += len(ready)
            self.stats.last_batch = len(ready)
        for t in ready:
            s = t.state
            assert s is not None
            if s.new_tokens and t not in gone:
                lps, srcs = s.reported.logprobs, s.reported.sources or ()
                for j, tok in enumerate(s.new_tokens):
                    if t.output.feed(tok, lps[j] if j < len(lps) else None,
                                     srcs[j] if j < len(srcs) else None
                                     ):  # a stop string ended the output
                        s.finish = "stop"
                        break
            if s.error is not None:
                self._finish(t, error=s.error)
            elif s.finish is not None:
                self._finish(t)

    def _finish(self, t: Ticket, error: SpecdecError | None = None) -> None:
        if t in self._active:
            self._active.remove(t)
        seconds = time.perf_counter() - t.t0
        if t.state is not None:
            s = t.state
            if error is None and s.reuse.suffixes is not None:  # it proposes for later answers
                s.reuse.suffixes.add(s.reuse.key, s.seq[len(s.prompt):], lead=s.prompt)
            if (error is None and self.kv_store is not None and not _background(t)
                    and getattr(t.request, "keep", True)):
                kept = keep_answer(self.models, s, self.kv_store)  # the next turn's prefix
                if kept:
                    with self._cv:  # (read by `kept_for` on other threads)
                        self._kept[id(t.request)] = kept
                        while len(self._kept) > KEPT_LIMIT:
                            self._kept.pop(next(iter(self._kept)))
            t.state.release()
            if isinstance(error, GrammarTooComplex) and s.emitted <= 1 and \
                    t.request.grammar is not None:
                t.request.grammar.evict()  # too costly at its first step: not kept
            if not self._active or t.request.kv_positions > ragged.SLOT_POSITIONS:
                mx.clear_cache()  # MLX keeps freed buffers for reuse: memory goes back now
        if error is not None:
            t.output.fail(error)
            return
        s = t.state
        assert s is not None and s.finish is not None
        t.output.finish(s.finish, s.stats, seconds)
