"""Suffix decoding (Oliaro et al., "SuffixDecoding", 2024): drafts from suffix trees over the request's
own tokens and over recent requests' outputs.

Each tree is a trie of every substring of its text up to ``max_depth`` tokens, with, per node, how
many times that substring occurs (``count``) and where its latest occurrence ends (``last``). A
token appended to the text extends the "active" nodes (the text's suffixes of length < max_depth) by
one child each, so the tree grows in O(max_depth) per new token, never rescanning the context.

Proposing for a context (prompt + output):
1. match: the longest suffix of the context, at most ``max_match`` tokens, that occurred earlier in
   the tree's text followed by at least one token (a node with children). Both trees are tried; the
   longer match wins, the request's own tree on a tie.
2. draft: from the matched node, repeatedly take the most frequent continuation (the child with the
   largest count; on equal counts the one that occurred most recently), while
   - the estimated probability of the whole draft, the product of count(child) / sum of the
     children's counts, stays >= ``min_token_prob``,
   - the draft has fewer than ``min(k, ceil(max_spec_factor * match length))`` tokens (a short
     match is weak evidence), and the path stays within ``max_depth``.
The per-request tree covers prompt + output; the global tree holds the outputs of recently finished
requests in two generations (the current one takes new outputs; when it holds
``max_cached_requests`` requests or ``global_max_tokens`` tokens it becomes the previous one and the
older generation is dropped), so its size is bounded and nothing is ever deleted from a tree.
Parameter names follow vLLM's ``suffix_decoding_*`` options; a ``SpeculativeConfig`` that carries
them (``suffix_decoding_max_tree_depth`` ...) sets them, otherwise the defaults below apply.
Memory: at most ``max_depth`` nodes per token of text (in practice about that many: long
substrings of natural text are unique).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenfab.engine.requests.sequence import Sequence

_KEY = 1 << 32  # edge key = node * _KEY + token (token ids < 2^32)


class SuffixTrie:
    """A depth-bounded suffix trie over one or more documents appended token by token."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"suffix tree depth must be at least 2, got {max_depth}")
        self.max_depth = max_depth
        self.num_tokens = 0  # tokens inserted, all documents together (positions count from 0)
        # nodes as parallel lists (node 0 is the root): depth, occurrence count, end position of the
        # latest occurrence, best child (most frequent, then most recent; -1 none), children's total count
        self.depth = [0]
        self.count = [0]
        self.last = [-1]
        self.best = [-1]
        self.child_sum = [0]
        self.token = [-1]  # the edge token into the node
        self.edges: dict[int, int] = {}
        self._active: list[int] = []  # nodes of the current document's suffixes shorter than max_depth

    @property
    def num_nodes(self) -> int:
        return len(self.depth)

    def new_document(self) -> None:
        """Later tokens do not continue the earlier ones (another request's output)."""
        self._active = []

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self._append(t)

    def _append(self, t: int) -> None:
        pos = self.num_tokens
        self.num_tokens += 1
        nxt = []
        for parent in [0, *self._active]:
            key = parent * _KEY + t
            c = self.edges.get(key)
            if c is None:
                c = self.edges[key] = len(self.depth)
                self.depth.append(self.depth[parent] + 1)
                self.count.append(0)
                self.last.append(-1)
                self.best.append(-1)
                self.child_sum.append(0)
                self.token.append(t)
            self.count[c] += 1
            self.last[c] = pos
            self.child_sum[parent] += 1
            b = self.best[parent]
            # c's count grew and its occurrence is the newest: it beats every child it now ties
            if b < 0 or self.count[c] >= self.count[b]:
                self.best[parent] = c
            if self.depth[c] < self.max_depth:
                nxt.append(c)
        self._active = nxt

    def child(self, node: int, t: int) -> int:
        return self.edges.get(node * _KEY + t, -1)

    def active_match(self, max_match: int) -> tuple[int, int]:
        """(node, length) of the longest suffix of the current document, at most ``max_match``
        long, that has a continuation; (-1, 0) when none. O(max_depth)."""
        for node in reversed(self._active):  # deepest last
            if self.depth[node] <= max_match and self.child_sum[node] > 0:
                return node, self.depth[node]
        return -1, 0

    def match(self, context: list[int], max_match: int) -> tuple[int, int]:
        """The same for an arbitrary context (walks from the root; O(max_match^2) at worst)."""
        for m in range(min(max_match, len(context), self.max_depth - 1), 0, -1):
            node = 0
            for t in context[len(context) - m :]:
                node = self.edges.get(node * _KEY + t, -1)
                if node < 0:
                    break
            if node >= 0 and self.child_sum[node] > 0:
                return node, m
        return -1, 0

    def draft(self, node: int, n: int, min_prob: float) -> list[int]:
        """Up to n tokens down the most frequent path from ``node`` (see the module docstring)."""
        out: list[int] = []
        prob = 1.0
        while len(out) < n and self.child_sum[node] > 0:
            c = self.best[node]
            prob *= self.count[c] / self.child_sum[node]
            if prob < min_prob:
                break
            out.append(self.token[c])
            node = c
        return out


