"""The acceptance rule of speculative decoding (tokenfab/speculative/accept.py).

Greedy: unit cases against the definition (longest prefix of draft == argmax, then the argmax).
Sampled: chi-square goodness-of-fit tests of the emitted tokens' distribution against the target's
filtered distribution, computed independently in numpy (tests/engine/sampling_definition.py), over
many seeds. Each test states its false-alarm rate ALPHA; seeds are fixed, so the outcome is
deterministic. Each test also shows that a deliberately wrong rule is caught at the same ALPHA.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from tests.engine.sampling_definition import filtered_distribution
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.sequence import Sequence
from tokenfab.engine.runner.sampler import sample_tokens
from tokenfab.speculative.accept import accept_tokens

ALPHA = 1e-4  # the chance that a correct rule fails one chi-square test here
V = 10
# sample sizes: the fast tier's (enough for the wrong rules to be caught at p < 1e-100) and the full ones (slow twins)
N_ONE = [5000, pytest.param(20000, marks=pytest.mark.slow)]
N_TWO = [8000, pytest.param(30000, marks=pytest.mark.slow)]


def _seq(params: SamplingParams, seed: int = 0, prompt=(1, 2, 3), out=()) -> Sequence:
    s = Sequence(f"r{seed}", None, list(prompt), params, base_seed=seed)
    s.token_ids += list(out)
    return s


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=100, **kw)


def _onehot_logits(tokens: list[int], v: int = V) -> torch.Tensor:
    x = torch.randn(len(tokens), v, generator=torch.Generator().manual_seed(0))
    x[torch.arange(len(tokens)), torch.tensor(tokens)] = 10.0
    return x


# ---------------------------------------------------------------- greedy


def test_greedy_all_accepted_gives_bonus():
    logits = _onehot_logits([4, 5, 6, 7])
    assert accept_tokens(logits, [_seq(_greedy())], [[4, 5, 6]], eos_ids=[0]) == [[4, 5, 6, 7]]


def test_greedy_first_rejected():
    logits = _onehot_logits([4, 5, 6, 7])
    assert accept_tokens(logits, [_seq(_greedy())], [[3, 5, 6]], eos_ids=[0]) == [[4]]


def test_greedy_middle_mismatch_stops_there():
    logits = _onehot_logits([4, 5, 6, 7])
    # the third draft matches its row, but the second did not: nothing after the mismatch stands
    assert accept_tokens(logits, [_seq(_greedy())], [[4, 9, 6]], eos_ids=[0]) == [[4, 5]]


def test_greedy_k0_is_plain_argmax():
    logits = _onehot_logits([8])
    assert accept_tokens(logits, [_seq(_greedy())], [[]], eos_ids=[0]) == [[8]]


def test_greedy_ties_break_like_the_plain_sampler():
    # rows with tied maxima: the plain sampler takes the first index; a draft of the second tied
    # index is therefore rejected, a draft of the first accepted
    logits = torch.zeros(2, V)
    logits[:, 3] = logits[:, 6] = 5.0
    seq = _seq(_greedy())
    plain = sample_tokens(logits[:1], [seq], [0]).item()
    assert plain == 3
    assert accept_tokens(logits, [seq], [[6]], eos_ids=[0]) == [[3]]
    assert accept_tokens(logits, [seq], [[3]], eos_ids=[0]) == [[3, 3]]


def test_greedy_batched_ragged():
    rows = [4, 5, 6] + [1] + [2, 3]  # seq0 k=2, seq1 k=0, seq2 k=1
    logits = _onehot_logits(rows)
    seqs = [_seq(_greedy(), i) for i in range(3)]
    out = accept_tokens(logits, seqs, [[4, 5], [], [9]], eos_ids=[0])
    assert out == [[4, 5, 6], [1], [2]]


def test_eos_and_max_tokens_cut_the_output():
    logits = _onehot_logits([4, 0, 6, 7])
    assert accept_tokens(logits, [_seq(_greedy())], [[4, 0, 6]], eos_ids=[0]) == [[4, 0]]
    assert accept_tokens(logits, [_seq(_greedy(ignore_eos=True))], [[4, 0, 6]], eos_ids=[0]) == [[4, 0, 6, 7]]
    assert accept_tokens(logits, [_seq(_greedy(stop_token_ids=[6]))], [[4, 0, 6]], eos_ids=[]) == [[4, 0, 6]]
    capped = _seq(SamplingParams(temperature=0.0, max_tokens=3), out=[9])  # 2 tokens left
    assert accept_tokens(logits, [capped], [[4, 0, 6]], eos_ids=[]) == [[4, 0]]


def test_bad_input_is_refused():
    seq = _seq(_greedy())
    with pytest.raises(ValueError, match="target_logits"):
        accept_tokens(torch.zeros(2, V), [seq], [[1, 2]], eos_ids=[0])
    with pytest.raises(ValueError, match="draft token"):
        accept_tokens(torch.zeros(2, V), [seq], [[V]], eos_ids=[0])
    with pytest.raises(ValueError, match="draft_probs"):
        accept_tokens(torch.zeros(2, V), [seq], [[1]], eos_ids=[0], draft_probs=torch.zeros(2, V))
    biased = _seq(SamplingParams(temperature=0.0, logit_bias={1: 5.0}))
    with pytest.raises(ValueError, match="logit-editing"):
        accept_tokens(torch.zeros(2, V), [biased], [[1]], eos_ids=[0])


def test_k0_sampled_equals_plain_sampler():
    # with no drafts, the emitted token is the plain sampler's draw at that position, bit for bit
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 50, generator=g) * 3
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, max_tokens=100)
    seqs = [_seq(params, seed=i, out=[7] * (i % 5)) for i in range(64)]
    plain = sample_tokens(logits, seqs, [0]).tolist()
    assert [o[0] for o in accept_tokens(logits, seqs, [[]] * 64, eos_ids=[])] == plain


# ---------------------------------------------------------------- sampled: the distribution


def test_target_probs_equal_the_sampler_filter():
    from tokenfab.kernels.sampling import filter_probs_ref
    from tokenfab.speculative.accept import _filters, _target_probs

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(4)) * 2
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
              for t, k, p, m in [(1.0, 0, 1.0, 0.0), (0.5, 20, 1.0, 0.0), (1.5, 0, 0.9, 0.0), (0.8, 0, 1.0, 0.2),
                                 (1.0, 400, 1.0, 0.05), (0.9, 10, 0.8, 0.1)]]
    want = filter_probs_ref(logits, *_filters(params, 300, logits.device))
    torch.testing.assert_close(_target_probs(logits, params, 300), want, atol=1e-7, rtol=1e-5)


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square goodness of fit; cells of probability 0 must be empty (else p = 0)."""
    n = counts.sum()
    zero = probs <= 0
    if counts[zero].sum() > 0:
        return 0.0
    exp, obs = n * probs[~zero], counts[~zero].astype(np.float64)
    # cells expecting fewer than 5 are pooled into one (the usual validity rule of the test)
    order = np.argsort(exp)
    small = int((exp < 5).sum())
    cut = max(small, int(np.searchsorted(np.cumsum(exp[order]), 5.0)) + 1) if small else 0
    if cut:
        pooled = order[:cut]
        exp = np.append(np.delete(exp, pooled), exp[pooled].sum())
        obs = np.append(np.delete(obs, pooled), obs[pooled].sum())
    assert len(exp) >= 2 and exp.min() >= 5, "too few samples for the chi-square approximation"
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _draw(probs: np.ndarray, n: int, seed: int) -> np.ndarray:
    """n independent draws from probs (the draft's own randomness: independent of the rule's)."""
    return np.random.default_rng(seed).choice(len(probs), size=n, p=probs)


