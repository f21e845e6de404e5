"""The adversarial corpus (tests/adversarial.py) against one server on the embedded model,
served in process with the serving defaults: every hostile request is answered with a 4xx in
its API's error shape or a 200 bounded by its small max_tokens, never a 5xx, and within a
client's timeout; afterwards the server still serves a normal request."""

from __future__ import annotations

import concurrent.futures
import gc
import time

import pytest

from specdec.grammar import heap_in_use
from tests import tally
from tests.adversarial import ENTRIES, Entry, judge
from tests.serverproc import serve_app

# A client's patience: generous for a shared 2-core machine (every entry is small work), and
# what stands between a stalled request and a hung suite.
CLIENT_TIMEOUT_S = 60.0
SEEN: dict[str, tuple[str, float]] = {}  # entry -> (its answer's status, seconds)


@pytest.fixture(scope="module")
def server(served_models):
    s = serve_app(models=served_models)
    # The in-process answer arrives whole: a request that never ends is waited for in a
    # thread of this pool for CLIENT_TIMEOUT_S, then left behind.
    pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="adversarial")
    yield s, pool
    for name, (status, seconds) in SEEN.items():  # shown with -s
        print(f"{name:40} {status:>6} {seconds:6.2f}s")
    slowest = sorted(SEEN.items(), key=lambda kv: -kv[1][1])[:3]
    tally.NOTES.append(f"adversarial corpus: {len(SEEN)} entries in "
                       f"{sum(s for _, s in SEEN.values()):.0f}s, slowest " +
                       ", ".join(f"{name} {s:.1f}s" for name, (_, s) in slowest))
    pool.shutdown(wait=False, cancel_futures=True)
    s.stop()


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_hostile_request_is_a_4xx_or_a_bounded_200(server, entry: Entry):
    s, pool = server
    t0 = time.perf_counter()
    answer = pool.submit(s.http.post, entry.path, content=entry.content,
                         headers={"Content-Type": "application/json"})
    try:
        r = answer.result(timeout=CLIENT_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        SEEN[entry.name] = ("hang", time.perf_counter() - t0)
        pytest.fail(f"{entry.name} ({entry.why}): no answer within {CLIENT_TIMEOUT_S:.0f}s "
                    f"(expected {entry.expect})")
    except Exception as e:  # the ASGI transport re-raises what the app did not handle
        SEEN[entry.name] = ("raised", time.perf_counter() - t0)
        pytest.fail(f"{entry.name} ({entry.why}): the app raised {e!r} (a 500 on a real "
                    f"server; expected {entry.expect})")
    SEEN[entry.name] = (str(r.status_code), time.perf_counter() - t0)
    problem = judge(entry, r.status_code, r.text)
    assert problem is None, f"{entry.name} ({entry.why}): {problem}"


def test_the_server_still_serves_after_the_corpus(server):
    s, pool = server
    r = pool.submit(s.http.post, "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4,
        "temperature": 0}).result(timeout=CLIENT_TIMEOUT_S)
    assert r.status_code == 200, r.text
    assert 1 <= r.json()["usage"]["completion_tokens"] <= 4


def idle(s, timeout_s: float = 60.0) -> None:
    """Wait until the server does nothing: no request running or waiting, no background
    history prefill (queued after each answer) and no prompt being rendered for one."""
    door = s._asgi.app.state.door
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = s.engine.status()
        if st.active == st.queue_depth == s.engine.scheduler.background == 0 and \
                door.prepares.pending == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the server did not go idle")


@pytest.mark.skipif(heap_in_use() is None, reason="the C heap is not measurable here")
def test_the_grammar_cache_holds_what_it_counts_within_its_size(server):
    """After the corpus (~320 MB of grammars compiled, one counted regex ~170 MB alone), the
    cache holds at most its size, and emptying it hands back what its count says: never
    more than 10% under it. Counted are each grammar's compile and closing walk, without
    MLX's arrays (`grammar._heap_but_arrays`); the lexer states a grammar builds while
    masks are filled for decoding are not (measured here: ~13% of the freed bytes), so
    a count more than 10% short is reported as that known gap (xfail), with the numbers."""
    s, _ = server
    compiler = s.engine.compiler
    held = compiler.cached_bytes
    assert compiler.misses >= 20 and 0 < held <= compiler.cache_bytes
    assert sum(g.nbytes for g in compiler._cache.values()) == held
    idle(s)  # nothing else allocates or frees while the heap is read
    gc.collect()
    with compiler._lock:  # grammars evicted earlier and held then (by a request now gone)
        compiler._let_go()  # are freed now, not by emptying the cache below
    before = heap_in_use()
    compiler.clear()
    gc.collect()
    freed = before - heap_in_use()
    tally.NOTES.append(f"grammar cache after the adversarial corpus: {held / 1e6:.0f} MB "
                       f"counted, {freed / 1e6:.0f} MB freed by emptying it, "
                       f"{compiler.evictions} evicted")
    assert held <= 1.1 * freed, (held, freed)
    if held < 0.9 * freed:
        pytest.xfail(f"counted {held} B, emptying freed {freed} B: the lexer states built "
                     "while decoding are not counted")
