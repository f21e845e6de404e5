"""The Responses store (`server/store.py`): what it keeps per byte of content, and what its
work costs the streams beside it.

- `store_bytes_per_unique_50_turns`: a 50-turn chain through the Responses API (in
  process, the stand-in engine answering ~1 KB a turn, each turn continuing the last by
  `previous_response_id` with a ~1 KB question): the bytes the store holds over the bytes of
  the chain's unique content (each question and answer once, each response object without
  its output once, as the API gives them); goal: at most 1.2 (linear).
- `store_gap_p99_loaded_over_idle`: a real server on a store file holding `STORED`
  responses of ~100 KB (~1 GB at full size), bound so that every write evicts, two clients
  streaming answers (Chat Completions, 48 tokens) and a third sending Responses turns as
  fast as they come back: the p99 of the streams' inter-token gaps with those turns stored
  over the same turns with `store: false` (the store idle, the engine's work the same),
  rounds interleaved; goal: at most 1.2.
- `store_health_p99_ms_loaded`: `/health`'s p99 latency during the loaded rounds; goal:
  under 50 ms.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import numpy as np

from bench import results
from tests.serverproc import Server

TURNS = results.size(50, 50, smoke=5)
STORED = results.size(10_000, 10_000, smoke=200)
ITEM_BYTES = 100_000
ROUNDS = results.rounds(2, 3)
STREAM_TOKENS = 48


def test_store_bytes_per_unique_byte(benchmark):
    from server.app import create_app
    from specdec import cli
    from specdec.events import TextDelta
    from tests.fakeengine import FakeEngine, finished
    from tests.serverproc import InProcess

    n = [0]

    def answer(greq):
        n[0] += 1
        text = f"Answer {n[0]}: " + "lorem ipsum dolor sit amet " * 36
        return [TextDelta(text), finished(text)]

    config = cli.serve_config(cli.build_parser().parse_args(["serve", "--store", "memory"]))
    app = InProcess(create_app(FakeEngine(answer), config))
    store = app._asgi.app.state.door.store  # type: ignore[attr-defined]
    try:
        c = app.client()

        def chain() -> tuple[int, int]:
            prev, ids = None, []
            for t in range(TURNS):
                r = c.responses.create(model="default", previous_response_id=prev,
                                       input=f"Question {t}: " + "what about this? " * 60)
                prev = r.id
                ids.append(r.id)
            # The unique content: every item once (the last response's whole input and its
            # output) and each response object without its output, as the API gives them.
            unique = 0
            for rid in ids:
                body = app.http.get(f"/v1/responses/{rid}").json()
                unique += len(json.dumps({k: v for k, v in body.items() if k != "output"}))
            unique += sum(len(json.dumps(o)) for o in body["output"])
            items = app.http.get(f"/v1/responses/{prev}/input_items?limit=100").json()
            unique += sum(len(json.dumps(i)) for i in items["data"])
            return store.stats()["bytes"], unique

        held, unique = benchmark.pedantic(chain, rounds=1, iterations=1)
        results.add("store_bytes_per_unique_50_turns", held / unique, "ratio",
                    f"a {TURNS}-turn chain by previous_response_id through the Responses API "
                    f"(in process, ~1 KB questions and answers): {held} bytes stored for "
                    f"{unique} bytes of unique content (each item once, each response object "
                    "without its output once)")
    finally:
        app.stop()


def _fill(path: str) -> None:
    """`STORED` responses of ~`ITEM_BYTES` each, written as the server writes them."""
    from server.store import Bounds, SqliteStore

    s = SqliteStore(path, Bounds(max_age_s=None, max_count=None, max_bytes=None))
    filler = "x" * ITEM_BYTES
    for i in range(STORED):
        s.put_turn({"id": f"resp_fill{i}", "object": "response", "status": "completed",
                    "output": [{"type": "message", "id": f"msg_fill{i}", "role": "assistant",
                                "status": "completed",
                                "content": [{"type": "output_text", "text": filler}]}]},
                   [{"type": "message", "id": f"in_fill{i}", "role": "user",
                     "content": [{"type": "input_text", "text": "hello"}]}])
    s.close()


def _stream_gaps(url: str, stop: threading.Event, out: list[float]) -> None:
    """Stream answers until `stop`; the gaps between their deltas (seconds) into `out`."""
    body = {"model": "default", "messages": [{"role": "user", "content": "Tell me a story "
                                              "about a lighthouse keeper."}],
            "max_tokens": STREAM_TOKENS, "temperature": 0, "stream": True}
    with httpx.Client(timeout=300) as h:
        while not stop.is_set():
            last = None
            with h.stream("POST", url + "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    if last is not None:
                        out.append(now - last)
                    last = now


def _writer(url: str, stop: threading.Event, counts: list[int], store: bool) -> None:
    """Turns as fast as they come back (a ~2 KB question, 4 tokens of answer), stored or
    not: the same work for the engine either way, the store's only where `store`."""
    body = {"model": "default", "input": "Summarize this: " + "the quick brown fox " * 100,
            "max_output_tokens": 4, "temperature": 0, "store": store}
    with httpx.Client(timeout=300) as h:
        while not stop.is_set():
            r = h.post(url + "/v1/responses", json=body)
            assert r.status_code == 200, r.text
            counts[0] += 1


