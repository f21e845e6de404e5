"""Load with faults against the real server (tests/loadfault.py): 16 clients, 160 mixed
requests (every kind 16 times) with bad ones, clients leaving mid-stream and mid-generation,
and the queue bound hit; afterwards 0 5xx, 0 lost, the server idle and still answering, and
its memory near where it started. The report-sized run (400 requests) is bench/test_load.py."""

from __future__ import annotations

import httpx

from tests import tally
from tests.loadfault import run
from tests.serverproc import Server

REQUESTS = 160
RSS_GROWTH_LIMIT_MB = 1.25 * REQUESTS  # as much a request as ever (300 MB for 240 requests)


def test_load_with_faults_loses_nothing(embedded):
    # A small batch and queue so 16 clients overflow it: some requests get 503.
    s = Server("--max-batch", "4", "--max-queue", "6", "--request-timeout", "300")
    try:
        report = run(s, clients=16, requests=REQUESTS)
        tally.record("load with faults: requests with an honest outcome",
                     not report.server_errors and not report.lost)
        tally.NOTES.append(
            f"load: {report.requests} requests from 16 clients in {report.seconds:.0f}s, "
            f"outcomes {dict(report.outcomes)}, 503s retried {report.queue_full}, "
            f"5xx/broken {len(report.server_errors)}, "
            f"lost {len(report.lost)}, RSS growth {report.rss_growth_mb:.0f} MB")
        assert not report.server_errors, report.server_errors[:5]
        assert not report.lost, report.lost[:5]
        assert sum(report.outcomes.values()) == report.requests
        assert report.queue_full > 0 and report.outcomes["left"] > 0  # faults happened
        assert report.rss_growth_mb < RSS_GROWTH_LIMIT_MB
        r = httpx.post(s.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert "Traceback" not in s.log(), s.log()[-3000:]
    finally:
        s.stop()
