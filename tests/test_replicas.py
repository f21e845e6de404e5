"""Two real replicas (`specdec serve --store postgresql://...` on loopback, the embedded
model) over one real PostgreSQL, behind a real HAProxy with the configuration the project
ships (`deploy/haproxy.cfg`): a conversation whose turns alternate replicas (round-robin)
continues correctly, with the answers one replica alone gives and each replica's
`cached_tokens` truthful (what that replica itself restored); with the shipped affinity, a
chain's turns stay on the replica holding its KV state."""

from __future__ import annotations

import re
import uuid

import httpx
import openai
import pytest

from tests.balancer import Balancer, haproxy
from tests.serverproc import Server

TURNS = ("Name a fruit.", "Name another one.", "And a vegetable?", "Which one is sweetest?")


@pytest.fixture(scope="module")
def replicas(postgres):
    binary, why = haproxy()
    if binary is None:
        pytest.skip(why)
    url = postgres.database()
    ref = {"SPECDEC_BLAS": "reference"}  # (answers compared: the batch-invariant BLAS)
    a = Server("--store", url, env=ref)
    try:
        b = Server("--store", url, env=ref)
    except BaseException:
        a.stop()
        raise
    yield a, b
    a.stop()
    b.stop()


def served(s: Server) -> int:
    m = re.search(r"^specdec_requests_total (\S+)$", httpx.get(s.url + "/metrics").text, re.M)
    return int(float(m.group(1))) if m else 0


def host(s: Server) -> str:
    return s.url.removeprefix("http://")


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def turn(c: openai.OpenAI, system: str, text: str, **where) -> tuple[str, int, int]:
    r = c.responses.create(model="default", instructions=system, input=text, temperature=0,
                           max_output_tokens=12, **where)
    return r.output_text, r.usage.input_tokens_details.cached_tokens, r.usage.input_tokens


def test_a_conversation_alternating_replicas_continues_correctly(replicas):
    a, b = replicas
    system = f"You are a terse greengrocer ({uuid.uuid4().hex[:8]}). Answer in a few words."
    lb = Balancer(host(a), host(b), affinity=False)
    try:
        c = client(lb.url)
        conv = c.conversations.create()
        got, where = [], []
        for text in TURNS:
            before = served(a), served(b)
            got.append(turn(c, system, text, conversation=conv.id))
            where.append("a" if served(a) > before[0] else "b")
            assert (served(a) - before[0]) + (served(b) - before[1]) == 1
        assert all(x != y for x, y in zip(where, where[1:])), where  # they alternate
        items = c.conversations.items.list(conv.id, order="asc").data
        assert [i.role for i in items] == ["user", "assistant"] * len(TURNS)
        # the answers one replica alone gives (a conversation of its own)
        alone = client(a.url)
        conv2 = alone.conversations.create()
        want = [turn(alone, system, text, conversation=conv2.id)[0] for text in TURNS]
        assert [g[0] for g in got] == want
        # truthful: each replica's first turn restores nothing of this conversation (a
        # system prompt nobody sent before); its second restores its own first turn
        cached = [g[1] for g in got]
        assert cached[0] == cached[1] == 0, cached
        assert all(0 < n < total for _, n, total in got[2:]), got
    finally:
        lb.stop()


def test_the_shipped_affinity_keeps_a_chain_where_its_state_is(replicas):
    a, b = replicas
    system = f"You are a terse librarian ({uuid.uuid4().hex[:8]}). Answer in a few words."
    lb = Balancer(host(a), host(b), affinity=True)
    try:
        c = client(lb.url)
        before = served(a), served(b)
        prev, cached = None, []
        for text in TURNS:
            r = c.responses.create(model="default", instructions=system, input=text,
                                   temperature=0, max_output_tokens=12,
                                   previous_response_id=prev)
            prev = r.id
            cached.append(r.usage.input_tokens_details.cached_tokens)
        grew = served(a) - before[0], served(b) - before[1]
        assert sorted(grew) == [0, len(TURNS)], grew  # one replica served the whole chain
        assert cached[0] == 0 and all(n > 0 for n in cached[1:]), cached
    finally:
        lb.stop()
