"""Prompt lookup (n-gram) proposer: the tokens that followed the latest earlier occurrence of the
sequence's current suffix.

For n from ``max_n`` down to ``min_n``: if the last n tokens of prompt + output occurred before,
the draft is the (up to k) tokens that followed their most recent earlier occurrence. It costs no
model and is right often on input-grounded work (summaries, edits, code, extraction), where the
output copies spans of the prompt.

Per request an index maps each n-gram to the end of its latest occurrence that has a successor. It
is extended incrementally with the tokens that arrived since the last call (token ids only grow
while a request lives; preemption keeps them), so a step costs O(new tokens * (max_n - min_n + 1)),
not a scan of the whole context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenfab.engine.requests.sequence import Sequence


@dataclass
class _Index:
    upto: int = 0  # n-grams ending before this position (with a successor token) are indexed
    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)


class NgramProposer:
    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[str, _Index] = {}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = seq.token_ids
        n_tok = len(tokens)
        if k <= 0 or n_tok < self.min_n + 1 or tokens[-1] < 0:  # < 0: a token still on the device
            return []
        idx = self._index.get(seq.request_id)
        if idx is None or idx.upto > n_tok:
            idx = self._index[seq.request_id] = _Index()
        table = idx.last_end
        # index every n-gram tokens[e - n : e] whose successor tokens[e] is known: e <= n_tok - 1
        for e in range(max(idx.upto, self.min_n), n_tok):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                table[tuple(tokens[e - n : e])] = e
        idx.upto = n_tok
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            e = table.get(tuple(tokens[n_tok - n :]))
            if e is not None:
                return list(tokens[e : e + k])
        return []

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)
