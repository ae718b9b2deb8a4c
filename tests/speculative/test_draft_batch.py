"""Draft tokens of model-based proposers (tokenfab/speculative/draft_batch.py ``pick_drafts``).

Sampled requests: q must be the request's filtered distribution of the draft's logits (against the
plain definition in tests/engine/sampling_definition.py), the drafts must be draws from q
(chi-square over many seeds), and the whole sampled path, a draft drawn from q then the
rejection rule of ``accept_tokens`` with that q, must emit tokens distributed as the target's p.
Each chi-square test fails a correct implementation with probability ALPHA.
"""

from __future__ import annotations

import numpy as np
import torch

from tests.engine.sampling_definition import filtered_distribution
from tests.speculative.test_accept import ALPHA, T_LOGITS, _chi2_pvalue
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.sequence import Sequence
from tokenfab.speculative.accept import accept_tokens
from tokenfab.speculative.draft_batch import pick_drafts

D_LOGITS = np.array([1.0, 2.2, 0.4, 0.9, -0.3, 1.5, -1.0, 0.2, 1.9, -0.7])  # the draft disagrees with T_LOGITS
N = 4000


def _seqs(params: SamplingParams, n: int, out: int = 2) -> list[Sequence]:
    seqs = []
    for i in range(n):
        s = Sequence(f"r{i}", None, [1, 2, 3], params, base_seed=1000 + i)
        s.token_ids += [4] * out
        seqs.append(s)
    return seqs


def test_greedy_drafts_are_the_argmax_and_q_one_hot():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    seqs = _seqs(SamplingParams(temperature=0.0), 2)
    tokens, q = pick_drafts(logits, seqs, [0, 1], want_q=True)
    assert tokens.tolist() == [1, 0]  # first maximum on a tie, as the plain sampler
    assert torch.equal(q, torch.eye(4)[[1, 0]])
    assert pick_drafts(logits, seqs, [0, 1], want_q=False)[1] is None


def test_sampled_q_is_the_filtered_distribution_and_drafts_are_draws_from_it():
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05)
    seqs = _seqs(params, N)
    logits = torch.tensor(D_LOGITS, dtype=torch.float32).expand(N, -1).contiguous()
    tokens, q = pick_drafts(logits, seqs, [1] * N, want_q=True)
    want = filtered_distribution(D_LOGITS, 0.8, 6, 0.9, 0.05)
    np.testing.assert_allclose(q[0].double().numpy(), want, atol=1e-6)
    assert torch.equal(q, q[:1].expand_as(q))
    counts = np.bincount(tokens.numpy(), minlength=len(D_LOGITS))
    assert _chi2_pvalue(counts, want) > ALPHA
    # a request's draw depends on its seed and position only, not on the batch
    alone = pick_drafts(logits[5:6], seqs[5:6], [1], want_q=True)[0]
    assert alone.item() == tokens[5].item()


def test_draft_from_q_then_the_rule_emits_the_target_distribution():
    """The composed sampled path (one draft per request): P(first emitted token) = p."""
    n = N // 2
    params = SamplingParams(temperature=1.0, max_tokens=100)
    seqs = _seqs(params, n)
    dl = torch.tensor(D_LOGITS, dtype=torch.float32).expand(n, -1).contiguous()
    drafts, q = pick_drafts(dl, seqs, [0] * n, want_q=True)
    target = torch.tensor(T_LOGITS, dtype=torch.float32)[None].expand(2 * n, -1).contiguous()  # draft row + bonus
    out = accept_tokens(target, seqs, [[d] for d in drafts.tolist()], [], q)
    first = np.array([o[0] for o in out])
    p = filtered_distribution(T_LOGITS, 1.0, 0, 1.0, 0.0)
    assert _chi2_pvalue(np.bincount(first, minlength=len(T_LOGITS)), p) > ALPHA
    accepted = np.mean([len(o) == 2 for o in out])
    overlap = np.minimum(p, filtered_distribution(D_LOGITS, 1.0, 0, 1.0, 0.0)).sum()
    assert abs(accepted - overlap) < 5 * np.sqrt(overlap * (1 - overlap) / n)  # acceptance = sum min(p, q)
