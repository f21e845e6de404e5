"""Load with faults (tests/loadfault.py) at report size: 16 clients, mixed requests with bad
ones, clients that leave, the queue bound hit, and a third of the requests the adversarial
corpus (tests/adversarial.py, every entry in turn); the figures the report carries. A corpus
entry answered otherwise than the corpus allows counts with the 5xx."""

from __future__ import annotations

import numpy as np

from bench import results
from tests.adversarial import ENTRIES
from tests.loadfault import run
from tests.serverproc import Server


def test_load_with_faults(benchmark, engine):
    def run_all() -> None:
        s = Server("--max-batch", "8", "--max-queue", "8", "--request-timeout", "300")
        # each corpus entry once (twice in a full report); the first few in smoke mode
        hostile = results.size(len(ENTRIES), 2 * len(ENTRIES), 12)
        n = 3 * hostile
        try:
            r = run(s, clients=16, requests=n, hostile=hostile)
        finally:
            s.stop()
        note = (f"16 clients, {n} mixed requests ({hostile} from the adversarial corpus) in "
                f"{r.seconds:.0f}s; outcomes {dict(r.outcomes)}; 503s retried {r.queue_full}")
        results.add("load_requests", n, "requests", note)
        results.add("load_5xx", len(r.server_errors), "responses",
                    note + (f"; first: {r.server_errors[:3]}" if r.server_errors else ""))
        results.add("load_lost", len(r.lost), "requests",
                    note + (f"; first: {r.lost[:3]}" if r.lost else ""))
        results.add("load_rss_growth_mb", r.rss_growth_mb, "MB", note)
        lat = np.array(r.latencies_s or [0.0])
        results.add("load_p50_latency_s", float(np.percentile(lat, 50)), "s",
                    f"{len(r.latencies_s)} normal non-streamed requests answered 200, next to "
                    "the corpus (503 waits included)")
        results.add("load_p99_latency_s", float(np.percentile(lat, 99)), "s",
                    f"{len(r.latencies_s)} normal non-streamed requests answered 200, next to "
                    "the corpus (503 waits included)")

    benchmark.pedantic(run_all, rounds=1, iterations=1)
