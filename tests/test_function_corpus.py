"""Real-world function definitions (tests/corpus/functions/: a subset of the Berkeley Function
Calling Leaderboard's) under forced calls with small budgets, through a real `specdec serve`
and the openai client.

- Every function, every session: forced by name (and "required" where several are offered,
  and with `parallel_tool_calls` for the parallel entries), its constraint compiles, a budget
  of 1 is a 400 `max_tokens_too_small` whose message gives the minimum, and one below that
  minimum is a 400 too.
- Calls at small budgets: each function forced by name at its minimum and at a few above it
  or 48; "required" at its minimum or 48; a parallel request with room for a second call.
  Every call is made, names an offered function (the forced one when named), its arguments
  parse and validate against that function's parameters as the server closes them, no text
  comes beside it, and the finish reason is "length" exactly when the budget steered (or the
  turn was cut right after a complete call), else "tool_calls".

The calls take most of the time (the prompts carry the definitions: 230-1400 tokens), so a
session decodes a sixth of the entries and one of the two larger budgets per function:
which, is a function of the corpus seed (`SPECDEC_CORPUS_SEED`, default: the day number, as
tests/test_corpus.py), so six consecutive seeds decode every entry and twelve every
(function, budget). The server runs as shipped (its fast BLAS): these checks are of validity,
not of equality with plain decoding, and the suite's reference BLAS prefills ~10x slower.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from specdec.tools import closed
from tests import tally

CORPUS = Path(__file__).parent / "corpus" / "functions" / "bfcl.jsonl"
ENTRIES = [json.loads(line) for line in CORPUS.read_text().splitlines()]
FUNCTIONS = [f for e in ENTRIES for f in e["function"]]
SEED = int(os.environ.get("SPECDEC_CORPUS_SEED") or datetime.date.today().toordinal())
SMALL = 48  # the fixed small budget
ABOVE = 3  # "a few above the minimum"
PARALLEL = 24  # tokens above the minimum given to a parallel request: room for a second call
WORKERS = 4  # requests in flight at once (the server batches them)

# BFCL's pseudo-schema types as its harness sends them to OpenAI-style APIs
# (bfcl_eval/constants/type_mappings.py GORILLA_TO_OPENAPI, model_handler/utils.py
# `_cast_to_openai_type`): "dict" an object, "float" a number, "tuple" an array, "any" (and
# a type it does not map, or none) a string.
GORILLA_TO_OPENAPI = {
    "integer": "integer", "number": "number", "float": "number", "string": "string",
    "boolean": "boolean", "bool": "boolean", "array": "array", "list": "array",
    "dict": "object", "object": "object", "tuple": "array", "any": "string",
}


def to_json_schema(p: dict[str, Any], is_property: bool = True) -> dict[str, Any]:
    """A BFCL parameter in JSON Schema, as BFCL's harness casts it: the types mapped through
    nested properties and items; a float property also gets `format: float` and says so in
    its description."""
    out = dict(p)
    kind = p.get("type")
    out["type"] = GORILLA_TO_OPENAPI.get(kind, "string") if isinstance(kind, str) else "string"
    if kind == "float" and is_property:
        out["format"] = "float"
        out["description"] = p.get("description", "") + " This is a float type value."
    if isinstance(p.get("properties"), dict):
        out["properties"] = {k: to_json_schema(v) for k, v in p["properties"].items()}
    if isinstance(p.get("items"), dict):
        out["items"] = to_json_schema(p["items"], is_property=False)
    return out


def tool(function: dict[str, Any]) -> dict[str, Any]:
    """A BFCL function as a Chat Completions tool: parameters an object in JSON Schema, the
    name's dots underscores (as BFCL sends names to OpenAI-style APIs, which refuse dots)."""
    params = {**function["parameters"], "type": "object",
              "properties": {k: to_json_schema(v)
                             for k, v in function["parameters"].get("properties", {}).items()}}
    return {"type": "function", "function": {"name": function["name"].replace(".", "_"),
                                             "description": function["description"],
                                             "parameters": params}}


@dataclass(frozen=True)
class Cell:
    """One request: the call it forces (`named`, or "required" when None), its budget."""

    named: str | None
    max_tokens: int
    parallel: bool = False

    def choice(self) -> dict[str, Any]:
        return {"parallel_tool_calls": self.parallel, "tool_choice": (
            {"type": "function", "function": {"name": self.named}} if self.named
            else "required")}


def is_parallel(entry: dict[str, Any]) -> bool:
    return entry["id"].startswith(("parallel", "live_parallel"))


