"""Prompt and answer reuse partitioned by caller: a key's cached tokens never reveal another
key's prompts, and `prompt_cache_key` partitions within a key (`GenerateRequest.cache_scope`).

Through the openai SDK, on the real embedded model and its draft, served in process with two
API keys: the same prompt sent by another key (or under another `prompt_cache_key`) is
computed from 0 (`cached_tokens` 0), while the key (and cache key) that sent it first finds
it whole; the answers are the same either way (reuse is exact)."""

from __future__ import annotations

import openai
import pytest

from specdec.decode import PromptKVCache
from tests.serverproc import serve_app

KEYS = ("k-alice", "k-bob")
SYSTEM = ("You are a travel agent's assistant. Answer with the city's airport code only, "
          "in capitals, and nothing else. ") * 3


@pytest.fixture(scope="module")
def app(served_models):
    s = serve_app("--api-key", KEYS[0], "--api-key", KEYS[1], models=served_models)
    yield s
    s.stop()


def ask(client: openai.OpenAI, city: str, **extra) -> tuple[str, int]:
    r = client.chat.completions.create(
        model="default", temperature=0, max_tokens=6,
        messages=[{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": f"Which airport serves {city}?"}], **extra)
    details = r.usage.prompt_tokens_details
    return r.choices[0].message.content, (details.cached_tokens if details else 0) or 0


def test_another_keys_prompt_is_never_a_hit(app):
    alice, bob = app.client(KEYS[0]), app.client(KEYS[1])
    first, cached = ask(alice, "Lisbon")
    assert cached == 0
    again, cached = ask(alice, "Lisbon")
    assert cached > 0 and again == first  # her own prompt, whole
    theirs, cached = ask(bob, "Lisbon")
    assert cached == 0 and theirs == first  # computed from 0, the same answer
    # nor a shared prefix (the system prompt) of hers: bob's next prompt restores his own
    _, cached = ask(bob, "Porto")
    assert 0 < cached
    _, cached_other = ask(app.client(KEYS[0]), "Faro")
    assert 0 < cached_other  # hers restores her own prefix


def test_prompt_cache_key_partitions_within_a_key(app):
    alice = app.client(KEYS[0])
    first, _ = ask(alice, "Madrid", extra_body={"prompt_cache_key": "team-a"})
    again, whole = ask(alice, "Madrid", extra_body={"prompt_cache_key": "team-a"})
    assert whole > 0 and again == first
    other, cached = ask(alice, "Madrid", extra_body={"prompt_cache_key": "team-b"})
    assert cached == 0 and other == first
    bare, cached = ask(alice, "Madrid")  # no cache key: the key's own scope, not team-a's
    assert cached < whole and bare == first  # (at most her system prompt, from before)
    with pytest.raises(openai.BadRequestError) as e:
        ask(alice, "Madrid", extra_body={"prompt_cache_key": 7})
    assert e.value.body["param"] == "prompt_cache_key"


def test_the_prompt_store_partitions_by_scope():
    """Unit: a state stored in one scope is not found, restored or dropped from another."""
    import mlx.core as mx

    class Cache:
        def __init__(self):
            self.state = (mx.zeros((1, 1, 4, 2)), mx.zeros((1, 1, 4, 2)))
            self.offset = 4

        def trim(self, n):
            self.offset -= n

    model = object()
    store = PromptKVCache()
    store.store(model, (1, 2, 3, 4), [Cache()], scope="a")
    assert store.has(model, (1, 2, 3, 4), "a")
    assert not store.has(model, (1, 2, 3, 4), "b") and not store.has(model, (1, 2, 3, 4))
    assert store.restore_prefix(model, (1, 2, 3, 4, 5), [Cache()], trims=True, least=1,
                                scope="b") == 0
    assert store.restore_prefix(model, (1, 2, 3, 4, 5), [Cache()], trims=True, least=1,
                                scope="a") == 4
    store.drop(model, (1, 2, 3, 4), "b")
    assert store.has(model, (1, 2, 3, 4), "a")
    store.drop(model, (1, 2, 3, 4), "a")
    assert not store.has(model, (1, 2, 3, 4), "a")
