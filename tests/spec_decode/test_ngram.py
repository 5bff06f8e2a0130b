"""NgramProposer: exact proposals on hand-made sequences, and a randomized check against a slow reference."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedllm.spec_decode.ngram import NgramProposer


def _propose(seq: list[int], k: int = 3, lo: int = 1, hi: int = 3, max_tokens: int | None = None) -> list[int]:
    return NgramProposer(k, lo, hi).propose(seq, max_tokens)


def _reference(seq: list[int], k: int, lo: int, hi: int, max_tokens: int | None) -> list[int]:
    """Slow, obviously-correct restatement of the documented matching rule."""
    want = k if max_tokens is None else min(k, max_tokens)
    length = len(seq)
    for n in range(hi, lo - 1, -1):
        if want == 0 or length < n + 1:
            continue
        suffix = seq[-n:]
        # Earlier occurrences: they end before the sequence's last token.
        starts = [s for s in range(length - n) if seq[s : s + n] == suffix]
        if not starts:
            continue
        full = [s for s in starts if s + n + want <= length]
        s = full[-1] if full else starts[0]
        return seq[s + n : s + n + want]
    return []


# --------------------------------------------------------------------------- hand-made cases
def test_match_at_start() -> None:
    # Tail [1, 2] occurs at the very start; what followed it is proposed.
    assert _propose([1, 2, 3, 4, 5, 1, 2]) == [3, 4, 5]


def test_match_in_middle() -> None:
    assert _propose([9, 9, 7, 8, 1, 2, 3, 0, 7, 8], hi=2) == [1, 2, 3]


def test_longest_suffix_preferred() -> None:
    # Tail [5, 6]: the 1-gram [6] last occurred at 4 (-> 0, 0), the 2-gram [5, 6] only at 0 (-> 1, 1).
    seq = [5, 6, 1, 1, 6, 0, 0, 2, 5, 6]
    assert _propose(seq, k=2, hi=2) == [1, 1]
    assert _propose(seq, k=2, hi=1) == [0, 0]  # longest allowed is 1: the most recent 1-gram


def test_most_recent_occurrence_with_full_continuation() -> None:
    # Tail [4] occurs at 0 (-> 1 1 1) and at 4 (-> 2 2 2): the more recent wins.
    assert _propose([4, 1, 1, 1, 4, 2, 2, 2, 4]) == [2, 2, 2]


def test_recent_occurrence_too_close_to_end_is_skipped() -> None:
    # Tail [4] at 0 (-> 1 1 1) and at 4 (-> 2 then end): only the older one offers 3 tokens.
    assert _propose([4, 1, 1, 1, 4, 2, 4]) == [1, 1, 1]
    # With k = 1 both are full, so the recent one wins again.
    assert _propose([4, 1, 1, 1, 4, 2, 4], k=1) == [2]


def test_repetition_loop_gets_full_proposal() -> None:
    # Period-2 loop: the most recent [7, 8] is followed by only 2 tokens, an older lap by all 4.
    assert _propose([7, 8, 7, 8, 7, 8], k=4, hi=2) == [7, 8, 7, 8]


def test_truncated_by_end_of_sequence() -> None:
    # The only earlier [1, 2] is followed by just [3, 1, 2] before the sequence ends.
    assert _propose([1, 2, 3, 1, 2], k=5, hi=2) == [3, 1, 2]
    assert _propose([5, 5], k=4) == [5]  # the smallest possible match


def test_truncated_by_max_tokens() -> None:
    seq = [1, 2, 3, 4, 5, 1, 2]
    assert _propose(seq, max_tokens=2) == [3, 4]
    assert _propose(seq, max_tokens=10) == [3, 4, 5]
    assert _propose(seq, max_tokens=0) == []


def test_no_match() -> None:
    assert _propose([1, 2, 3, 4, 5]) == []
    # [2, 3] never occurred before, and min 2 forbids falling back to the 1-gram [3].
    assert _propose([3, 0, 2, 3], lo=2, hi=3) == []


def test_short_sequences() -> None:
    assert _propose([]) == []
    assert _propose([1]) == []
    assert _propose([1, 1], lo=2, hi=2) == []  # shorter than prompt_lookup_min + 1
    assert _propose([1, 1, 1], lo=2, hi=2) == [1]


def test_accepts_numpy_arrays_and_returns_python_ints() -> None:
    out = NgramProposer(3, 1, 3).propose(np.array([1, 2, 3, 4, 5, 1, 2], dtype=np.int32))
    assert out == [3, 4, 5]
    assert all(type(t) is int for t in out)


@pytest.mark.parametrize(
    ("k", "lo", "hi"),
    [(0, 1, 2), (2, 0, 2), (2, 3, 2)],
)
def test_invalid_options_raise(k: int, lo: int, hi: int) -> None:
    with pytest.raises(ValueError):
        NgramProposer(k, lo, hi)


def test_negative_max_tokens_raises() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        NgramProposer(2, 1, 2).propose([1, 1], max_tokens=-1)


# --------------------------------------------------------------------------- randomized cross-check
def test_matches_slow_reference_on_random_sequences() -> None:
    rng = random.Random(1234)
    for _ in range(3000):
        vocab = rng.randint(1, 4)  # tiny vocabularies so that matches of every length happen
        seq = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        k = rng.randint(1, 6)
        max_tokens = rng.choice([None, 0, 1, 2, 5])
        expected = _reference(seq, k, lo, hi, max_tokens)
        got = NgramProposer(k, lo, hi).propose(np.array(seq, dtype=np.int64), max_tokens)
        assert got == expected, (seq, k, lo, hi, max_tokens)
