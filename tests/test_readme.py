"""The README's Python examples run as written: each block against a real `specdec serve` on
loopback (its address put in place of the README's), with the official clients, at the
temperatures the README gives (the anthropic SDK's default where it gives none); the
library block in process. Also: what the anthropic SDK moves out of a schema into its
descriptions before sending (`messages.parse`) is put back and enforced."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def _compiled(code: str):
    """As a reader's script runs it (not with this module's `__future__` flags)."""
    return compile(code, str(README), "exec", dont_inherit=True)


def test_the_readme_examples_run_as_written(server):
    code = [b for b in blocks() if "127.0.0.1:8000" in b]
    assert len(code) >= 3
    scope: dict = {}
    for block in code:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(_compiled(block.replace("http://127.0.0.1:8000", server.url)), scope)  # noqa: S102
        assert out.getvalue().strip(), block
        print(out.getvalue())
    # the capped example: its answer parsed, and the budget forced the close
    assert scope["r"].choices[0].finish_reason == "length"
    value = json.loads(scope["r"].choices[0].message.content)
    assert isinstance(value["title"], str) and isinstance(value["steps"], list)
    # the Messages example: the SDK validated the reply against the model as written
    assert type(scope["msg"].parsed_output).__name__ == "CandidateEvaluation"


def test_the_library_example_runs_as_written():
    (block,) = [b for b in blocks() if "Engine.load()" in b]
    scope: dict = {}
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(_compiled(block), scope)  # noqa: S102
    finally:
        if "engine" in scope:
            scope["engine"].close()
    value = json.loads(out.getvalue())
    assert isinstance(value["name"], str) and isinstance(value["age"], int)


def test_what_the_anthropic_sdk_moves_into_descriptions_is_put_back():
    from typing import Annotated, Literal

    from annotated_types import Ge, Le
    from anthropic.lib._parse._transform import transform_schema
    from pydantic import BaseModel, Field

    from server.messages import restore_moved

    class Model(BaseModel):
        summary: str = Field(max_length=80, description="One line")
        rating: Annotated[int, Ge(1), Le(10)]
        code: str = Field(pattern=r"^[A-Z]{3}$")
        tags: list[str] = Field(min_length=2, max_length=5)
        odd: str = Field(pattern=r"^a, b: c$")  # a value that reads as another key: as sent
        kind: Literal["a", "b"]

    sent = transform_schema(Model)
    props = sent["properties"]
    assert "maxLength" not in props["summary"] and "{maxLength: 80}" in \
        props["summary"]["description"]  # what the SDK does (if it stops, this test says so)
    got = restore_moved(sent)["properties"]
    assert got["summary"]["maxLength"] == 80 and got["summary"]["description"] == "One line"
    assert (got["rating"]["minimum"], got["rating"]["maximum"]) == (1, 10)
    assert "description" not in got["rating"]
    assert got["code"]["pattern"] == "^[A-Z]{3}$"
    assert (got["tags"]["minItems"], got["tags"]["maxItems"]) == (2, 5)
    assert "pattern" not in got["odd"] and got["odd"]["description"] == props["odd"][
        "description"]
    assert got["kind"] == props["kind"]