T_LOGITS = np.array([2.0, 1.3, 0.4, -0.5, 1.0, 0.1, -1.0, 1.7, 0.7, -2.0])
Q0 = np.array([0.05, 0.25, 0.2, 0.02, 0.08, 0.1, 0.1, 0.05, 0.1, 0.05])
SETTINGS = [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=6, top_p=0.9, min_p=0.0),
    dict(temperature=1.3, top_k=0, top_p=0.8, min_p=0.1),
    dict(temperature=1.2, top_k=0, top_p=1.0, min_p=0.15),  # no sort needed: the softmax path
]


def _first_tokens(settings: dict, n: int, q_rows: np.ndarray | None, drafts0: np.ndarray,
                  k: int = 1) -> np.ndarray:
    """The first emitted token of n requests (seeds 0..n-1), one draft row each verified by row
    T_LOGITS (the same context for every draft), bonus rows from T_LOGITS too."""
    params = SamplingParams(max_tokens=100, **settings)
    seqs = [_seq(params, seed=1000 + i) for i in range(n)]
    drafts = [[int(d)] + [0] * (k - 1) for d in drafts0]
    logits = torch.tensor(T_LOGITS, dtype=torch.float32).repeat(n * (k + 1), 1)
    dp = None if q_rows is None else torch.tensor(q_rows, dtype=torch.float32).repeat(n * k, 1)
    out = accept_tokens(logits, seqs, drafts, eos_ids=[], draft_probs=dp)
    return np.array([o[0] for o in out])


