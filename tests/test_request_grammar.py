"""A request's grammar (`specdec.request_grammar`): how its failures are classified, its
thinking gate as a part of its state, its next mask filled off the round."""

from __future__ import annotations

import llguidance.numpy as llnp
import numpy as np
import pytest
from llguidance import LLTokenizer

from specdec.decode import StepTimings
from specdec.errors import GrammarDeadEnd, GrammarStateError, GrammarTooComplex
from specdec.grammar import Constraint, GrammarCompiler
from specdec.reasoning import Thinking, ThinkingCursor
from specdec.request_grammar import FillPools, RequestGrammar, check, failure, single_allowed

AMBIGUOUS = "start: e\ne: e e | /[a-z]/"


@pytest.fixture(scope="module")
def byte() -> LLTokenizer:
    return LLTokenizer("byte")


def _fill(m, tok: LLTokenizer) -> np.ndarray:
    row = llnp.allocate_token_bitmask(1, tok.vocab_size)
    llnp.fill_next_token_bitmask(m, row, 0)
    return row


def test_llguidance_reports_its_limits_and_dead_ends_only_in_the_message(byte):
    # What the classification rests on: llguidance 1.9's stop_reason() is "InternalError"
    # for a parser limit and for an empty mask; the kind is the message's first line. Where a
    # release types them, this fails and `failure` can drop its messages.
    m = GrammarCompiler(byte, limits={"max_items_in_row": 50}).compile(
        Constraint.grammar(AMBIGUOUS)).matcher()
    for _ in range(200):
        _fill(m, byte)
        if m.is_error() or not m.consume_token(ord("a")) or m.is_error():
            break
    assert m.is_error() and m.stop_reason() == "InternalError"
    assert "items; max is" in m.get_error().splitlines()[0]
    with pytest.raises(GrammarTooComplex):
        check(m, 7)
    dead = GrammarCompiler(byte).compile(Constraint.grammar('start: "ab" /[^\\s\\S]/')).matcher()
    for t in b"ab":
        dead.consume_token(t)
    _fill(dead, byte)
    assert dead.stop_reason() == "InternalError"
    assert dead.get_error().splitlines()[0] == "NoExtensionBias"
    with pytest.raises(GrammarDeadEnd):
        check(dead, 2)


@pytest.mark.parametrize("stop,detail,kind", [
    ("ParserTooComplex", "", GrammarTooComplex),
    ("LexerTooComplex", "lexer", GrammarTooComplex),
    ("MaxTokensTotal", "", GrammarTooComplex),
    ("NoExtensionBias", "", GrammarDeadEnd),
    ("InternalError", "NoExtensionBias\n<state>", GrammarDeadEnd),
    ("InternalError", "Parser Error: Current row has 51 items; max is 50", GrammarTooComplex),
    ("InternalError", "token \"x\" doesn't satisfy the grammar", GrammarStateError),
    ("NotStopped", "injected fault", GrammarStateError),
])
def test_a_failure_is_classified_by_its_stop_reason_then_its_message(stop, detail, kind):
    e = failure("why", stop=stop, detail=detail, position=3)
    assert type(e) is kind and e.position == 3


def test_a_request_grammar_consumes_checks_and_fills_its_next_mask_off_the_round(byte):
    g = GrammarCompiler(byte).compile(Constraint.regex("ab|ac"))
    rg = RequestGrammar(g.matcher(), pools=FillPools(1, 1))
    stats = StepTimings()
    assert rg.take_next_mask(stats) is None  # none asked for
    rg.ask_next_mask(byte.vocab_size, 0)
    first = rg.take_next_mask(stats)
    assert first is not None and first.error is None and single_allowed(first.row) == ord("a")
    assert stats.mask_s > 0 and rg.next_mask is None
    clone = rg.clone()
    clone.consume_token(ord("a"))  # a clone moves; the request's state does not
    rg.ask_next_mask(byte.vocab_size, 0)
    assert single_allowed(rg.take_next_mask(stats).row) == ord("a")
    rg.consume(ord("a"), 0)
    assert not rg.stopped() and not rg.ended_reasoning()
    with pytest.raises(GrammarStateError):
        rg.consume(ord("x"), 1)  # the grammar refuses it: the typed error, at its position


def test_a_grammar_already_failed_is_refused_at_once(byte):
    m = GrammarCompiler(byte).compile(Constraint.regex("ab")).matcher()
    m.consume_token(ord("x"))
    with pytest.raises(GrammarStateError):
        RequestGrammar(m)


def test_a_mask_fill_that_fails_is_the_request_s_error_not_the_round_s(byte):
    class Broken:  # a state whose fill raises
        def __init__(self, m):
            self.m = m

        def deep_copy(self):
            return Broken(self.m.deep_copy())

        def unsafe_compute_mask_ptr(self, ptr, size):
            raise RuntimeError("boom")

        def is_error(self):
            return False

        def stop_reason(self):
            return "NotStopped"

        def get_error(self):
            return ""

    rg = RequestGrammar(Broken(GrammarCompiler(byte).compile(Constraint.regex("ab")).matcher()),
                        pools=FillPools(1, 1))
    rg.ask_next_mask(byte.vocab_size, 5)
    got = rg.take_next_mask(StepTimings())
    assert isinstance(got.error, GrammarStateError) and got.error.position == 5


def test_the_thinking_gate_is_a_part_of_the_state_and_copies_with_it(byte):
    # a thinking budget of 2: after two reasoning tokens only the end marker's bytes are
    # allowed, on the request's state and on a copy alike; the copy does not move the original
    thinking = Thinking("</think>", open="<think>", budget=2)
    compiler = GrammarCompiler(byte)
    g = compiler.compile(Constraint.regex("[a-z]+"), thinking)
    cur = ThinkingCursor.of(g.matcher(), compiler.markup, thinking, byte.vocab_size)
    for t in b"<think>xy":
        assert cur.consume_token(t), cur.get_error()
    copy = cur.deep_copy()
    assert single_allowed(_fill(copy, byte)[0]) == ord("<")
    assert copy.forcing() == ord("<") and cur.forcing() == ord("<")
    assert not copy.consume_token(ord("z")) and copy.is_error()
    assert not cur.is_error() and cur.gate.n == len(b"<think>xy")
    for t in b"</think>":
        assert cur.consume_token(t), cur.get_error()
    assert cur.gate.ended and RequestGrammar(cur).ended_reasoning()
