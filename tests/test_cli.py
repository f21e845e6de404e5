"""The `specdec generate` CLI's exit status: 3 when --max-tokens cuts a constrained output
(the partial output still printed), 0 when it completes."""

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
    cut = subprocess.run(base + ["--max-tokens", "4"], capture_output=True, text=True,
                         timeout=600)
    assert cut.returncode == 3 and "--max-tokens 4" in cut.stderr, cut.stderr[-2000:]
    assert cut.stdout.strip()  # the partial output is still printed
    whole = subprocess.run(base + ["--max-tokens", "60"], capture_output=True, text=True,
                           timeout=600)
    assert whole.returncode == 0, whole.stderr[-2000:]
    json.loads(whole.stdout)
