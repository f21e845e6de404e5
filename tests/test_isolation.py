"""One request costs its own time, not its neighbours': a grammar whose masks are slow, an
exception in one request's part of a round, a scheduler thread that dies, the KV budget, a
request past its time limit.

Slowness is injected (`SlowMasks`: fills that sleep, taking no CPU from the forward), so what
the tests see is the scheduler's behaviour, not the machine's load; the real hostile grammar
(ambiguous Lark) is checked against llguidance's own limit with a lowered item limit.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import openai
import pytest

from specdec.events import Failed, Finished
from specdec.grammar import Constraint
from specdec.request import GenerateRequest, Message
from specdec.sampling import SamplingParams
from tests.serverproc import error_of, serve_app

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
AMBIGUOUS = "start: e\ne: e e | /[a-z]/"  # masks grow with the output: 6 ms to seconds


class SlowMasks:
    """An `LLMatcher` whose mask fills sleep `delay` seconds once `after` tokens are in (its
    copies too: the draft's and the verifier's look-ahead). Counts fills that slept on the
    scheduler's own thread (inside a round) and on mask workers (between rounds)."""

    def __init__(self, inner: Any, after: int, delay: float, seen: dict[str, int],
                 n: int = 0, sleeps: list[tuple[float, float]] | None = None) -> None:
        self.inner, self.after, self.delay, self.seen, self.n = inner, after, delay, seen, n
        self.sleeps = [] if sleeps is None else sleeps  # between rounds: (from, to)

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        if self.n >= self.after:
            where = "in_round" if threading.current_thread().name == "specdec-scheduler" \
                else "between_rounds"
            self.seen[where] = self.seen.get(where, 0) + 1
            t0 = time.perf_counter()
            time.sleep(self.delay)
            if where == "between_rounds":
                self.sleeps.append((t0, time.perf_counter()))
        self.inner.unsafe_compute_mask_ptr(ptr, size)

    def consume_token(self, t: int) -> bool:
        self.n += 1
        return bool(self.inner.consume_token(t))

    def deep_copy(self) -> "SlowMasks":
        return SlowMasks(self.inner.deep_copy(), self.after, self.delay, self.seen, self.n,
                         self.sleeps)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def slow_for(engine: Any, pattern: str, after: int, delay: float,
             sleeps: list[tuple[float, float]] | None = None) -> dict[str, int]:
    """Make the masks of requests constrained by regex `pattern` slow (see `SlowMasks`;
    `sleeps` gets the between-round fills' sleeps)."""
    seen: dict[str, int] = {}
    plain = engine.matcher

    def matcher(req: Any) -> Any:
        m = plain(req)
        if req.constraint is not None and req.constraint.value == pattern:
            return SlowMasks(m, after, delay, seen, sleeps=sleeps)
        return m

    engine.matcher = matcher
    return seen


def rounds_of_others(log: list[float]) -> Any:
    """A `core.run_round` that appends to `log` the end of each round that decoded a request
    whose masks are not slow (a neighbour)."""
    from specdec import scheduler

    run_round = scheduler.run_round

    def logged(models: Any, states: Any, *args: Any) -> None:
        others = any(s.ready and not (s.grammar is not None
                                      and isinstance(s.grammar.state, SlowMasks))
                     for s in states)
        run_round(models, states, *args)
        if others:
            log.append(time.perf_counter())

    return logged


