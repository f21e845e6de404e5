"""The `specdec generate` CLI's exit status: 3 when --max-tokens cuts a constrained output
(`--no-close-at-budget`; the partial output still printed), 0 when it completes (closed in
time for a small --max-tokens), an error naming the minimum below it."""

from __future__ import annotations

import json
import subprocess
import sys


def test_cli_exits_3_when_max_tokens_cuts_a_constrained_output(tmp_path, embedded):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "city": {"type": "string", "maxLength": 8}},
        "required": ["name", "city"], "additionalProperties": False}))
    base = [sys.executable, "-m", "specdec", "generate", "--json-schema", str(schema),
            "--prompt", "Invent a person.", "--draft-model", "none"]
    cut = subprocess.run(base + ["--max-tokens", "4", "--no-close-at-budget"],
                         capture_output=True, text=True, timeout=600)
    assert cut.returncode == 3 and "--max-tokens 4" in cut.stderr, cut.stderr[-2000:]
    assert cut.stdout.strip()  # the partial output is still printed
    low = subprocess.run(base + ["--max-tokens", "4"], capture_output=True, text=True,
                         timeout=600)
    assert low.returncode not in (0, 3) and "give at least" in low.stderr, low.stderr[-2000:]
    minimum = int(low.stderr.rsplit("give at least", 1)[1].split()[0])
    closed = subprocess.run(base + ["--max-tokens", str(minimum)], capture_output=True,
                            text=True, timeout=600)
    assert closed.returncode == 0, closed.stderr[-2000:]
    json.loads(closed.stdout)  # closed in time
    whole = subprocess.run(base + ["--max-tokens", "60"], capture_output=True, text=True,
                           timeout=600)
    assert whole.returncode == 0, whole.stderr[-2000:]
    json.loads(whole.stdout)


# The shipped settings are defined once (`config.EngineConfig()`); `Engine.load()` from
# Python, `specdec generate` and `specdec serve` must decode a request alike: same tokens,
# same proposals by source. Eight output tokens keep every round under the token trees'
# warm-up (`TreeCosts`: a branch threshold priced by the clock only after ~10 rounds), so
# the proposal counts are the settings' alone; below the schema's minimum (12), so cut as
# plain truncation (`close_at_budget` off) in all three.
SOURCES = ("forced", "looked_up", "suffixed", "drafted", "branched")


def test_engine_load_the_cli_and_the_server_decode_alike_with_the_shipped_defaults(
        tmp_path, serve):
    import httpx

    from specdec import cli
    from specdec.config import EngineConfig, SpecConfig
    from specdec.engine import Engine
    from specdec.request import Constraint, GenerateRequest, Message

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    prompt = "Name the largest city of Japan as JSON."
    engine = Engine.load()
    assert engine.config == EngineConfig() and engine.default_spec == SpecConfig.serving()
    assert engine.draft is not None  # the shipped distilled draft
    for cmd in (["serve"], ["generate", "--prompt", "x"]):  # no flags: the same settings
        assert cli.engine_config(cli.build_parser().parse_args(cmd)) == engine.config
    ours = engine.generate(engine.prepare(GenerateRequest(
        messages=(Message("user", prompt),), constraint=Constraint.json_schema(schema),
        max_tokens=8, close_at_budget=False)))
    stats = ours.stats.as_dict()
    assert stats["rounds"] < 9 and stats["proposed"] > 0, stats

    path = tmp_path / "s.json"
    path.write_text(json.dumps(schema))
    run = subprocess.run([sys.executable, "-m", "specdec", "generate", "--prompt", prompt,
                          "--json-schema", str(path), "--max-tokens", "8", "--stats",
                          "--no-close-at-budget"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode in (0, 3), run.stderr[-2000:]  # 3: cut at --max-tokens
    line = json.loads(next(x for x in run.stderr.splitlines()[::-1] if x.startswith("{")))
    assert line["tokens"] == list(ours.tokens), run.stderr[-2000:]
    assert {s: line[s] for s in SOURCES} == {s: stats[s] for s in SOURCES}
    assert line["accepted"] == stats["accepted"] and line["rounds"] == stats["rounds"]

    server = serve()
    r = httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
        "model": "default", "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 8, "temperature": 0, "close_at_budget": False,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "city", "schema": schema}}}).json()
    ext = r["specdec"]
    assert r["choices"][0]["message"]["content"] == ours.text
    assert r["usage"]["completion_tokens"] == len(ours.tokens)
    assert {s: ext[s] for s in SOURCES} == {s: stats[s] for s in SOURCES}, (ext, stats)
    assert ext["accepted"] == stats["accepted"]
