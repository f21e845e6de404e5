"""A grammar error in the middle of a generation (tests/faults.py injects one at output token
N) is an internal fault, not user input: the CLI prints one line and exits non-zero, the
server logs the request's grammar and position and answers an OpenAI-shaped error, and no
token past the error is emitted. The server keeps serving afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import openai
import pytest

from tests.serverproc import Server

FAIL_AT = 5
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                           "country": {"type": "string"}},
          "required": ["city", "country"]}
LAUNCHER = [sys.executable, "-m", "tests.faults", str(FAIL_AT)]


@pytest.mark.parametrize("draft", ["none", "auto"])
def test_cli_grammar_fault_is_one_line_and_exit_1(embedded, tmp_path, draft):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    env = dict(os.environ)
    env.pop("SPECDEC_BLAS_REEXEC", None)
    out = subprocess.run([*LAUNCHER, "generate", "--json-schema", str(schema), "--prompt",
                          "A city as JSON.", "--max-tokens", "40", "--draft-model", draft],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert out.stdout == ""  # nothing of the output past (or before) the fault is printed
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("specdec")]
    assert "Traceback" not in out.stderr
    assert len(lines) == 1 and "internal error" in lines[0], out.stderr
    assert f"output token {FAIL_AT}" in lines[0]


@pytest.fixture(scope="module")
def faulty_server(embedded):
    s = Server(launcher=LAUNCHER)
    yield s
    s.stop()


def _body(stream: bool) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": "A city as JSON."}],
            "max_tokens": 40, "temperature": 0, "stream": stream,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "c", "schema": SCHEMA}}}


def test_server_grammar_fault_is_an_openai_error_and_logged(faulty_server):
    client = faulty_server.client()
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(**_body(False))
    err = info.value.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "server_error" and err["code"] == "grammar_state"
    assert f"output token {FAIL_AT}" in err["message"] and "\n" not in err["message"]
    log = faulty_server.log()
    assert f"grammar state error at output token {FAIL_AT}" in log
    assert '"city"' in log  # the request's grammar is in the log
    # The server keeps serving: an unconstrained request (no matcher) succeeds.
    r = client.chat.completions.create(model="default", max_tokens=5, temperature=0,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert r.choices[0].finish_reason in ("stop", "length")


def test_server_grammar_fault_mid_stream_sends_at_most_the_tokens_before_it(faulty_server,
                                                                            embedded):
    with httpx.stream("POST", faulty_server.url + "/v1/chat/completions", json=_body(True),
                      timeout=300) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines()
                  if ln.startswith("data: ") and ln != "data: [DONE]"]
    errors = [e for e in events if "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "grammar_state"
    assert events[-1] is errors[0]  # nothing after the error
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in events
                   if c.get("choices"))
    # Only the FAIL_AT tokens the grammar accepted before the fault were sent.
    assert text.startswith("{")
    assert 0 < len(embedded.tokenizer.encode(text, add_special_tokens=False)) <= FAIL_AT
