"""The official JSON-Schema-Test-Suite (draft 2020-12, vendored in tests/jsonschema_suite)
run through the server's constraint -> grammar path (tests only).

Each case is a schema, an instance and the suite's verdict. The schema is compiled as
`response_format: json_schema` compiles it (`GrammarCompiler.compile` of a `json_schema`
constraint, strict or lenient), once per mode; the instance is then fed to a matcher of that
grammar. Its outcome: `pass` (the grammar accepts a valid instance or rejects an invalid
one), `false_positive` (accepts an invalid one), `false_negative` (rejects a valid one) or
`refused` (the schema does not compile: the server answers 400).

"The grammar accepts the instance" means: some spelling of the instance's JSON value, with
the compiler's separators (`JSON_DEFAULTS`: no free whitespace, so no other layout exists),
is accepted. The grammar fixes the order of an object's keys and may write a number or a
string one way only, so every key order and a few spellings of each number (`2`, `2.0`,
`2e0`; `1e308` also in digits) and string (raw UTF-8, `\\u` escapes) are searched, pruned
by the matcher as it goes: an instance is neither rejected for a spelling the grammar does
not write nor accepted unless the grammar takes every byte of it and may end there. The
bytes go in as the tokenizer's one-byte tokens, so no tokenization stands between the
instance and the grammar (llguidance allows any tokenization of the text it accepts).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal, get_args

from llguidance import LLMatcher

from specdec.errors import GrammarError
from specdec.grammar import JSON_DEFAULTS, CompiledGrammar, GrammarCompiler
from specdec.request import Constraint

SUITE = Path(__file__).parent / "jsonschema_suite"
CASES_DIR = SUITE / "draft2020-12"
EXPECTED = SUITE / "expected.txt"
MODES = ("strict", "lenient")
ITEM_SEP = JSON_DEFAULTS["item_separator"].encode()
KEY_SEP = JSON_DEFAULTS["key_separator"].encode()
# Matcher steps one instance may take across its spellings before the search gives up
# (loudly: a case is never decided by running out).
SEARCH_LIMIT = 10_000

Outcome = Literal["pass", "false_positive", "false_negative", "refused"]


@dataclass(frozen=True)
class Case:
    """One test of the suite: `file` and the group's and test's positions name it."""

    file: str
    group: int
    test: int
    description: str
    schema: Any
    instance: Any  # numbers as written (`Decimal` for non-integers)
    valid: bool

    @property
    def key(self) -> str:
        return f"{self.file} {self.group}.{self.test}"


def load_cases() -> list[Case]:
    """Every case of the vendored draft (not `optional/`), in file, group, test order."""
    cases = []
    for path in sorted(CASES_DIR.glob("*.json")):
        text = path.read_text(encoding="utf-8")
        # The schema as the server receives it; the instances with their numbers exact.
        plain, exact = json.loads(text), json.loads(text, parse_float=Decimal)
        for g, (group, group_exact) in enumerate(zip(plain, exact)):
            for t, test in enumerate(group_exact["tests"]):
                cases.append(Case(path.name, g, t,
                                  f"{group['description']} / {test['description']}",
                                  group["schema"], test["data"], test["valid"]))
    return cases


def compile_schema(compiler: GrammarCompiler, schema: Any, mode: str
                   ) -> CompiledGrammar | None:
    """The schema's grammar in `mode`; None where it is refused (a 400 at the server)."""
    try:
        return compiler.compile(Constraint.json_schema(schema, lenient=mode == "lenient"))
    except GrammarError:
        return None