def _health(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=30) as h:
        while not stop.is_set():
            t0 = time.perf_counter()
            h.get(url + "/health")
            out.append(time.perf_counter() - t0)
            time.sleep(0.05)


def test_store_under_load(benchmark, tmp_path):
    path = str(tmp_path / "responses.sqlite3")
    _fill(path)
    # Bound so that every write evicts (the store is full): the costly path.
    mb = max(1, (STORED * ITEM_BYTES) >> 20)
    s = Server("--store", path, "--store-max-mb", str(mb), "--store-max-count",
               str(STORED))
    seconds = results.size(20.0, 30.0, smoke=3.0)

    def arm(loaded: bool) -> tuple[list[float], list[float], int]:
        stop = threading.Event()
        gaps: list[float] = []
        health: list[float] = []
        writes = [0]
        threads = [threading.Thread(target=_stream_gaps, args=(s.url, stop, gaps))
                   for _ in range(2)]
        threads.append(threading.Thread(target=_health, args=(s.url, stop, health)))
        threads.append(threading.Thread(target=_writer, args=(s.url, stop, writes, loaded)))
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        return gaps, health, writes[0]

    try:
        def run() -> dict[bool, list[tuple[list[float], list[float], int]]]:
            out: dict[bool, list] = {False: [], True: []}
            for r in range(ROUNDS):
                for loaded in ((False, True) if r % 2 == 0 else (True, False)):
                    out[loaded].append(arm(loaded))
            return out

        out = benchmark.pedantic(run, rounds=1, iterations=1)
        p99 = {k: float(np.percentile([g for a in v for g in a[0]], 99)) for k, v in out.items()}
        health = float(np.percentile([h for a in out[True] for h in a[1]], 99))
        writes = sum(a[2] for a in out[True])
        unstored = sum(a[2] for a in out[False])
        per_round = " / ".join(
            f"{np.percentile(a[0], 99) / np.percentile(b[0], 99):.2f}"
            for a, b in zip(out[True], out[False]))
        note = (f"store file of {STORED} responses x ~{ITEM_BYTES // 1000} KB, bound "
                f"{mb} MB (every write evicts); 2 clients streaming {STREAM_TOKENS}-token "
                f"answers and one sending turns as fast as they come back, {ROUNDS} rounds x "
                f"{seconds:g} s per arm interleaved; loaded: {writes} turns stored, idle: "
                f"{unstored} turns with store false; gap p99 {p99[True] * 1e3:.0f} ms "
                f"loaded, {p99[False] * 1e3:.0f} ms idle (per round: {per_round})")
        results.add("store_gap_p99_loaded_over_idle", p99[True] / p99[False], "ratio", note)
        results.add("store_health_p99_ms_loaded", health * 1e3, "ms",
                    f"/health polled every 50 ms during the loaded rounds; {writes} turns "
                    "stored")
    finally:
        s.stop()