def session_cells(i: int, entry: dict[str, Any], names: list[str],
                  minima: dict[Cell, int]) -> list[Cell]:
    """Entry i's calls this session: none where (i + seed) is not a multiple of 6; else each
    function at its minimum and at one of (a few above it, 48), alternating with the function
    and over seeds; "required" at its minimum or 48; the parallel request."""
    n = i + SEED
    if n % 6:
        return []
    cells = []
    for j, name in enumerate(names):
        least = minima[Cell(name, 0)]
        cells += [Cell(name, b) for b in sorted(
            {least, (least + ABOVE, max(SMALL, least))[(n // 6 + j) % 2]})]
    if Cell(None, 0) in minima:
        least = minima[Cell(None, 0)]
        cells.append(Cell(None, (least, max(SMALL, least))[n // 6 % 2]))
    if Cell(None, 0, parallel=True) in minima:
        cells.append(Cell(None, minima[Cell(None, 0, parallel=True)] + PARALLEL, parallel=True))
    return cells


@pytest.fixture(scope="module")
def client(serve):
    yield serve().client()
    if SEEN:
        steered, seconds = sum(s for s, _ in SEEN), sum(t for _, t in SEEN)
        tally.NOTES.append(
            f"function corpus (seed {SEED}): {len(ENTRIES)} entries, {len(FUNCTIONS)} "
            f"functions; {len(SEEN)} forced calls ({steered} steered by the budget) in "
            f"{seconds:.0f}s")


SEEN: list[tuple[bool, float]] = []  # (budget steered, seconds) per call made


def request(entry: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The entry's request (its question, its functions as tools) and each tool's parameters
    as the server closes them."""
    tools = [tool(f) for f in entry["function"]]
    body = {"model": "default", "messages": entry["question"][0], "tools": tools,
            "temperature": 0}
    return body, {t["function"]["name"]: closed(t["function"]["parameters"]) for t in tools}


def minima(client: openai.OpenAI, entry: dict[str, Any]) -> dict[Cell, int]:
    """Each forced request's minimum budget (keyed by its cell at budget 0): read off the 400
    a budget of 1 gets; a budget one below it is refused too."""
    body, params = request(entry)
    kinds = [Cell(name, 0) for name in params]
    if len(params) > 1:
        kinds.append(Cell(None, 0))
    if is_parallel(entry):
        kinds.append(Cell(None, 0, parallel=True))
    out = {}
    for cell in kinds:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**body, **cell.choice(), max_tokens=1)
        err = e.value.body
        assert isinstance(err, dict) and err["code"] == "max_tokens_too_small", (cell, err)
        assert err["param"] == "max_tokens", err
        found = re.search(r"takes (\d+) tokens", err["message"])
        assert found, err["message"]
        out[cell] = int(found.group(1))
        if out[cell] > 2:
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(**body, **cell.choice(),
                                               max_tokens=out[cell] - 1)
            assert e.value.body["code"] == "max_tokens_too_small", (cell, e.value.body)
    return out


def check(client: openai.OpenAI, body: dict[str, Any], cell: Cell,
          params: dict[str, dict[str, Any]]) -> str | None:
    """Make `cell`'s request; what is wrong with its answer, or None."""
    t0 = time.perf_counter()
    r = client.chat.completions.create(**body, **cell.choice(), max_tokens=cell.max_tokens)
    choice, ext = r.choices[0], (r.model_extra or {}).get("specdec") or {}
    calls = choice.message.tool_calls or []
    steered = ext.get("budget_steered", 0) > 0
    SEEN.append((steered, time.perf_counter() - t0))
    got = f"{cell}: finish {choice.finish_reason}, steered {ext.get('budget_steered')}, " \
          f"{r.usage.completion_tokens} tokens, calls " \
          f"{[(c.function.name, c.function.arguments) for c in calls]}, " \
          f"content {choice.message.content!r}"
    if not calls:
        return f"no call made: {got}"
    if len(calls) > 1 and not cell.parallel:
        return f"more than one call: {got}"
    if choice.message.content:
        return f"text beside a forced call: {got}"
    for c in calls:
        if c.function.name not in params or (cell.named and c.function.name != cell.named):
            return f"called {c.function.name!r}: {got}"
        try:
            jsonschema.validate(json.loads(c.function.arguments), params[c.function.name])
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            return f"arguments invalid ({str(e).splitlines()[0]}): {got}"
    if r.usage.completion_tokens > cell.max_tokens:
        return f"over budget: {got}"
    if choice.finish_reason != ("length" if steered else "tool_calls") and not (
            choice.finish_reason == "length" and r.usage.completion_tokens == cell.max_tokens):
        return f"finish reason untruthful: {got}"
    return None


def test_the_corpus_is_diverse():
    """The subset holds what real definitions hold, in BFCL's own types."""
    kinds: set[str] = set()

    def walk(p: dict[str, Any], depth: int) -> None:
        kinds.add(str(p.get("type")))
        if "enum" in p:
            kinds.add("enum")
        if depth and p.get("type") == "dict":
            kinds.add("nested object" if "properties" in p else "free object")
        for v in p.get("properties", {}).values():
            walk(v, depth + 1)
        if isinstance(p.get("items"), dict):
            walk(p["items"], depth + 1)
    for f in FUNCTIONS:
        walk(f["parameters"], 0)
    assert 40 <= len(FUNCTIONS) <= 60
    assert kinds >= {"dict", "float", "tuple", "any", "integer", "boolean", "array", "string",
                     "enum", "nested object", "free object"}, kinds
    assert sum(len(e["function"]) > 1 for e in ENTRIES) >= 8
    assert sum(is_parallel(e) for e in ENTRIES) >= 4
    assert any(set(f["parameters"]["properties"]) - set(f["parameters"].get("required", []))
               for f in FUNCTIONS)  # optional parameters


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["id"] for e in ENTRIES])
def test_every_forced_call_compiles_and_a_budget_below_its_minimum_is_a_400(client, entry):
    got = minima(client, entry)
    assert all(least > 1 for least in got.values()), got  # above the budget it refused


@pytest.mark.parametrize("i", range(len(ENTRIES)), ids=[e["id"] for e in ENTRIES])
def test_forced_calls_at_small_budgets_are_made_and_valid(client, i):
    entry = ENTRIES[i]
    body, params = request(entry)
    cells = session_cells(i, entry, list(params), minima(client, entry))
    if not cells:
        pytest.skip(f"decoded under the other five sixths of seeds (corpus seed {SEED})")
    # The first request prefills the prompt; the rest find it in the server's prompt cache.
    bad = [check(client, body, cells[0], params)]
    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        bad += pool.map(lambda c: check(client, body, c, params), cells[1:])
    problems = [b for b in bad if b is not None]
    assert not problems, f"{entry['id']} (corpus seed {SEED}):\n" + "\n".join(problems)