class Feeder:
    """Feeds bytes to matchers as the tokenizer's one-byte tokens."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        tok = compiler.tokenizer
        # (a byte with none, a control character or one UTF-8 never uses, is never raw in
        # JSON text)
        self.byte_token: dict[int, int] = {}
        for i in range(tok.vocab_size):
            piece = tok.decode_bytes([i])
            if len(piece) == 1 and not tok.is_special_token(i):
                self.byte_token.setdefault(piece[0], i)

    def accepts(self, grammar: CompiledGrammar, instance: Any) -> bool:
        """Whether the grammar takes some spelling of `instance` and may end after it."""
        steps = 0

        def feed(m: LLMatcher, data: bytes) -> LLMatcher | None:
            nonlocal steps
            steps += 1
            if steps > SEARCH_LIMIT:
                raise RuntimeError(f"no verdict within {SEARCH_LIMIT} matcher steps for "
                                   f"{instance!r}")
            m = m.deep_copy()
            ids = [self.byte_token[b] for b in data]
            return m if m.try_consume_tokens(ids) == len(ids) else None

        return _value(grammar.state(), instance, feed, lambda m: m.is_accepting())


Feed = Callable[[LLMatcher, bytes], "LLMatcher | None"]
Then = Callable[[LLMatcher], bool]


def _value(m: LLMatcher, v: Any, feed: Feed, then: Then) -> bool:
    """Whether some spelling of `v` goes from `m` into a state where `then` holds."""
    if isinstance(v, dict):
        return _members(feed(m, b"{"), v, list(v), True, feed, then)
    if isinstance(v, list):
        return _items(feed(m, b"["), v, 0, feed, then)
    return any(n is not None and then(n) for n in (feed(m, s) for s in spellings(v)))


def _items(m: LLMatcher | None, items: list[Any], i: int, feed: Feed, then: Then) -> bool:
    if m is None:
        return False
    if i == len(items):
        end = feed(m, b"]")
        return end is not None and then(end)
    m = feed(m, ITEM_SEP) if i else m
    return m is not None and _value(m, items[i], feed,
                                    lambda n: _items(n, items, i + 1, feed, then))


def _members(m: LLMatcher | None, obj: dict[str, Any], left: list[str], first: bool,
             feed: Feed, then: Then) -> bool:
    """Members in every order the matcher takes."""
    if m is None:
        return False
    if not left:
        end = feed(m, b"}")
        return end is not None and then(end)
    if not first:
        m = feed(m, ITEM_SEP)
        if m is None:
            return False
    for k in left:
        rest = [x for x in left if x != k]
        for s in spellings(k):
            n = feed(m, s + KEY_SEP)
            if n is not None and _value(n, obj[k], feed,
                                        lambda n: _members(n, obj, rest, False, feed, then)):
                return True
    return False


def spellings(v: Any) -> list[bytes]:
    """The ways JSON writes a scalar with no whitespace: strings raw or `\\u`-escaped,
    numbers with or without a fraction or an exponent."""
    if v is None or isinstance(v, bool):
        return [json.dumps(v).encode()]
    if isinstance(v, str):
        forms = [json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f"),
                 json.dumps(v, ensure_ascii=False), json.dumps(v)]
    elif isinstance(v, int):
        forms = [str(v), f"{v}.0", f"{v}e0"]
    else:
        assert isinstance(v, Decimal), v
        forms = [format(v, "f"), str(v).lower(), str(v).lower().replace("e+", "e")]
        if v == v.to_integral_value():
            forms[:0] = [str(int(v))]
    return [f.encode() for f in dict.fromkeys(forms)]


def outcome(grammar: CompiledGrammar | None, case: Case, feeder: Feeder) -> Outcome:
    if grammar is None:
        return "refused"
    accepted = feeder.accepts(grammar, case.instance)
    if accepted == case.valid:
        return "pass"
    return "false_positive" if accepted else "false_negative"


@dataclass(frozen=True)
class Result:
    """A case's outcome in one mode, and the warnings its schema compiled with."""

    case: Case
    mode: str
    outcome: Outcome
    warnings: tuple[str, ...]


def run(compiler: GrammarCompiler) -> list[Result]:
    """Every case's outcome in each mode (case order, strict before lenient), each schema
    compiled once per mode."""
    feeder = Feeder(compiler)
    cases = load_cases()
    by_mode = {}
    for mode in MODES:
        compiled: dict[tuple[str, int], CompiledGrammar | None] = {}
        for case in cases:
            group = case.file, case.group
            if group not in compiled:
                compiled[group] = compile_schema(compiler, case.schema, mode)
            g = compiled[group]
            by_mode[case.key, mode] = Result(case, mode, outcome(g, case, feeder),
                                             g.warnings if g is not None else ())
    return [by_mode[case.key, mode] for case in cases for mode in MODES]


def tally(results: list[Result], mode: str) -> dict[Outcome, int]:
    counts = dict.fromkeys(get_args(Outcome), 0)
    for r in results:
        if r.mode == mode:
            counts[r.outcome] += 1
    return counts


def render(results: list[Result]) -> str:
    """The expected-outcome file: the tally per mode, then a line per case per mode."""
    head = ["# JSON-Schema-Test-Suite draft 2020-12 through the json_schema constraint's "
            "grammar (tests/test_jsonschema_suite.py).",
            "# Rewrite on purpose: SPECDEC_UPDATE_RATCHET=1 pytest tests/test_jsonschema_suite.py"]
    for mode in MODES:
        head.append(f"# {mode}: " + ", ".join(f"{n} {o}" for o, n in tally(results,
                                                                            mode).items()))
    width = max(len(r.case.key) for r in results)
    lines = [f"{r.case.key:<{width}}  {r.mode:<7}  {r.outcome:<14}  # {r.case.description}"
             for r in results]
    return "\n".join(head + lines) + "\n"


def parse(text: str) -> dict[tuple[str, str], str]:
    """(case key, mode) -> outcome, from the expected-outcome file."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            file, pos, mode, result = line.split("#", 1)[0].split()
            out[f"{file} {pos}", mode] = result
    return out