def run(engine: Any, req: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    for ev in engine.submit(req):
        if isinstance(ev, (Finished, Failed)):
            return ev, time.perf_counter() - t0
    raise AssertionError("a stream ended without Finished or Failed")


def person(engine: Any) -> Any:
    return engine.prepare(GenerateRequest(messages=(Message("user", "A person as JSON"),),
                                          constraint=Constraint.json_schema(PERSON),
                                          max_tokens=16))


@pytest.fixture
def budget_engine(embedded, distilled):
    """An engine with the serving defaults' draft and a grammar budget of 1 s a mask, 3 s
    in all."""
    from specdec.config import MaskBudget
    from specdec.engine import Engine
    from specdec.speculative import SpecConfig

    e = Engine(embedded, distilled, SpecConfig(4, lookup=True, draft_min_prob=0.3),
               masks=MaskBudget(slow_s=0.05, mask_s=1.0, total_s=3.0))
    e.start(max_batch=4)
    yield e
    e.close()


def test_a_slow_grammar_costs_its_own_request_not_its_neighbours(budget_engine):
    from unittest import mock

    from specdec import scheduler

    e = budget_engine
    # Each fill past token 3 takes 0.4 s (an injected sleep): slow (> 0.05 s), under the 1 s
    # a mask, so the request goes on plainly, its fills between rounds, until its 3 s in all
    # are spent.
    sleeps: list[tuple[float, float]] = []
    seen = slow_for(e, "[a-z]+", after=3, delay=0.4, sleeps=sleeps)
    run(e, person(e))  # warm
    alone = [run(e, person(e)) for _ in range(2)]
    eos = tuple((t, -100.0) for t in e.target.eos_token_ids)
    hostile = e.prepare(GenerateRequest(
        messages=(Message("user", "Letters"),), constraint=Constraint.regex("[a-z]+"),
        max_tokens=64, sampling=SamplingParams(logit_bias=eos)))
    box: dict[str, Any] = {}
    ends: list[float] = []  # the ends of the rounds that decoded a neighbour
    with mock.patch.object(scheduler, "run_round", rounds_of_others(ends)):
        th = threading.Thread(target=lambda: box.update(r=run(e, hostile)))
        th.start()
        beside = [run(e, person(e)) for _ in range(2)]
        th.join(timeout=120)
    ev, _ = box["r"]
    # The hostile request gets the documented error, at the token its masks turned slow.
    assert isinstance(ev, Failed) and ev.error.code == "grammar_too_complex", ev
    assert ev.error.kind == "invalid_request" and ev.error.position is not None
    # Its slow fills ran between rounds, on mask workers; inside a round at most the one that
    # showed it slow (a fill cannot be interrupted), then its round proposed no further.
    assert seen.get("between_rounds", 0) >= 5, seen
    assert seen.get("in_round", 0) <= 1, seen
    # The neighbours decoded the same tokens, and did not wait for its slow fills: rounds
    # that decoded them ended while one of those fills was still sleeping (a round that
    # waited for a fill would start only after its sleep). Orderings, not speeds: whatever
    # the machine's pace, a neighbour's round is far shorter than the 0.4 s injected.
    want = [r[0].tokens for r in alone]
    assert [r[0].tokens for r in beside] == want
    # Not once by chance: rounds that decoded them ended inside at least two of its fills.
    during = [(t0, t1) for t0, t1 in sleeps if any(t0 < t < t1 for t in ends)]
    assert len(during) >= 2, (ends, sleeps)


def test_the_parser_item_limit_is_a_4xx_with_one_short_log_line(embedded, caplog):
    # The ambiguous grammar reaches llguidance's per-row item limit as its output grows (at
    # the 2000-item default after a few hundred letters; lowered here to 50 to get there in
    # a few tokens). It is the client's grammar: a 400 grammar_too_complex, logged once, short.
    from server.app import create_app
    from specdec.engine import Engine
    from tests.serverproc import InProcess

    e = Engine(embedded, parser_limits={"max_items_in_row": 50})
    srv = InProcess(create_app(e), e)
    try:
        client = srv.client()
        eos = {str(t): -100 for t in e.target.eos_token_ids}
        with caplog.at_level(logging.INFO, logger="specdec"):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(
                    model="default", messages=[{"role": "user", "content": "letters"}],
                    max_tokens=200, logit_bias=eos,
                    extra_body={"structured_outputs": {"grammar": AMBIGUOUS}})
        body = err.value.body
        assert body["code"] == "grammar_too_complex", body
        assert "items" in body["message"] and "Tokens:" not in body["message"]
        lines = [r.getMessage() for r in caplog.records if "grammar" in r.getMessage()]
        assert len(lines) == 1 and len(lines[0]) < 1000, lines
        ok = client.chat.completions.create(model="default", max_tokens=4,
                                            messages=[{"role": "user", "content": "hi"}])
        assert ok.choices[0].message.content is not None  # the server goes on serving
    finally:
        srv.stop()


def test_an_exception_in_one_request_fails_it_alone(budget_engine):
    e = budget_engine
    alone, _ = run(e, person(e))
    plain = e.matcher

    class Broken:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def consume_token(self, t: int) -> bool:
            raise RuntimeError("injected fault")

        def deep_copy(self) -> Any:
            return self.inner.deep_copy()  # look-ahead copies are sound

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    e.matcher = lambda req: Broken(plain(req)) if req.max_tokens == 29 else plain(req)
    bad = e.prepare(GenerateRequest(messages=(Message("user", "A person as JSON"),),
                                    constraint=Constraint.json_schema(PERSON), max_tokens=29))
    box: dict[str, Any] = {}
    th = threading.Thread(target=lambda: box.update(r=run(e, bad)))
    th.start()
    good, _ = run(e, person(e))
    th.join(timeout=60)
    assert isinstance(box["r"][0], Failed) and box["r"][0].error.kind == "internal"
    assert isinstance(good, Finished) and good.tokens == alone.tokens


def test_a_dead_scheduler_thread_turns_health_503_and_fails_requests_at_once(served_models):
    srv = serve_app("--max-batch", "1", models=served_models)
    try:
        sched = srv.engine.scheduler  # type: ignore[attr-defined]
        assert srv.http.get("/health").status_code == 200
        gate = threading.Event()

        def die() -> bool:
            gate.wait(30)
            raise RuntimeError("injected: the loop's own code failed")

        sched.pump = die  # the next turn of the loop raises outside any round
        client = srv.client()
        got: list[Any] = []

        def ask() -> None:
            try:
                client.chat.completions.create(model="default", max_tokens=4,
                                               messages=[{"role": "user", "content": "hi"}])
                got.append(200)
            except openai.APIStatusError as e:
                got.append(e.status_code)

        threads = [threading.Thread(target=ask) for _ in range(2)]
        for t in threads:
            t.start()
        while sched.queue_depth + sched.active < 2:
            time.sleep(0.01)
        gate.set()
        for t in threads:
            t.join(timeout=30)
        assert got == [503, 503]  # in hand when it died: failed, not left to their deadline
        health = srv.http.get("/health")
        assert health.status_code == 503
        ask()
        assert got[-1] == 503  # and new requests are refused at once
    finally:
        srv.stop()


def test_the_kv_budget_admits_what_fits_and_refuses_what_never_can(embedded):
    from specdec.engine import Engine

    probe = Engine(embedded, max_kv_tokens=None)
    req = probe.prepare(GenerateRequest(messages=(Message("user", "Say hi"),), max_tokens=8))
    need = req.kv_positions
    e = Engine(embedded, max_kv_tokens=need + need // 2)  # one fits, two do not
    with pytest.raises(Exception) as err:
        e.prepare(GenerateRequest(messages=(Message("user", "Say hi"),), max_tokens=need))
    assert getattr(err.value, "code", None) == "kv_budget_exceeded"
    e.start(max_batch=4)
    try:
        most = [0]
        sched = e.scheduler
        step = sched.replay

        def watch(*a: Any, **k: Any) -> None:
            most[0] = max(most[0], sched.active)
            step(*a, **k)

        sched.replay = watch  # type: ignore[method-assign]
        reqs = [e.prepare(GenerateRequest(messages=(Message("user", "Say hi"),),
                                          max_tokens=8)) for _ in range(3)]
        streams = [e.submit(r) for r in reqs]
        outs = [[ev for ev in s if isinstance(ev, (Finished, Failed))][0] for s in streams]
        assert all(isinstance(o, Finished) for o in outs)
        assert most[0] == 1  # each waited for the one before it to leave
    finally:
        e.close()


class RoundClock:
    """The scheduler's clock, advanced by ROUND_S per decode round and by nothing else: a
    time limit becomes a number of rounds, whatever the machine's speed (each round is as
    slow as ROUND_S, injected)."""

    ROUND_S = 1.0

    def __init__(self) -> None:
        self.now, self.rounds = 0.0, 0

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name: str):  # the rest of the `time` module as it is
        import time

        return getattr(time, name)

    def wrap(self, run_round):
        def slow_round(*args, **kw):
            out = run_round(*args, **kw)
            self.now += self.ROUND_S
            self.rounds += 1
            return out

        return slow_round


def test_a_request_past_the_time_limit_is_stopped_at_the_next_round_with_a_504(served_models):
    # A deadline per request (waiting included): a long generation is stopped at the first
    # round boundary past it, streaming or not; a short request within it is served; the
    # server keeps serving. Rounds are made 1 s long on the scheduler's clock (injected), so
    # a 4.5 s limit is 4.5 rounds on any machine: a request that decodes one token a round
    # is stopped after its 5th round, never earlier or later.
    from unittest import mock

    from specdec import scheduler
    from tests.serverproc import serve_app

    clock = RoundClock()
    with mock.patch.object(scheduler, "time", clock), \
            mock.patch.object(scheduler, "run_round", clock.wrap(scheduler.run_round)):
        s = serve_app("--request-timeout", "4.5", "--draft-model", "none",
                      models=served_models)
        try:
            body = {"messages": [{"role": "user", "content": "Tell a very long story."}],
                    "max_tokens": 40, "temperature": 0}  # 40 rounds, were it not stopped
            before = clock.rounds
            err = error_of(s.http.post("/v1/chat/completions", json=body), 504)
            assert err["code"] == "timeout"
            assert clock.rounds - before == 5, clock.rounds - before
            before = clock.rounds
            r = s.http.post("/v1/chat/completions", json={**body, "stream": True})
            events = [json.loads(ln[6:]) for ln in r.text.splitlines()
                      if ln.startswith("data: ") and ln != "data: [DONE]"]
            assert events[-1]["error"]["code"] == "timeout", events[-1]
            assert sum(bool(e.get("choices")) for e in events) >= 1  # tokens came first
            assert clock.rounds - before == 5, clock.rounds - before
            short = s.http.post("/v1/chat/completions", json={**body, "max_tokens": 3})
            assert short.status_code == 200, short.text
            assert short.json()["choices"][0]["finish_reason"] == "length"
            assert "specdec_timed_out_total 2" in s.http.get("/metrics").text
        finally:
            s.stop()