@pytest.mark.parametrize("n", N_ONE)
@pytest.mark.parametrize("settings", SETTINGS)
def test_first_token_distribution_is_the_target(settings, n):
    p = filtered_distribution(T_LOGITS, **settings)
    drafts = _draw(Q0, n, seed=7)
    first = _first_tokens(settings, n, Q0, drafts)
    assert _chi2_pvalue(np.bincount(first, minlength=V), p) > ALPHA
    # point-mass drafts (an n-gram proposer) with the same draws
    first = _first_tokens(settings, n, None, drafts)
    assert _chi2_pvalue(np.bincount(first, minlength=V), p) > ALPHA


@pytest.mark.parametrize("n", N_ONE)
def test_wrong_rules_are_caught(n):
    settings = SETTINGS[1]
    p = filtered_distribution(T_LOGITS, **settings)
    drafts = _draw(Q0, n, seed=7)
    # always accepting emits the draft: its distribution is q, not p
    assert _chi2_pvalue(np.bincount(drafts, minlength=V), p) < ALPHA
    # ignoring q (drafts drawn from q but verified as point masses... then treated as drawn from a
    # different q): claiming q is uniform while it is Q0 biases the result
    wrong_q = np.full(V, 1.0 / V)
    first = _first_tokens(settings, n, wrong_q, drafts)
    assert _chi2_pvalue(np.bincount(first, minlength=V), p) < ALPHA


# ---------------------------------------------------------------- sampled: two tokens, k = 2


@functools.cache  # a few distinct arguments, called per request: computed once (read-only)
def _l1(x0: int) -> np.ndarray:
    """The target's logits for the second token given the first (a known conditional)."""
    return np.roll(T_LOGITS, x0) + 0.3 * np.arange(V) / V


@functools.cache  # a few distinct arguments, called per request: computed once (read-only)
def _l2(x0: int, x1: int) -> np.ndarray:
    return np.roll(T_LOGITS, x0 + 2 * x1)


@functools.cache  # a few distinct arguments, called per request: computed once (read-only)
def _q1(x0: int) -> np.ndarray:
    return np.roll(Q0, 3 * x0)


