"""The suffix-decoding proposer (tokenfab/speculative/suffix.py) against a brute-force reference that scans
the texts for every substring occurrence (the rule written plainly), plus hypothesis property tests."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.sequence import Sequence
from tokenfab.speculative.proposer import Proposer
from tokenfab.speculative.suffix import SuffixProposer, SuffixTrie


def _seq(rid: str, prompt: list[int], out: list[int] = ()) -> Sequence:
    s = Sequence(rid, None, list(prompt), SamplingParams(), base_seed=0)
    s.token_ids += list(out)
    return s


# ---------------------------------------------------------------- the reference


def _occurrences(docs: list[list[int]], pattern: list[int]) -> list[tuple[int, int]]:
    """(document, end index) of every occurrence of pattern, in insertion order."""
    m = len(pattern)
    return [(d, i + m - 1) for d, doc in enumerate(docs) for i in range(len(doc) - m + 1) if doc[i:i + m] == pattern]


def _match(docs: list[list[int]], context: list[int], max_match: int, depth: int) -> int:
    """The longest suffix of context (<= max_match, < depth) occurring in docs followed by a token."""
    for m in range(min(max_match, len(context), depth - 1), 0, -1):
        if any(e + 1 < len(docs[d]) for d, e in _occurrences(docs, context[len(context) - m:])):
            return m
    return 0


def _draft(docs: list[list[int]], path: list[int], n: int, min_prob: float, depth: int) -> list[int]:
    out: list[int] = []
    prob = 1.0
    while len(out) < n and len(path) < depth:
        follow = [(docs[d][e + 1], (d, e + 1)) for d, e in _occurrences(docs, path) if e + 1 < len(docs[d])]
        if not follow:
            break
        counts: dict[int, list] = {}
        for t, where in follow:
            c = counts.setdefault(t, [0, where])
            c[0] += 1
            c[1] = max(c[1], where)
        t, (c, _) = max(counts.items(), key=lambda kv: (kv[1][0], kv[1][1]))  # most frequent, then most recent
        prob *= c / len(follow)
        if prob < min_prob:
            break
        out.append(t)
        path = path + [t]
    return out


def reference(context: list[int], trees: list[list[list[int]]], k: int, depth: int = 24, max_match: int = 16,
              factor: float = 2.0, min_prob: float = 0.1) -> list[int]:
    """trees: the request's own text first, then the global generations (current, previous), each a
    list of documents; the longest match wins, the earlier tree on ties."""
    best, m = None, 0
    for docs in trees:
        mm = _match(docs, context, max_match, depth)
        if mm > m:
            best, m = docs, mm
    if m == 0 or k <= 0:
        return []
    return _draft(best, context[len(context) - m:], min(k, math.ceil(factor * m)), min_prob, depth)


# ---------------------------------------------------------------- unit cases


def test_is_a_proposer():
    assert isinstance(SuffixProposer(), Proposer)


def test_copies_the_continuation_of_an_earlier_span():
    p = SuffixProposer()
    seq = _seq("a", [5, 6, 7, 8, 9, 1, 2, 5, 6])
    assert p.propose(seq, 3) == [7, 8, 9]


def test_most_frequent_continuation_wins_then_most_recent():
    p = SuffixProposer(min_token_prob=0.0)
    # after [1, 2]: 3 twice, 4 once -> 3
    assert p.propose(_seq("a", [1, 2, 3, 7, 1, 2, 4, 8, 1, 2, 3, 9, 1, 2]), 1) == [3]
    # 3 once, 4 once: the more recent (4)
    assert p.propose(_seq("b", [1, 2, 3, 7, 1, 2, 4, 8, 1, 2]), 1) == [4]


def test_min_prob_and_spec_factor_stop_the_draft():
    # after [9]: 1 once, 2 once, 3 once... each continuation has probability 1/3 < 0.5
    seq = _seq("a", [9, 1, 9, 2, 9, 3, 9])
    assert SuffixProposer(min_token_prob=0.5).propose(seq, 4) == []
    assert SuffixProposer(min_token_prob=0.3).propose(seq, 1) == [3]
    # a 1-token match drafts at most ceil(factor * 1) tokens
    seq = _seq("b", [7, 1, 2, 3, 4, 5, 7])
    assert SuffixProposer(max_spec_factor=2.0).propose(seq, 8) == [1, 2]
    assert SuffixProposer(max_spec_factor=4.0).propose(seq, 8) == [1, 2, 3, 4]


def test_no_match_no_draft_and_k0():
    p = SuffixProposer()
    assert p.propose(_seq("a", [1, 2, 3, 4]), 4) == []
    assert p.propose(_seq("b", [1, 2, 1, 2]), 0) == []


def test_incremental_work_is_per_new_token():
    p = SuffixProposer()
    seq = _seq("a", list(range(50)) * 2)
    p.propose(seq, 4)
    trie = p._requests["a"].trie
    nodes = trie.num_nodes
    assert trie.num_tokens == 100 and nodes <= 1 + 100 * p.max_depth
    seq.token_ids.append(3)
    p.propose(seq, 4)
    assert trie.num_tokens == 101 and trie.num_nodes - nodes <= p.max_depth


def test_global_tree_serves_a_new_request_and_release_frees_state():
    p = SuffixProposer()
    a = _seq("a", [100, 101], [1, 2, 3, 4, 5, 6])
    p.propose(a, 4)
    p.release("a")
    assert "a" not in p._requests
    b = _seq("b", [200, 201], [1, 2, 3])
    assert p.propose(b, 3) == [4, 5, 6]
    p.release("b")
    p.release("never-seen")  # no error


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        SuffixProposer(max_depth=1)
    with pytest.raises(ValueError):
        SuffixProposer(max_depth=8, max_match=8)
    with pytest.raises(ValueError):
        SuffixProposer(min_token_prob=2.0)
    with pytest.raises(ValueError):
        SuffixTrie(1)


# ---------------------------------------------------------------- properties against the reference

_tokens = st.lists(st.integers(0, 4), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(prompt=_tokens, out=st.lists(st.integers(0, 4), max_size=30), k=st.integers(0, 6),
       depth=st.integers(3, 10), factor=st.sampled_from([0.5, 1.0, 2.0]), min_prob=st.sampled_from([0.0, 0.1, 0.4]),
       chunk=st.integers(1, 7))
def test_matches_the_reference_as_tokens_arrive(prompt, out, k, depth, factor, min_prob, chunk):
    p = SuffixProposer(max_depth=depth, max_match=depth - 1, max_spec_factor=factor, min_token_prob=min_prob,
                       max_cached_requests=0)
    seq = _seq("r", prompt)
    for i in range(0, len(out) + 1, chunk):
        seq.token_ids[len(prompt):] = out[:i]
        want = reference(seq.token_ids, [[seq.token_ids]], k, depth, depth - 1, factor, min_prob)
        assert p.propose(seq, k) == want


@settings(max_examples=80, deadline=None)
@given(outputs=st.lists(_tokens, min_size=1, max_size=6), context=_tokens, k=st.integers(1, 6),
       cached=st.integers(1, 3))
def test_global_generations_match_the_reference(outputs, context, k, cached):
    p = SuffixProposer(max_depth=8, max_match=6, min_token_prob=0.0, max_cached_requests=cached)
    gens: list[list[list[int]]] = [[]]  # newest generation last
    for i, o in enumerate(outputs):
        s = _seq(f"r{i}", [99], o)
        p.propose(s, 1)
        p.release(s.request_id)
        if len(gens[-1]) >= cached:
            gens.append([])
        gens[-1].append(o)
    current, previous = gens[-1], (gens[-2] if len(gens) > 1 else [])
    seq = _seq("new", context)
    want = reference(context, [[context], current, previous], k, 8, 6, 2.0, 0.0)
    assert p.propose(seq, k) == want
