"""A bounded load-and-fault run against the real server: many clients sending a mix of
constrained, unconstrained, streaming, seeded and completion requests, interleaved with bad
requests, clients that leave mid-stream or mid-generation, and enough load to hit the queue
bound; optionally the adversarial corpus (tests/adversarial.py) as a share of the mix, each
entry judged as tests/test_adversarial.py judges it. Used by tests/test_load.py (CI size) and
bench/test_load.py (the report's figures, with the corpus).

Clients behave like the `openai` client: a 503 (queue full) is retried after its
Retry-After, up to 5 times. Every request gets exactly one outcome; a 5xx, a hang or an
answer that breaks its own constraint is a failure. `lost` counts requests that neither
completed, nor were refused (4xx; 503 after every retry), nor were left by their own client
on purpose.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from tests import adversarial

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
MSG = [{"role": "user", "content": "Invent a name and a number."}]
KINDS = ("constrained", "free", "stream", "seeded", "completion", "bad_json", "bad_param",
         "bad_schema", "leave_stream", "leave_generation")


RETRIES = 5


@dataclass
class LoadReport:
    requests: int = 0
    queue_full: int = 0  # 503 responses seen (each retried)
    outcomes: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)  # 5xx and broken answers
    lost: list[str] = field(default_factory=list)
    rss_growth_mb: float = 0.0
    seconds: float = 0.0
    latencies_s: list[float] = field(default_factory=list)  # the normal requests' 200s


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _retrying(send, report: LoadReport, lock: threading.Lock) -> httpx.Response:
    """Send; on 503 wait Retry-After and send again (RETRIES times at most)."""
    for _ in range(RETRIES):
        r = send()
        if r.status_code != 503:
            return r
        with lock:
            report.queue_full += 1
        time.sleep(float(r.headers.get("retry-after", "1")))
    return r


def _one(url: str, kind: str, rng: random.Random, report: LoadReport, lock: threading.Lock
         ) -> None:
    def out(what: str) -> None:
        with lock:
            report.outcomes[what] += 1

    def fail(what: str) -> None:
        with lock:
            report.server_errors.append(f"{kind}: {what}")

    def retrying(send):
        return _retrying(send, report, lock)

    t0 = time.perf_counter()
    chat = url + "/v1/chat/completions"
    body: dict = {"messages": MSG, "max_tokens": rng.choice([6, 12, 20]), "temperature": 0}
    if kind in ("constrained", "stream", "seeded", "leave_stream"):
        body["max_tokens"] = max(body["max_tokens"], 12)  # (the schema's minimum budget)
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "x", "schema": SCHEMA}}
    if kind == "seeded":
        body.update(temperature=0.8, seed=rng.randrange(1 << 30))
    try:
        # A full queue answers 503 before a body is read, bad or not: retried like any.
        if kind == "bad_json":
            r = retrying(lambda: httpx.post(chat, content=b'{"messages": [', timeout=300,
                                            headers={"Content-Type": "application/json"}))
            if r.status_code == 503:
                out("503")
                return
            out("400" if r.status_code == 400 else f"unexpected {r.status_code}")
            if r.status_code != 400:
                fail(f"bad JSON gave {r.status_code}")
            return
        if kind in ("bad_param", "bad_schema"):
            bad = {"presence_penalty": 0.5} if kind == "bad_param" else {"response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": {
                    "type": "string", "pattern": "(?<=a)b"}}}}
            r = retrying(lambda: httpx.post(chat, json={**body, **bad}, timeout=300))
            if r.status_code == 503:
                out("503")
                return
            out("400" if r.status_code == 400 else f"unexpected {r.status_code}")
            if r.status_code != 400:
                fail(f"{bad} gave {r.status_code}: {r.text[:200]}")
            return
        if kind == "completion":
            r = retrying(lambda: httpx.post(url + "/v1/completions", json={
                "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}, timeout=300))
        elif kind in ("stream", "leave_stream"):
            for _ in range(RETRIES):
                with httpx.stream("POST", chat, json={**body, "stream": True, "max_tokens": 40},
                                  timeout=300) as r:
                    if r.status_code != 503:
                        _read_stream(r, kind, out, fail, report, lock)
                        return
                    with lock:
                        report.queue_full += 1
                    wait = float(r.headers.get("retry-after", "1"))
                time.sleep(wait)
            out("503")
            return
        elif kind == "leave_generation":
            try:  # a non-streaming client that gives up while tokens are still flowing
                r = httpx.post(chat, json={**body, "max_tokens": 300}, timeout=0.8)
                out("503" if r.status_code == 503 else "200")  # done before it gave up
            except httpx.TimeoutException:
                out("left")
            return
        else:
            r = retrying(lambda: httpx.post(chat, json=body, timeout=300))
        if r.status_code == 503:
            out("503")
            return
        if r.status_code >= 500 or r.status_code != 200:
            fail(f"{r.status_code}: {r.text[:200]}")
            return
        choice = r.json()["choices"][0]
        if "response_format" in body and choice["finish_reason"] == "stop":
            got = json.loads(choice["message"]["content"])
            if set(got) != {"name", "n"}:
                fail(f"answer breaks its schema: {got}")
                return
        out("200")
        with lock:
            report.latencies_s.append(time.perf_counter() - t0)
    except httpx.TimeoutException as e:
        with lock:
            report.lost.append(f"{kind}: client timed out ({e!r})")
    except (httpx.HTTPError, ValueError, KeyError) as e:
        fail(f"{type(e).__name__}: {e}")


def _hostile(url: str, entry: adversarial.Entry, report: LoadReport, lock: threading.Lock
             ) -> None:
    """One corpus entry, retried on 503 like every client; its answer judged as the
    corpus says (a 4xx or a bounded 200), a wrong one counted with the 5xx."""
    try:
        r = _retrying(lambda: httpx.post(url + entry.path, content=entry.content, timeout=300,
                                         headers={"Content-Type": "application/json"}),
                      report, lock)
        problem = adversarial.judge(entry, r.status_code, r.text)
        with lock:
            if r.status_code == 503:
                report.outcomes["503"] += 1  # refused after every retry
            elif problem is not None:
                report.server_errors.append(f"adversarial {entry.name}: {problem}")
            else:
                report.outcomes[f"adversarial {r.status_code}"] += 1
    except httpx.TimeoutException as e:
        with lock:
            report.lost.append(f"adversarial {entry.name}: client timed out ({e!r})")
    except httpx.HTTPError as e:
        with lock:
            report.server_errors.append(f"adversarial {entry.name}: {type(e).__name__}: {e}")


def _read_stream(r, kind, out, fail, report, lock) -> None:
    if r.status_code != 200:
        fail(f"stream gave {r.status_code}")
        return
    done = False
    for i, line in enumerate(r.iter_lines()):
        if kind == "leave_stream" and i >= 2:
            out("left")  # the client walks away mid-stream
            return
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            ev = json.loads(line[6:])
            if "error" in ev:
                fail(f"stream error event {ev['error']}")
                return
    if not done:
        with lock:
            report.lost.append(f"{kind}: stream ended without [DONE]")
        return
    out("200")


def run(server, clients: int = 16, requests: int = 200, seed: int = 0,
        hostile: int = 0) -> LoadReport:
    """Drive `server` (tests.serverproc.Server) with `requests` requests from `clients`
    threads, `hostile` of them corpus entries (every entry in turn); returns the outcome
    counts, failures and the server's RSS growth."""
    rng = random.Random(seed)
    entries = adversarial.ENTRIES
    kinds: list[str | adversarial.Entry] = [KINDS[i % len(KINDS)]
                                            for i in range(requests - hostile)]
    kinds += [entries[i % len(entries)] for i in range(hostile)]
    rng.shuffle(kinds)
    report = LoadReport(requests=requests)
    lock = threading.Lock()
    # Warm: first compile and prefill, so RSS compares steady states.
    for kind in ("constrained", "free", "completion", "stream"):
        _one(server.url, kind, random.Random(1), LoadReport(), lock)
    rss0 = _rss_mb(server.proc.pid)
    t0 = time.perf_counter()
    seeds = [rng.randrange(1 << 30) for _ in kinds]

    def client(kind: str | adversarial.Entry, seed: int) -> None:
        if isinstance(kind, adversarial.Entry):
            _hostile(server.url, kind, report, lock)
        else:
            _one(server.url, kind, random.Random(seed), report, lock)

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, kinds, seeds))
    report.seconds = time.perf_counter() - t0
    # Everything accepted has ended: nothing active, nothing queued.
    deadline = time.time() + 60
    while time.time() < deadline:
        m = httpx.get(server.url + "/metrics", timeout=10).text
        gauges = {ln.split()[0]: float(ln.split()[1]) for ln in m.splitlines()
                  if ln.startswith(("specdec_active_requests ", "specdec_queue_depth "))}
        if gauges and not any(gauges.values()):
            break
        time.sleep(0.5)
    else:
        report.lost.append(f"server still busy after the run: {gauges}")
    report.rss_growth_mb = _rss_mb(server.proc.pid) - rss0
    return report
