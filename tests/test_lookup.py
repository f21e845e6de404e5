"""Prompt lookup (n-gram) proposals: the index and the cursor as pure logic, then the drafter
inside speculative decoding on tiny models (output must equal plain decoding)."""

from __future__ import annotations

import pytest

from specdec.lookup import LookupCursor, NgramIndex


def test_longest_suffix_wins_and_latest_occurrence_is_used():
    idx = NgramIndex([1, 2, 3, 9, 2, 3, 7, 5, 2, 3], max_n=3)
    # Suffix (5, 2, 3) never appeared before; (2, 3) did, latest at 4..5 -> continuation 7.
    assert idx.find([5, 2, 3], min_n=2) == (6, 2)
    assert idx.tokens[6] == 7
    # (1, 2, 3) is a 3-gram match: its continuation is 9.
    assert idx.find([1, 2, 3], min_n=2) == (3, 3)


def test_suffix_shorter_than_min_ngram_finds_nothing():
    idx = NgramIndex([4, 5, 6, 4, 8], max_n=4)
    assert idx.find([0, 4], min_n=2) is None  # only the 1-gram (4,) repeats
    assert idx.find([0, 4], min_n=1) == (4, 1)


def test_the_context_tail_never_matches_itself():
    idx = NgramIndex([7, 8, 9], max_n=2)
    assert idx.find([8, 9], min_n=1) is None  # 9 has no continuation yet
    idx.extend([1])
    assert idx.find([8, 9], min_n=2) == (3, 2)


def test_cursor_follows_a_copied_span_and_researches_after_a_mismatch():
    prompt = [10, 11, 12, 13, 14, 15, 90, 10, 11, 20, 21]
    idx = NgramIndex(prompt, max_n=3)
    cur = LookupCursor(idx, min_n=2)
    ctx = [50, 10, 11]  # the output starts copying "10 11 ..."
    # Latest "10 11" is at 7..8, followed by 20.
    assert cur.next(ctx) == 20
    cur.advance(20)
    assert cur.next(ctx + [20]) == 21
    cur.advance(99)  # something else was proposed: the cursor lets go
    assert cur.next([20, 99]) is None


def test_min_ngram_and_max_n_are_validated():
    with pytest.raises(ValueError, match="max_n"):
        NgramIndex([], max_n=0)
