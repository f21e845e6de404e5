"""Load with faults (tests/loadfault.py) at report size: 16 clients, mixed requests with bad
ones, clients that leave, the queue bound hit; the figures the report carries."""

from __future__ import annotations

from bench import results
from tests.loadfault import run
from tests.serverproc import Server


def test_load_with_faults(benchmark, engine):
    def run_all() -> None:
        s = Server("--max-batch", "8", "--max-queue", "8", "--request-timeout", "300")
        try:
            n = 160 if results.QUICK else 400
            r = run(s, clients=16, requests=n)
        finally:
            s.stop()
        note = (f"16 clients, {n} mixed requests in {r.seconds:.0f}s; outcomes "
                f"{dict(r.outcomes)}; 503s retried {r.queue_full}")
        results.add("load_requests", n, "requests", note)
        results.add("load_5xx", len(r.server_errors), "responses", note)
        results.add("load_lost", len(r.lost), "requests", note)
        results.add("load_rss_growth_mb", r.rss_growth_mb, "MB", note)

    benchmark.pedantic(run_all, rounds=1, iterations=1)
