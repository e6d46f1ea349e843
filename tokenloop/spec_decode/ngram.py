"""N-gram (prompt lookup) proposer: the continuation of the latest earlier occurrence of the sequence's last n tokens.

Input-grounded work (repeat, correct, quote, rewrite a given text) copies long runs of its prompt, which a
lookup finds for free. Each sequence keeps an index from every n-gram (n in [min, max]) to the position after
its latest occurrence, updated with the tokens appended since the last step: O(max - min + 1) per token,
never a rescan of the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenloop.engine.sequence import Sequence
from tokenloop.spec_decode.proposer import Draft, Proposer


@dataclass(slots=True)
class NgramIndex:
    min_n: int
    max_n: int
    # n-gram -> the position of the token that followed its latest occurrence (always an earlier position than
    # the sequence's end: an n-gram enters once the token after it exists)
    following: dict[tuple[int, ...], int] = field(default_factory=dict)
    synced: int = 0  # tokens indexed so far

    def sync(self, token_ids: list[int]) -> None:
        for j in range(max(self.synced, 1), len(token_ids)):
            for n in range(self.min_n, min(self.max_n, j) + 1):
                self.following[tuple(token_ids[j - n : j])] = j
        self.synced = len(token_ids)

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens: what followed the latest earlier occurrence of the longest matching suffix."""
        for n in range(min(self.max_n, len(token_ids)), self.min_n - 1, -1):
            start = self.following.get(tuple(token_ids[len(token_ids) - n :]))
            if start is not None:
                # Past the sequence's end the continuation repeats itself (a periodic run goes on).
                out: list[int] = []
                for i in range(k):
                    p = start + i
                    out.append(token_ids[p] if p < len(token_ids) else out[p - len(token_ids)])
                return out
        return []


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[str, NgramIndex] = {}
        self._found: dict[str, list[int]] = {}  # this step's lookups, from limits() to propose()

    def limits(self, seqs: list[Sequence], k: int) -> list[int]:
        self._found = {}
        for seq in seqs:
            index = self.indexes.setdefault(seq.seq_id, NgramIndex(self.min_n, self.max_n))
            index.sync(seq.token_ids)
            self._found[seq.seq_id] = index.lookup(seq.token_ids, k)
        return [len(self._found[seq.seq_id]) for seq in seqs]

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        if missing := [seq for seq in seqs if seq.seq_id not in self._found]:
            self.limits(missing, max(num_tokens))
        return [Draft(self._found[seq.seq_id][:k]) for seq, k in zip(seqs, num_tokens)]

    def release(self, seq: Sequence) -> None:
        self.indexes.pop(seq.seq_id, None)
