"""The sampler's promises, each held to a plain definition (tests/engine/sampling_definition.py):
the filters (top-k, top-p on the renormalised top-k distribution, min-p), the draw itself
(its support and frequencies), greedy, the penalties and ``min_tokens``.

Statistical checks use fixed seed sets, so they are deterministic; the bounds they use are stated
where they are asserted.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from tests.engine.sampling_definition import (
    boundary_margin,
    filtered_distribution,
    kept_tokens,
    penalized_logits,
)
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.sequence import Sequence
from tokenfab.engine.runner.sampler import apply_penalties, sample_next
from tokenfab.kernels.sampling import filter_probs_ref

V = 24
TEMPS = [0.6, 1.0, 1.7]
TOP_KS = [0, 1, 3, 7, V, 40]
TOP_PS = [1.0, 0.2, 0.6, 0.9]
MIN_PS = [0.0, 0.05, 0.3]


def _rows(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(0.0, s, V) for s in np.linspace(0.5, 3.0, n)]


def _cases():
    """Every parameter combination over a few logit rows, minus the ones decided by rounding."""
    cases = [
        (row, t, k, p, m)
        for row, t, k, p, m in itertools.product(_rows(4, 0), TEMPS, TOP_KS, TOP_PS, MIN_PS)
        if boundary_margin(row, t, k, p) > 1e-4
    ]
    assert len(cases) > 0.9 * 4 * len(TEMPS) * len(TOP_KS) * len(TOP_PS) * len(MIN_PS)
    return cases


def _filter(row, t, k, p, m) -> torch.Tensor:
    one = lambda x, dt: torch.tensor([x], dtype=dt)  # noqa: E731
    logits = torch.tensor(row, dtype=torch.float32)[None]
    return filter_probs_ref(logits, one(t, torch.float32), one(k, torch.int64), one(p, torch.float32),
                            one(m, torch.float32))[0]


def test_filters_keep_exactly_the_defined_set_with_renormalised_probabilities():
    n_differs = 0
    for row, t, k, p, m in _cases():
        got = _filter(row, t, k, p, m)
        want = filtered_distribution(row, t, k, p, m)
        assert {int(i) for i in torch.nonzero(got).flatten()} == kept_tokens(row, t, k, p, m), (t, k, p, m)
        np.testing.assert_allclose(got.double().numpy(), want, atol=2e-6)
        # the cases really exercise the difference between "after top-k" and "on the full distribution"
        if 0 < k < V and p < 1.0 and kept_tokens(row, t, k, p, 0.0) != kept_tokens(row, t, 0, p, 0.0) & set(
            np.argsort(-np.asarray(row))[:k].tolist()
        ):
            n_differs += 1
    assert n_differs > 10


def test_filters_are_per_row_in_a_batch():
    """A batch of rows with their own parameters gives each row what it gives alone (and rows
    with temperature 0 are filtered at temperature 1: the caller takes their argmax)."""
    rows = _rows(6, 1)
    params = [(0.7, 3, 0.9, 0.0), (1.0, 0, 0.5, 0.0), (1.3, 5, 1.0, 0.1), (0.0, 4, 0.8, 0.0),
              (1.0, 0, 1.0, 0.0), (2.0, 10, 0.95, 0.02)]
    logits = torch.tensor(np.stack(rows), dtype=torch.float32)
    cols = list(zip(*params))
    got = filter_probs_ref(logits, torch.tensor(cols[0]), torch.tensor(cols[1]), torch.tensor(cols[2]),
                           torch.tensor(cols[3]))
    for i, (row, (t, k, p, m)) in enumerate(zip(rows, params)):
        torch.testing.assert_close(got[i], _filter(row, t if t > 0 else 1.0, k, p, m))
    torch.testing.assert_close(got.sum(-1), torch.ones(6))


def test_top_p_never_keeps_a_token_once_the_mass_is_reached():
    """The mutant 'keep tokens past the top-p mass' (or 'stop one short of it') must fail here."""
    probs = np.array([0.5, 0.25, 0.125, 0.0625, 0.04, 0.0225])
    logits = np.log(probs)
    for top_p, n in [(0.4, 1), (0.6, 2), (0.8, 3), (0.9, 4), (0.95, 5), (1.0, 6)]:
        assert kept_tokens(logits, 1.0, 0, top_p, 0.0) == set(range(n))
        got = _filter(logits, 1.0, 0, top_p, 0.0)
        assert torch.nonzero(got).flatten().tolist() == list(range(n)), top_p
    # after top-k 3 the mass is renormalised over 0.875: 0.5 + 0.25 is 0.857 of it, so top_p 0.8
    # keeps two tokens and top_p 0.9 three
    assert torch.nonzero(_filter(logits, 1.0, 3, 0.8, 0.0)).flatten().tolist() == [0, 1]
    assert torch.nonzero(_filter(logits, 1.0, 3, 0.9, 0.0)).flatten().tolist() == [0, 1, 2]
    # on the full distribution 0.75 < 0.8 would have kept a third token
    assert torch.nonzero(_filter(logits, 1.0, 0, 0.8, 0.0)).flatten().tolist() == [0, 1, 2]


def test_min_p_is_relative_to_the_largest_probability():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.08, 0.02]))
    for min_p, kept in [(0.0, 5), (0.04, 5), (0.1, 4), (0.21, 3), (0.45, 3), (0.51, 2), (0.76, 1), (1.0, 1)]:
        assert torch.nonzero(_filter(logits, 1.0, 0, 1.0, min_p)).flatten().tolist() == list(range(kept)), min_p


def test_top_k_keeps_every_token_tied_with_the_kth():
    """Each filter keeps {p >= threshold}: tokens of equal probability stand or fall together."""
    logits = np.array([3.0, 2.0, 2.0, 2.0, 1.0, 0.0])
    assert torch.nonzero(_filter(logits, 1.0, 2, 1.0, 0.0)).flatten().tolist() == [0, 1, 2, 3]
    assert torch.nonzero(_filter(logits, 1.0, 1, 1.0, 0.0)).flatten().tolist() == [0]
    assert torch.nonzero(_filter(logits, 1.0, 5, 1.0, 0.0)).flatten().tolist() == [0, 1, 2, 3, 4]


# ---- the draw, through the engine's sampler -------------------------------------------------------


def _seq(params: SamplingParams, seed: int = 0, prompt=(1, 2), output=()) -> Sequence:
    s = Sequence(f"r{seed}", None, list(prompt), params, seed)
    s.token_ids += list(output)
    return s


def _draw(row: np.ndarray, params: SamplingParams, n: int, eos=(), output=()) -> np.ndarray:
    """n draws of one logits row by sample_next: n requests with base seeds 0..n-1."""
    logits = torch.tensor(row, dtype=torch.float32).expand(n, len(row)).contiguous()
    seqs = [_seq(params, seed=i, output=output) for i in range(n)]
    out = sample_next(logits, seqs, list(eos)).token_ids
    return np.bincount(np.array(out), minlength=len(row))


@pytest.mark.parametrize("t, k, p, m", [(1.0, 0, 1.0, 0.0), (0.8, 6, 1.0, 0.0), (1.3, 0, 0.7, 0.0),
                                        (1.0, 5, 0.8, 0.0), (1.0, 0, 1.0, 0.1), (0.7, 8, 0.95, 0.02)])
def test_sampled_support_and_frequencies_follow_the_definition(t, k, p, m):
    """4000 seeded draws: the tokens drawn are exactly the allowed set (each allowed token has
    probability >= 0.8% here, so missing one in 4000 draws has chance < 12 * 0.992^4000 ~ 1e-13),
    and every frequency is within 5 standard deviations (plus 1/n) of its probability."""
    row = np.log(np.array([30, 20, 12, 9, 7, 6, 5, 4, 3, 2, 1.5, 1.0], dtype=np.float64))
    n = 4000
    counts = _draw(row, SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m), n)
    q = filtered_distribution(row, t, k, p, m)
    assert set(np.nonzero(counts)[0].tolist()) == kept_tokens(row, t, k, p, m)
    assert q[q > 0].min() >= 0.008
    bound = 5 * np.sqrt(q * (1 - q) / n) + 1.0 / n
    assert (np.abs(counts / n - q) <= bound).all(), (counts / n, q)


def test_greedy_is_the_argmax_whatever_the_filters():
    rng = np.random.default_rng(3)
    rows = rng.normal(0, 2, (16, V))
    params = [SamplingParams(temperature=0, top_k=k, top_p=p, min_p=m)
              for k, p, m in itertools.product([0, 3], [1.0, 0.3], [0.0, 0.5])] * 2
    seqs = [_seq(pp, seed=i) for i, pp in enumerate(params)]
    out = sample_next(torch.tensor(rows, dtype=torch.float32), seqs, []).token_ids
    assert out == rows.argmax(1).tolist()


def test_greedy_rows_stay_greedy_in_a_sampled_batch():
    rng = np.random.default_rng(4)
    rows = torch.tensor(rng.normal(0, 1, (8, V)), dtype=torch.float32)
    params = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=5.0) for i in range(8)]
    out = sample_next(rows.clone(), [_seq(p, seed=i) for i, p in enumerate(params)], []).token_ids
    assert out[1::2] == rows[1::2].argmax(1).tolist()


# ---- penalties ---------------------------------------------------------------------------------


def _penalty_cases():
    rng = np.random.default_rng(5)
    for i in range(30):
        logits = rng.normal(0, 2, 10)
        prompt = rng.integers(0, 10, 4).tolist()
        output = rng.integers(0, 10, rng.integers(0, 7)).tolist()
        yield logits, prompt, output, i


@pytest.mark.parametrize("kind", ["presence", "frequency", "repetition"])
def test_each_penalty_follows_its_formula(kind):
    for logits, prompt, output, i in _penalty_cases():
        amount = [0.3, 1.2, -0.7, 2.0, 0.5][i % 5]
        pres, freq, rep = 0.0, 0.0, 1.0
        if kind == "presence":
            pres = amount
        elif kind == "frequency":
            freq = amount
        else:
            rep = abs(amount) + 0.1
        s = _seq(SamplingParams(presence_penalty=pres, frequency_penalty=freq, repetition_penalty=rep),
                 prompt=prompt, output=output)
        got = apply_penalties(torch.tensor(logits, dtype=torch.float32)[None].clone(), [s])[0]
        want = penalized_logits(logits, prompt, output, pres, freq, rep)
        np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-5)


def test_penalties_per_row_in_a_batch():
    """Rows with different penalties and histories do not leak into each other."""
    cases = list(_penalty_cases())[:6]
    params = [SamplingParams(presence_penalty=0.5 * (i % 3), frequency_penalty=0.3 * (i % 2)) for i in range(6)]
    seqs = [_seq(pp, prompt=c[1], output=c[2]) for pp, c in zip(params, cases)]
    got = apply_penalties(torch.tensor(np.stack([c[0] for c in cases]), dtype=torch.float32), seqs)
    for j, (c, pp) in enumerate(zip(cases, params)):
        want = penalized_logits(c[0], c[1], c[2], pp.presence_penalty, pp.frequency_penalty, 1.0)
        np.testing.assert_allclose(got[j].double().numpy(), want, rtol=1e-5, atol=1e-5)


def test_penalties_combined_in_vllms_order():
    logits = np.array([2.0, -1.0, 0.5, 1.0])
    s = _seq(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0),
             prompt=[3], output=[0, 0, 1])
    got = apply_penalties(torch.tensor(logits, dtype=torch.float32)[None].clone(), [s])[0]
    rep = np.array([2.0 / 2, -1.0 * 2, 0.5, 1.0 / 2])  # CTRL first, then OpenAI's subtraction
    want = rep - np.array([2 * 0.25 + 0.5, 0.25 + 0.5, 0.0, 0.0])
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-6)


def test_penalties_steer_greedy_decoding():
    logits = torch.tensor([[5.0, 4.9, 0.0, -1.0]])
    assert sample_next(logits.clone(), [_seq(SamplingParams(temperature=0), output=[0])], []).token_ids == [0]
    params = SamplingParams(temperature=0, presence_penalty=0.2)
    assert sample_next(logits.clone(), [_seq(params, output=[0])], []).token_ids == [1]
    params = SamplingParams(temperature=0, repetition_penalty=1.05)
    assert sample_next(logits.clone(), [_seq(params, prompt=[0])], []).token_ids == [1]


# ---- min_tokens --------------------------------------------------------------------------------

EOS, STOP = 2, 5


def _min_tokens_row():
    row = np.full(8, -2.0)
    row[EOS], row[STOP], row[6] = 4.0, 3.5, 1.0  # EOS most likely, then the stop id, then token 6
    return row


@pytest.mark.parametrize("generated", [0, 2])
def test_min_tokens_bans_eos_and_stop_ids_until_reached(generated):
    params = dict(min_tokens=3, stop_token_ids=[STOP], max_tokens=10)
    row = _min_tokens_row()
    out = [7] * generated
    greedy = sample_next(torch.tensor(row, dtype=torch.float32)[None],
                         [_seq(SamplingParams(temperature=0, **params), output=out)], [EOS]).token_ids
    assert greedy == [6]
    counts = _draw(row, SamplingParams(temperature=1.0, **params), 2000, eos=[EOS], output=out)
    assert counts[EOS] == 0 and counts[STOP] == 0
    # the rest keep their relative probabilities: the definition with EOS and STOP removed
    banned = row.copy()
    banned[[EOS, STOP]] = -np.inf
    q = filtered_distribution(banned, 1.0, 0, 1.0, 0.0)
    assert (np.abs(counts / 2000 - q) <= 5 * np.sqrt(q * (1 - q) / 2000) + 1 / 2000).all()


def test_min_tokens_lifts_the_ban_once_reached_and_ignore_eos_only_frees_eos():
    row = torch.tensor(_min_tokens_row(), dtype=torch.float32)[None]
    reached = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[STOP])
    assert sample_next(row.clone(), [_seq(reached, output=[7, 7, 7])], [EOS]).token_ids == [EOS]
    # ignore_eos: EOS is an ordinary token (allowed), the stop id is still banned before min_tokens
    ign = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[STOP], ignore_eos=True)
    assert sample_next(row.clone(), [_seq(ign, output=[7])], [EOS]).token_ids == [EOS]
    row2 = row.clone()
    row2[0, EOS] = -5.0
    assert sample_next(row2, [_seq(ign, output=[7])], [EOS]).token_ids == [6]
    # no min_tokens: nothing is banned
    free = SamplingParams(temperature=0, stop_token_ids=[STOP])
    assert sample_next(row.clone(), [_seq(free)], [EOS]).token_ids == [EOS]


def test_min_tokens_ban_is_per_row():
    row = torch.tensor(_min_tokens_row(), dtype=torch.float32).expand(3, 8).contiguous()
    seqs = [_seq(SamplingParams(temperature=0, min_tokens=2)), _seq(SamplingParams(temperature=0)),
            _seq(SamplingParams(temperature=0, min_tokens=2), output=[1, 1])]
    assert sample_next(row, seqs, [EOS]).token_ids == [STOP, EOS, EOS]


def test_frequencies_bound_is_meaningful():
    """The 5-sigma bound above rejects a sampler that ignores top-p (sanity of the check itself)."""
    row = np.log(np.array([30, 20, 12, 9, 7, 6, 5, 4, 3, 2, 1.5, 1.0], dtype=np.float64))
    q = filtered_distribution(row, 1.3, 0, 0.7, 0.0)
    wrong = filtered_distribution(row, 1.3, 0, 1.0, 0.0)
    bound = 5 * np.sqrt(q * (1 - q) / 4000) + 1 / 4000
    assert not (np.abs(wrong - q) <= bound).all()
    assert math.isclose(q.sum(), 1.0)


# ---- parameters and randomness ---------------------------------------------------------------


def test_params_normalise_the_forms_users_send():
    p = SamplingParams(stop="###", top_k=-1)
    assert p.stop == ["###"] and p.top_k == 0 and p.stop_token_ids == []
    p = SamplingParams(stop=("a", "b"), stop_token_ids=(3, 4), top_k=None)
    assert p.stop == ["a", "b"] and p.stop_token_ids == [3, 4] and p.top_k == 0
    assert SamplingParams(top_k=5).top_k == 5 and SamplingParams(top_k=0).top_k == 0
    # top_k -1 (vLLM's "off") samples like no top-k at all
    row = np.log(np.array([30, 20, 12, 9, 7, 6, 5, 4, 3, 2, 1.5, 1.0]))
    off = _draw(row, SamplingParams(temperature=1.0, top_k=-1), 500)
    assert (off == _draw(row, SamplingParams(temperature=1.0, top_k=0), 500)).all()


def test_step_seeds_differ_across_steps_and_requests():
    """Each (request seed, step) gets its own 32-bit seed: no two of 64 x 64 collide, and the
    same pair always gives the same seed."""
    from tokenfab.engine.runner.sampler import step_seed

    seeds = {step_seed(b, s) for b in range(64) for s in range(64)}
    assert len(seeds) == 64 * 64 and all(0 <= x < 2**32 for x in seeds)
    assert step_seed(12345, 7) == step_seed(12345, 7)


def test_one_request_over_many_steps_draws_from_the_distribution():
    """The draws of one request across its steps (not only across requests) follow the
    distribution: 3000 steps of one seed, frequencies within 5 sigma."""
    row = np.log(np.array([30, 20, 12, 9, 7, 6, 5, 4, 3, 2, 1.5, 1.0]))
    params = SamplingParams(temperature=1.0, top_k=8)
    n = 3000
    seq = _seq(params, seed=42)
    logits = torch.tensor(row, dtype=torch.float32)[None]
    drawn = []
    for _ in range(n):
        tok = sample_next(logits.clone(), [seq], []).token_ids[0]
        drawn.append(tok)
        seq.token_ids.append(tok)
    counts = np.bincount(drawn, minlength=len(row))
    q = filtered_distribution(row, 1.0, 8, 1.0, 0.0)
    assert set(np.nonzero(counts)[0].tolist()) == kept_tokens(row, 1.0, 8, 1.0, 0.0)
    assert (np.abs(counts / n - q) <= 5 * np.sqrt(q * (1 - q) / n) + 1 / n).all()


def test_sample_op_on_an_empty_batch():
    from tokenfab.kernels.sampling import sample_ref

    out = sample_ref(torch.empty(0, 10), torch.empty(0), torch.empty(0, dtype=torch.int64), torch.empty(0),
                     torch.empty(0), torch.empty(0, dtype=torch.int64))
    assert out.shape == (0,) and out.dtype == torch.int64


@pytest.mark.parametrize("field, ok, bad", [
    ("temperature", [0.0, 2.5], [-0.01]),
    ("top_p", [1e-6, 1.0], [0.0, 1.0001]),
    ("min_p", [0.0, 1.0], [-0.01, 1.01]),
    ("presence_penalty", [-2.0, 2.0], [-2.01, 2.01]),
    ("frequency_penalty", [-2.0, 2.0], [-2.01, 2.01]),
    ("repetition_penalty", [1e-3, 5.0], [0.0, -1.0]),
    ("logprobs", [0, 20], [-1, 21]),
    ("min_tokens", [0, 16], [-1, 17]),  # max_tokens is 16: min_tokens may equal it
])
def test_parameter_bounds_are_exact_and_errors_name_the_field(field, ok, bad):
    for v in ok:
        assert getattr(SamplingParams(**{field: v}), field) == v
    for v in bad:
        with pytest.raises(ValueError, match="min_tokens" if field == "min_tokens" else field):
            SamplingParams(**{field: v})


# ---- logit_bias, constraints, logprobs ---------------------------------------------------------


def test_logit_bias_is_added_to_the_logits_per_row():
    """OpenAI: the bias is added to the logits before sampling; -100 in effect bans a token and
    +100 forces it."""
    row = np.array([2.0, 1.5, 0.0, -1.0, 0.5])
    biases = [{1: 1.0}, {0: -100.0}, {3: 100.0}, {}, {0: -0.25, 4: 1.5}]
    logits = torch.tensor(row, dtype=torch.float32).expand(len(biases), 5).contiguous()
    seqs = [_seq(SamplingParams(temperature=0, logit_bias=b or None), seed=i) for i, b in enumerate(biases)]
    want = []
    for b in biases:
        biased = row.copy()
        for tok, val in b.items():
            biased[tok] += val
        want.append(int(biased.argmax()))
    assert sample_next(logits, seqs, []).token_ids == want == [1, 1, 3, 0, 4]
    banned = _draw(row, SamplingParams(temperature=1.0, logit_bias={0: -100.0, 1: -100.0}), 500)
    assert banned[0] == banned[1] == 0 and banned.sum() == 500


def test_min_tokens_of_one_bans_eos_for_the_first_token():
    row = torch.tensor(_min_tokens_row(), dtype=torch.float32)[None]
    assert sample_next(row.clone(), [_seq(SamplingParams(temperature=0, min_tokens=1))], [EOS]).token_ids == [STOP]
    assert sample_next(row.clone(), [_seq(SamplingParams(temperature=0, min_tokens=1), output=[4])],
                       [EOS]).token_ids == [EOS]


class _OnlyToken:
    """A grammar-like constraint that allows a single token."""

    def __init__(self, tok: int) -> None:
        self.tok = tok

    def mask_logits(self, logits) -> None:
        keep = logits[self.tok].clone()
        logits.fill_(float("-inf"))
        logits[self.tok] = keep

    def accept_token(self, token_id: int) -> None: ...

    def is_terminated(self) -> bool:
        return False


def test_a_constraint_masks_only_its_own_row():
    row = torch.tensor([[3.0, 1.0, 0.0, -2.0]]).expand(3, 4).contiguous()
    seqs = [_seq(SamplingParams(temperature=0, constraint=_OnlyToken(3))),
            _seq(SamplingParams(temperature=2.0, constraint=_OnlyToken(2)), seed=5),
            _seq(SamplingParams(temperature=0))]
    assert sample_next(row, seqs, []).token_ids == [3, 2, 0]


def test_logprobs_are_of_the_raw_logits_with_the_rank_of_the_chosen_token():
    """The chosen token's logprob and rank (1 + how many tokens are more likely) come from the raw
    distribution, also when a ban made the sampler pick a less likely token."""
    row = _min_tokens_row()
    lp = np.log(np.exp(row - row.max()) / np.exp(row - row.max()).sum())
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[STOP], logprobs=2)
    out = sample_next(torch.tensor(row, dtype=torch.float32)[None], [_seq(params)], [EOS])
    (chosen_lp, rank, top), = out.logprobs
    assert out.token_ids == [6] and rank == 3  # EOS and the stop id are more likely
    assert abs(chosen_lp - lp[6]) < 1e-5
    assert [t for t, _ in top] == [EOS, STOP] and all(abs(v - lp[t]) < 1e-5 for t, v in top)
    params = SamplingParams(temperature=0, logprobs=0)
    (chosen_lp, rank, top), = sample_next(torch.tensor(row, dtype=torch.float32)[None], [_seq(params)],
                                          [EOS]).logprobs
    assert rank == 1 and top == [] and abs(chosen_lp - lp[EOS]) < 1e-5


INT_FIELDS = ["n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]


@pytest.mark.parametrize("field", INT_FIELDS + FLOAT_FIELDS)
def test_wrong_types_and_non_finite_values_are_refused_by_name(field):
    bad = ["3", True, 1.5] if field in INT_FIELDS else ["0.5", True, None, float("nan"), float("inf")]
    if field == "top_k":
        bad = ["3", True, 1.5]  # None and negatives mean "off"
    for v in bad:
        with pytest.raises(ValueError, match=rf"^{field} must"):
            SamplingParams(**{field: v})
    if field == "seed":
        assert SamplingParams(seed=0).seed == 0
    if field in ("max_tokens", "prompt_logprobs", "logprobs"):
        assert getattr(SamplingParams(**{field: 0}), field) == 0


def test_list_fields_and_logit_bias_are_checked_item_by_item():
    for kwargs, msg in [(dict(stop=5), "^stop must"), (dict(stop=["a", ""]), "^stop must"),
                        (dict(stop=["a", 3]), "^stop must"), (dict(stop_token_ids=7), "^stop_token_ids must"),
                        (dict(stop_token_ids=[1, -1]), "^stop_token_ids must"),
                        (dict(stop_token_ids=[1, "2"]), "^stop_token_ids must"),
                        (dict(logit_bias=[1, 2]), "^logit_bias must"),
                        (dict(logit_bias={"x": 1.0}), "^logit_bias keys"),
                        (dict(logit_bias={True: 1.0}), "^logit_bias keys"), (dict(logit_bias={-1: 1.0}), "^logit_bias"),
                        (dict(logit_bias={5: 100.5}), "^logit_bias values"),
                        (dict(logit_bias={5: "1"}), "^logit_bias")]:
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**kwargs)
    assert SamplingParams(logit_bias={" 12 ": -100, 3: 100.0}).logit_bias == {12: -100, 3: 100.0}
