"""The n-gram index: kept incrementally, it finds what a rescan finds (the latest earlier occurrence of the
longest matching suffix), and proposes its continuation, repeating a periodic run past the sequence's end."""

from __future__ import annotations

import random

from tokenloop.spec_decode.ngram import NgramIndex


def rescan(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start : start + n] == suffix:
                out = []
                for i in range(k):
                    p = start + n + i
                    out.append(tokens[p] if p < len(tokens) else out[p - len(tokens)])
                return out
    return []


def test_incremental_lookups_equal_a_rescan_at_every_length():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(300)]
    index = NgramIndex(1, 4)
    for end in range(1, len(tokens) + 1):
        index.sync(tokens[:end])  # one token appended per step, as decoding does
        assert index.lookup(tokens[:end], 5) == rescan(tokens[:end], 1, 4, 5), end


def test_the_longest_suffix_wins_and_a_periodic_run_goes_on():
    index = NgramIndex(1, 3)
    tokens = [7, 1, 2, 3, 9, 2, 3, 4, 5, 1, 2, 3]
    index.sync(tokens)
    assert index.lookup(tokens, 2) == [9, 2]  # "1 2 3" matched at the start, not "2 3" (latest)
    run = [5, 6, 5, 6, 5]
    index = NgramIndex(1, 2)
    index.sync(run)
    assert index.lookup(run, 5) == [6, 5, 6, 5, 6]


def test_no_match_proposes_nothing_and_min_n_is_respected():
    index = NgramIndex(2, 3)
    tokens = [1, 2, 3, 4, 1]  # "1" recurs, but one token is below min_n
    index.sync(tokens)
    assert index.lookup(tokens, 4) == []
