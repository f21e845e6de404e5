"""Schemathesis against the real server's own OpenAPI document: every operation, examples
generated from the documented request shapes (valid ones, and invalid ones: wrong types,
out-of-range values, missing fields), sent over loopback to `specdec serve`.

Checks on every response: no 5xx; the status code is one the document lists; the content type
is a documented one; a JSON body matches the documented response schema (errors: each
API's own shape); invalid requests are refused (4xx), never answered as if valid.

The server runs a tiny random-weight model (tests/families.py) so each generated request
decodes quickly; the API surface, parsing and error paths under test are the same for every
model. Bounded: a fixed number of examples per operation and generation mode, seeded from the
corpus seed.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis.errors import Unsatisfiable

from tests.families import make_family
from tests.test_corpus import SEED

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (content_type_conformance,  # noqa: E402
                                               negative_data_rejection,
                                               response_schema_conformance,
                                               status_code_conformance)

EXAMPLES = {"POST": 40, "GET": 8, "DELETE": 8}  # per operation and generation mode
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def server_args(tmp_path_factory):
    model = make_family("qwen2.5", tmp_path_factory.mktemp("fuzz") / "qwen2.5")
    return ("--model", str(model), "--draft-model", "none", "--max-batch", "2", "--store",
            "memory")


@pytest.fixture(scope="module")
def api(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def test_document_describes_every_endpoint(api, server):
    import httpx

    doc = httpx.get(server.url + "/openapi.json").json()
    ops = {(m.upper(), p) for p, item in doc["paths"].items() for m in item}
    generate = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
    admin = ("load", "unload", "pin", "unpin")
    stored = {("GET", "/v1/responses/{rid}"), ("DELETE", "/v1/responses/{rid}"),
              ("GET", "/v1/responses/{rid}/input_items"), ("POST", "/v1/responses/{rid}/cancel"),
              ("POST", "/v1/conversations"),
              *((m, "/v1/conversations/{cid}") for m in ("GET", "POST", "DELETE")),
              *((m, "/v1/conversations/{cid}/items") for m in ("GET", "POST")),
              *((m, "/v1/conversations/{cid}/items/{item_id}") for m in ("GET", "DELETE"))}
    assert ops == {("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"),
                   ("GET", "/v1/models/{name}"), ("POST", "/v1/messages/count_tokens"),
                   *(("POST", p) for p in generate),
                   *(("POST", f"/v1/models/{{name}}/{a}") for a in admin), *stored}
    for path in generate:
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"].startswith("#/components/schemas/")
        assert {"200", "400"} <= set(doc["paths"][path]["post"]["responses"])


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                         ids=["valid", "invalid"])
def test_every_operation_under_generated_requests(api, server, mode):
    statuses: Counter[str] = Counter()
    ran = 0
    for result in api.get_all_operations():
        op = result.ok()
        checks = CHECKS + ([negative_data_rejection] if mode == GenerationMode.NEGATIVE else [])

        @seed(SEED)
        @settings(max_examples=EXAMPLES[op.method.upper()], database=None, deadline=None,
                  suppress_health_check=list(HealthCheck), print_blob=True)
        @given(op.as_strategy(generation_mode=mode))
        def call(case):
            response = case.call_and_validate(checks=checks, timeout=120)
            statuses[f"{op.method.upper()} {op.path} {response.status_code}"] += 1

        try:
            call()
        except Unsatisfiable:
            continue  # nothing to negate (an operation without parameters or body)
        ran += 1
    assert ran >= (5 if mode == GenerationMode.POSITIVE else 2), statuses
    assert not any(k.endswith((" 500", " 502")) for k in statuses), statuses
    print(dict(sorted(statuses.items())))
    # The server still answers, and no request was left running.
    assert server.client().models.list().data