def _first_two(settings: dict, n: int, seed: int, point_mass: bool = False) -> np.ndarray:
    """Per request: the first two emitted tokens, over as many steps as it takes (k = 2, then k = 1
    from the context the first step left), drafts drawn from the known q by their own generator."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=100, **settings)
    seqs = [_seq(params, seed=50_000 + i) for i in range(n)]
    d0 = np.array([rng.choice(V, p=Q0) for _ in range(n)])
    d1 = np.array([rng.choice(V, p=_q1(a)) for a in d0])
    rows = np.stack([r for a, b in zip(d0, d1) for r in (T_LOGITS, _l1(a), _l2(a, b))])
    qs = np.stack([r for a in d0 for r in (Q0, _q1(a))])
    out = accept_tokens(torch.tensor(rows, dtype=torch.float32), seqs, [[int(a), int(b)] for a, b in zip(d0, d1)],
                        eos_ids=[], draft_probs=None if point_mass else torch.tensor(qs, dtype=torch.float32))
    short = [i for i, o in enumerate(out) if len(o) == 1]
    for i in short:
        seqs[i].token_ids.append(out[i][0])
    d = [int(rng.choice(V, p=_q1(out[i][0]))) for i in short]
    rows2 = np.stack([r for i, b in zip(short, d) for r in (_l1(out[i][0]), _l2(out[i][0], b))])
    out2 = accept_tokens(torch.tensor(rows2, dtype=torch.float32), [seqs[i] for i in short], [[b] for b in d],
                         eos_ids=[], draft_probs=None if point_mass else torch.tensor(
                             np.stack([_q1(out[i][0]) for i in short]), dtype=torch.float32))
    for i, o in zip(short, out2):
        out[i] = out[i] + o
    return np.array([o[:2] for o in out]), np.stack([d0, d1], 1)


@pytest.mark.parametrize("settings,point_mass", [(SETTINGS[0], False),
                                                 (dict(temperature=0.8, top_k=5, top_p=0.95, min_p=0.0), False),
                                                 (dict(temperature=0.8, top_k=5, top_p=0.95, min_p=0.0), True)])
@pytest.mark.parametrize("n", N_TWO)
def test_first_two_tokens_joint_distribution(settings, point_mass, n):
    """k = 2 with the draft's q (draft model) or as point masses (n-gram/suffix drafts)."""
    pairs, drafted = _first_two(settings, n, seed=11, point_mass=point_mass)
    p0 = filtered_distribution(T_LOGITS, **settings)
    joint = np.stack([p0[a] * filtered_distribution(_l1(a), **settings) for a in range(V)]).reshape(-1)
    assert _chi2_pvalue(np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V), joint) > ALPHA
    # the wrong rule "always accept" (emit the drafted pair) is caught
    assert _chi2_pvalue(np.bincount(drafted[:, 0] * V + drafted[:, 1], minlength=V * V), joint) < ALPHA


def test_a_request_draws_the_same_alone_and_batched():
    g = torch.Generator().manual_seed(3)
    kinds = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=100), SamplingParams(temperature=0.0),
             SamplingParams(temperature=0.7, min_p=0.05, max_tokens=100)]
    seqs = [_seq(kinds[i % 3], seed=i, out=[1] * i) for i in range(6)]
    drafts = [[int(t) for t in torch.randint(0, V, (i % 4,), generator=g)] for i in range(6)]
    rows = sum(len(d) + 1 for d in drafts)
    logits = torch.randn(rows, V, generator=g)
    qs = torch.softmax(torch.randn(rows - 6, V, generator=g), -1)
    batched = accept_tokens(logits, seqs, drafts, eos_ids=[], draft_probs=qs)
    r = q = 0
    for s, d, want in zip(seqs, drafts, batched):
        k = len(d)
        alone = accept_tokens(logits[r:r + k + 1], [s], [d], eos_ids=[], draft_probs=qs[q:q + k])
        assert alone == [want]
        r, q = r + k + 1, q + k


def test_point_mass_drafts_emit_exactly_the_plain_samplers_tokens():
    """With point-mass drafts, every emitted token is the plain sampler's draw at its position:
    a seeded sampled request gives the same tokens with and without speculation."""
    g = torch.Generator().manual_seed(5)
    v, k, n = 40, 4, 200
    params = SamplingParams(temperature=0.9, top_k=12, top_p=0.95, max_tokens=1000)
    seqs = [_seq(params, seed=300 + i, out=[1] * (i % 3)) for i in range(n)]
    logits = torch.randn(n * (k + 1), v, generator=g) * 2
    plain = []  # the plain sampler's token at each verify row (its own position's seed)
    for i, s in enumerate(seqs):
        row = []
        for j in range(k + 1):
            at = _seq(params, seed=300 + i, out=[1] * (s.num_output_tokens + j))
            row.append(int(sample_tokens(logits[i * (k + 1) + j][None], [at], [0])))
        plain.append(row)
    # drafts: the plain draws, with a deliberate miss at a random place (or none)
    drafts = []
    for row in plain:
        d = row[:k]
        miss = int(torch.randint(0, k + 1, (1,), generator=g))
        if miss < k:
            d[miss] = (d[miss] + 1) % v
        drafts.append(d)
    out = accept_tokens(logits, seqs, drafts, eos_ids=[])
    for row, d, o in zip(plain, drafts, out):
        m = next((j for j in range(k) if d[j] != row[j]), k)
        assert o == row[: m + 1]
    assert {len(o) for o in out} == set(range(1, k + 2))  # every accepted length occurs
