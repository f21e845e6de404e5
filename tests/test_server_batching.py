"""The server batching many clients at once (continuous batching) on the reference BLAS,
where a request's output is promised independent of its batch: concurrent `openai` clients
of mixed kinds, one batch of them, each get exactly what the same request gets alone; a full
server answers 503 with Retry-After; cancelled requests free their slots."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
          "properties": {"city": {"type": "string", "maxLength": 20},
                         "country": {"type": "string", "maxLength": 20}}}


MAX_BATCH = 4


def _requests() -> list[dict]:
    """One batch of requests of mixed kinds, every pair of {greedy, seeded (top-k, top-p)} x
    {constrained, free} x {speculative, plain} in some request (streaming in half of them):
    four requests cover all twelve pairs. Two of them speculate, over the server's
    --draft-max-batch 1: their shared rounds propose without the draft model until one
    finishes, then with it (as each does alone), so both kinds of round are in the batch."""
    json_fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
    kinds = [  # (sampling, constraint, speculation)
        dict(temperature=0, response_format=json_fmt),  # greedy, constrained, speculative
        dict(temperature=0.8, seed=3, top_p=0.8,  # seeded, constrained, plain
             extra_body={"top_k": 40, "num_draft_tokens": 0},
             response_format={"type": "json_object"}),
        dict(temperature=0, extra_body={"num_draft_tokens": 0}),  # greedy, free, plain
        dict(temperature=0.9, seed=7,  # seeded, free, speculative (k=2, no lookup)
             extra_body={"num_draft_tokens": 2, "prompt_lookup": False}),
    ]
    prompts = ["A city as JSON.", "Describe a cat in JSON.", "Count to five.", "Tell a joke."]
    return [dict(model="default", max_tokens=20, stream=i % 2 == 1,
                 messages=[{"role": "user", "content": p}], **kw)
            for i, (p, kw) in enumerate(zip(prompts, kinds))]


def _ask(client: openai.OpenAI, req: dict) -> tuple[str, str]:
    if req["stream"]:
        chunks = list(client.chat.completions.create(**req))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    r = client.chat.completions.create(**req)
    return r.choices[0].message.content or "", r.choices[0].finish_reason


@pytest.fixture(scope="module")
def server_args():
    return ("--max-batch", str(MAX_BATCH), "--max-queue", "0", "--draft-max-batch", "1")


@pytest.fixture(scope="module")
def server_env():
    return {"SPECDEC_BLAS": "reference"}


def test_concurrent_clients_of_mixed_kinds_get_what_each_gets_alone(server):
    client = server.client()
    reqs = _requests()
    alone = [_ask(client, r) for r in reqs]
    together: list = [None] * len(reqs)
    start = threading.Barrier(len(reqs))

    def run(i: int) -> None:
        # A client the server turns away at its preparation bound (2 workers, 1 waiting with
        # --max-queue 0: four at once can meet it) retries after the Retry-After it is given,
        # as the openai client does by default; the answers are what is compared.
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=3)
        start.wait()
        together[i] = _ask(client, reqs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert together == alone
    metrics = httpx.get(server.url + "/metrics").text
    batch = [ln for ln in metrics.splitlines() if ln.startswith("specdec_batch_size_mean ")]
    assert batch and float(batch[0].split()[1]) > 1.0, metrics  # rounds really were shared


def test_full_server_answers_503_with_retry_after_and_cancelled_slots_free_up(server):
    body = {"model": "default", "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    streams, clients, readers = [], [], []
    for _ in range(MAX_BATCH):  # hold every slot
        c = httpx.Client(base_url=server.url, timeout=120)
        s = c.stream("POST", "/v1/chat/completions", json=body)
        r = s.__enter__()
        # The reader is kept: a line iterator dropped here would close its connection
        # (httpcore closes a stream whose iterator is closed), and the client would leave.
        readers.append(r.iter_lines())
        next(readers[-1])  # the request was accepted (submitted to the scheduler)
        clients.append(c)
        streams.append(s)
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False},
                   timeout=60)
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    err = r.json()["error"]
    assert err["code"] == "queue_full" and set(err) == {"message", "type", "param", "code"}
    for s, c in zip(streams, clients):  # clients leave mid-stream
        s.__exit__(None, None, None)
        c.close()
    deadline = time.time() + 60
    while time.time() < deadline:  # slots are freed within a round of each disconnect
        m = httpx.get(server.url + "/metrics").text
        if "specdec_active_requests 0" in m:
            break
        time.sleep(0.2)
    assert "specdec_active_requests 0" in m
    r = server.client().chat.completions.create(model="default", max_tokens=4, temperature=0,
                                                messages=[{"role": "user", "content": "Hi"}])
    assert r.choices[0].finish_reason in ("stop", "length")


def _active(server) -> tuple[int, int]:
    m = httpx.get(server.url + "/metrics").text
    val = {ln.split()[0]: float(ln.split()[1]) for ln in m.splitlines()
           if ln and not ln.startswith("#")}
    return int(val["specdec_active_requests"]), int(val["specdec_cancelled_total"])


def test_non_streaming_client_that_disconnects_frees_its_slot_while_tokens_flow(server):
    body = {"model": "default", "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 400, "temperature": 0}
    _, cancelled = _active(server)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up mid-generation
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=3.0)
    deadline = time.time() + 60
    while time.time() < deadline and _active(server) != (0, cancelled + 1):
        time.sleep(0.2)
    assert _active(server) == (0, cancelled + 1)
