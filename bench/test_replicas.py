"""Two replicas over one PostgreSQL store behind HAProxy: what the shipped affinity
(`deploy/haproxy.cfg`) is worth.

- `replicas_cached_share_affinity` / `replicas_cached_share_round_robin`: a chain of `TURNS`
  Responses turns (each continuing the last by `previous_response_id`, the embedded model,
  12 output tokens a turn) through the balancer with the shipped configuration, and through
  the same without its affinity rules (round-robin: turns alternate replicas): the prompt
  tokens the serving replica restored over all prompt tokens, turns 2 on (the first has
  nothing to restore). The arms run interleaved in rotating order, each round's chains with
  a system prompt of its own and each arm in a prompt-store partition of its own
  (`prompt_cache_key`), on the reference BLAS, where the two give the same answers
  (checked).
"""

from __future__ import annotations

import uuid

import openai
import pytest

from bench import results
from tests.balancer import Balancer, haproxy
from tests.pgserver import PgServer
from tests.serverproc import Server

TURNS = results.size(8, 8, smoke=3)
ROUNDS = results.rounds(2, 3)
ASKS = ("Name a river.", "Name another one.", "Which is longer?", "Name a sea.",
        "Name an ocean.", "Which is deepest?", "Name a lake.", "Which is coldest?")


def chain(url: str, tag: str, arm: str) -> tuple[list[str], int, int]:
    """A chain through `url`: its answers, and the prompt tokens restored and sent over
    turns 2 on. Each arm's prompts are a partition of the prompt store of their own
    (`prompt_cache_key`), so neither arm restores the other's."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    system = f"You are a terse geographer ({tag}). Answer in a few words."
    prev, answers, cached, sent = None, [], 0, 0
    for n in range(TURNS):
        r = c.responses.create(model="default", instructions=system, input=ASKS[n % len(ASKS)],
                               temperature=0, max_output_tokens=12, previous_response_id=prev,
                               extra_body={"prompt_cache_key": f"{tag}-{arm}"})
        prev = r.id
        answers.append(r.output_text)
        if n:
            cached += r.usage.input_tokens_details.cached_tokens
            sent += r.usage.input_tokens
    return answers, cached, sent


def test_replica_affinity(benchmark):
    binary, why = haproxy()
    bindir, why_pg = PgServer.find()
    if binary is None or bindir is None:
        pytest.skip(why or why_pg)
    pg = PgServer(bindir).start()
    servers: list[Server] = []
    balancers: list[Balancer] = []
    try:
        url = pg.database()
        ref = {"SPECDEC_BLAS": "reference"}  # (both arms' answers compared)
        servers += [Server("--store", url, env=ref), Server("--store", url, env=ref)]
        hosts = [s.url.removeprefix("http://") for s in servers]
        balancers += [Balancer(*hosts, affinity=True), Balancer(*hosts, affinity=False)]
        totals = {True: [0, 0], False: [0, 0]}

        def run() -> None:
            for r in range(ROUNDS):
                tag = uuid.uuid4().hex[:8]
                got = {}
                for affinity in ((True, False) if r % 2 == 0 else (False, True)):
                    lb = balancers[0 if affinity else 1]
                    answers, cached, sent = chain(lb.url, tag, str(affinity))
                    got[affinity] = answers
                    totals[affinity][0] += cached
                    totals[affinity][1] += sent
                assert got[True] == got[False]  # the same answers either way

        benchmark.pedantic(run, rounds=1, iterations=1)
        note = f"{TURNS}-turn chains x {ROUNDS} rounds, 2 replicas over one PostgreSQL"
        for affinity, name in ((True, "affinity"), (False, "round_robin")):
            cached, sent = totals[affinity]
            results.add(f"replicas_cached_share_{name}", cached / max(sent, 1), "ratio",
                        f"{note}: {cached} of {sent} prompt tokens restored (turns 2 on)")
    finally:
        for b in balancers:
            b.stop()
        for s in servers:
            s.stop()
        pg.stop()