@dataclass
class _Request:
    trie: SuffixTrie
    upto: int  # tokens of seq.token_ids inserted


class SuffixProposer:
    """The ``Proposer`` for suffix decoding (see the module docstring)."""

    def __init__(self, config: object | None = None, *, max_depth: int | None = None, max_match: int | None = None,
                 max_spec_factor: float | None = None, min_token_prob: float | None = None,
                 max_cached_requests: int | None = None, global_max_tokens: int = 16384) -> None:
        def pick(value, name, default):
            return value if value is not None else getattr(config, name, default)

        self.max_depth = int(pick(max_depth, "suffix_decoding_max_tree_depth", 24))
        self.max_match = int(pick(max_match, "suffix_decoding_max_match", min(16, self.max_depth - 1)))
        self.max_spec_factor = float(pick(max_spec_factor, "suffix_decoding_max_spec_factor", 2.0))
        self.min_token_prob = float(pick(min_token_prob, "suffix_decoding_min_token_prob", 0.1))
        self.max_cached_requests = int(pick(max_cached_requests, "suffix_decoding_max_cached_requests", 1000))
        self.global_max_tokens = global_max_tokens
        if self.max_depth < 2 or not 1 <= self.max_match < self.max_depth:
            raise ValueError(f"suffix decoding needs max_depth >= 2 and 1 <= max_match < max_depth, got "
                             f"{self.max_depth} and {self.max_match}")
        if self.max_spec_factor <= 0 or not 0.0 <= self.min_token_prob <= 1.0 or self.max_cached_requests < 0:
            raise ValueError("suffix decoding: max_spec_factor must be > 0, min_token_prob in [0, 1], "
                             "max_cached_requests >= 0")
        self._requests: dict[str, _Request] = {}
        self._seqs: dict[str, Sequence] = {}  # live requests, whose outputs go to the global tree on release
        self._current = SuffixTrie(self.max_depth)
        self._previous: SuffixTrie | None = None
        self._current_requests = 0

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = seq.token_ids
        if k <= 0 or not tokens or tokens[-1] < 0:  # < 0: a token still on the device
            return []
        req = self._requests.get(seq.request_id)
        if req is None or req.upto > len(tokens):
            req = self._requests[seq.request_id] = _Request(SuffixTrie(self.max_depth), 0)
        req.trie.extend(tokens[req.upto :])  # O(new tokens * max_depth)
        req.upto = len(tokens)
        if self.max_cached_requests:
            self._seqs[seq.request_id] = seq
        best_trie, node, m = req.trie, *req.trie.active_match(self.max_match)
        for trie in (self._current, self._previous):
            if trie is not None and trie.num_tokens:
                g_node, g_m = trie.match(tokens, self.max_match)
                if g_m > m:
                    best_trie, node, m = trie, g_node, g_m
        if m == 0:
            return []
        n = min(k, math.ceil(self.max_spec_factor * m))
        return best_trie.draft(node, n, self.min_token_prob)

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        seq = self._seqs.pop(request_id, None)
        out = [t for t in seq.output_token_ids if t >= 0] if seq is not None else []
        if not out:
            return
        if self._current_requests >= self.max_cached_requests or self._current.num_tokens >= self.global_max_tokens:
            self._previous, self._current, self._current_requests = self._current, SuffixTrie(self.max_depth), 0
        self._current.new_document()
        self._current.extend(out)
        self._current_requests += 1
