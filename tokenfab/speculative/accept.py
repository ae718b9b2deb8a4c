"""The lossless acceptance rule of speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

The target model scored k_i + 1 positions of sequence i in one verify forward: the row before each
draft token and the row after the last one. From those rows this module decides, for the whole
batch at once, which draft tokens stand and which one token follows them:

- greedy (temperature 0): the longest prefix where draft == argmax(target row), then the target's
  argmax at the first mismatch (or the bonus row's argmax when all k were accepted). ``argmax`` is
  the plain sampler's (``kernels.argmax``), so ties break exactly as in a plain decode step.
- sampled: p = the plain sampler's filtered distribution for the row (temperature, top-k, top-p,
  min-p: ``kernels.sampling.filter_probs_ref``), q = the draft's distribution (a point mass on the
  draft token when the proposer is deterministic, n-gram/suffix). Draft token d is accepted when
  u <= p(d)/q(d); on the first rejection the token is drawn from norm(max(p - q, 0)); when all k are
  accepted the bonus token is drawn from p. Every emitted token is then distributed exactly as the
  target's own sampling would have drawn it: P(emit x) = min(p, q)(x) + (1 - sum min(p, q)) *
  (p - q)+(x) / sum (p - q)+ = p(x).

  Point-mass drafts (``draft_probs`` None) take the rule in its coupled form: row j's token is the
  plain sampler's own draw x_j (``kernels.sample``, stream 0 below), the draft is accepted iff
  x_j == d_j, and at the first mismatch x_j is emitted. That is the same rule in distribution
  (accepted with probability p(d) = min(1, p(d)/1); after a rejection x ~ p restricted to x != d,
  i.e. norm(max(p - q, 0)) for q = one-hot(d)), with the same acceptance rate, and it makes a seeded
  sampled request emit exactly the tokens it would emit without speculation (given verify logits
  equal to decode logits, as for greedy).

Randomness is counter-based, as in the plain sampler: the draws of output position n + j of a
request (n = tokens it has generated, j = verify row) come from ``step_seed(base_seed, n + j)``,
split into sub-streams, so they depend on the request's seed and position only, never on the batch
or on k. Each output position is decided exactly once (a step ends at its first rejection, and the
next step starts after it), so no uniform is ever used for two decisions:

- stream 0 (the plain sampler's own seed): the bonus token, and every row of point-mass drafts,
  drawn by ``kernels.sample`` itself, so with k = 0 this module emits exactly the token a plain
  decode step would;
- stream ``ACCEPT_STREAM``: the uniform u of the accept test (drafts with ``draft_probs``);
- stream ``RESIDUAL_STREAM``: the one uniform of the draw from max(p - q, 0) after a rejection
  (inverse CDF: the first token whose cumulative residual mass exceeds u times the total).
A draft model that samples its drafts must draw them independently of these, e.g. from
``substream_seed(step_seed(base_seed, n + j), DRAFT_STREAM)``.

Not handled here (the caller's opt-out): requests whose logits the sampler edits (logit_bias,
penalties, a grammar constraint, an unmet min_tokens) need a per-position edit of the verify rows;
``accept_tokens`` rejects them with a ValueError rather than accept under the wrong distribution.
The emitted list is cut after the first EOS (unless ignore_eos) or stop token id and at max_tokens,
as a plain decode would stop there; stop strings remain the caller's.
"""

from __future__ import annotations

import torch

from tokenfab.engine.requests.sequence import Sequence
from tokenfab.engine.runner.sampler import step_seed
from tokenfab.kernels import argmax, sample
from tokenfab.kernels.sampling import filter_probs_ref, hash_uniform

ACCEPT_STREAM = 1
RESIDUAL_STREAM = 2
DRAFT_STREAM = 3


def substream_seed(seed: int, stream: int) -> int:
    """An independent 32-bit seed derived from a position's seed (stream 0 is the seed itself)."""
    return seed if stream == 0 else step_seed(seed, 0x5EED0000 + stream)


def _edits_logits(s: Sequence) -> bool:
    return s.edits_logits or (s.params.min_tokens > 0 and s.num_output_tokens < s.params.min_tokens)


def _check(target_logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
           draft_probs: torch.Tensor | None) -> None:
    if len(drafts) != len(seqs):
        raise ValueError(f"drafts: one list per sequence expected ({len(seqs)}), got {len(drafts)}")
    n_rows = sum(len(d) + 1 for d in drafts)
    if target_logits.dim() != 2 or target_logits.shape[0] != n_rows:
        raise ValueError(f"target_logits must be [sum(k_i + 1) = {n_rows}, V], got {tuple(target_logits.shape)}")
    v = target_logits.shape[1]
    if draft_probs is not None and tuple(draft_probs.shape) != (n_rows - len(drafts), v):
        want = (n_rows - len(drafts), v)
        raise ValueError(f"draft_probs must be [sum(k_i), V] = {want}, got {tuple(draft_probs.shape)}")
    for s, d in zip(seqs, drafts):
        if _edits_logits(s):
            raise ValueError(f"request {s.request_id}: logit-editing sampling parameters (logit_bias, penalties, "
                             "grammar, min_tokens) are not speculated; decode it without drafts")
        if any(not 0 <= t < v for t in d):
            raise ValueError(f"request {s.request_id}: draft token ids must be in [0, {v})")


def _emitted_limit(s: Sequence, tokens: list[int], eos_ids: list[int]) -> list[int]:
    """Cut after the first token that ends the request, and at max_tokens."""
    ends = set(s.params.stop_token_ids or ()) | (set() if s.params.ignore_eos else set(eos_ids))
    for j, t in enumerate(tokens):
        if t in ends:
            tokens = tokens[: j + 1]
            break
    if s.params.max_tokens is not None:
        tokens = tokens[: max(s.params.max_tokens - s.num_output_tokens, 1)]
    return tokens


def _filters(params: list, v: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """(temperature, top_k, top_p, min_p) tensors as the plain sampler builds them."""
    return (
        torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
        torch.tensor([p.top_k if p.top_k < v else 0 for p in params], dtype=torch.int64, device=dev),
        torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
        torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev),
    )


def _target_probs(logits: torch.Tensor, params: list, v: int) -> torch.Tensor:
    """The plain sampler's filtered distribution per row (``filter_probs_ref``'s math). Rows with
    neither top-k nor top-p need no sort: softmax(logits / T), then min-p (keep p >= min_p * max p),
    renormalised, which is what ``filter_probs_ref`` computes for them."""
    def sorted_filters(x) -> bool:
        return 0 < x.top_k < v or x.top_p < 1.0

    slow = [i for i, x in enumerate(params) if sorted_filters(x)]
    fast = [i for i, x in enumerate(params) if not sorted_filters(x)]
    dev = logits.device
    if not fast:
        return filter_probs_ref(logits, *_filters(params, v, dev))
    t, _, _, min_p = _filters([params[i] for i in fast], v, dev)
    f = torch.tensor(fast, device=dev)
    probs = torch.softmax(logits[f].float() / t[:, None], dim=-1)
    probs = probs * (probs >= min_p.clamp(0.0, 1.0)[:, None] * probs.amax(-1, keepdim=True))
    probs = probs / probs.sum(-1, keepdim=True)
    if not slow:
        return probs
    out = torch.empty(logits.shape, dtype=torch.float32, device=dev)
    out[f] = probs
    sl = torch.tensor(slow, device=dev)
    out[sl] = filter_probs_ref(logits[sl], *_filters([params[i] for i in slow], v, dev))
    return out


def _seeds(seeds: list[int], rows: list[int], stream: int, dev: torch.device) -> torch.Tensor:
    return torch.tensor([substream_seed(seeds[i], stream) for i in rows], dtype=torch.int64, device=dev)


def accept_tokens(
    target_logits: torch.Tensor,
    seqs: list[Sequence],
    drafts: list[list[int]],
    eos_ids: list[int],
    draft_probs: torch.Tensor | None = None,
) -> list[list[int]]:
    """Per sequence: its accepted draft prefix plus one target token (1 .. k_i + 1 tokens).

    ``target_logits`` [sum_i (k_i + 1), V]: sequence i's k_i + 1 verify rows, in order, sequences
    in order. ``draft_probs`` [sum_i k_i, V]: the distribution each draft token was drawn from
    (after the draft's own filters), row for row; None means point masses (deterministic drafts).
    The input tensors are not modified; one host read at the end.
    """
    _check(target_logits, seqs, drafts, draft_probs)
    dev = target_logits.device
    r, v = target_logits.shape
    if r == 0:
        return []
    ks = [len(d) for d in drafts]
    # per row: sequence index, position j within the sequence, the draft token it verifies (-1: bonus row)
    seq_of = torch.repeat_interleave(torch.arange(len(seqs), device=dev), torch.tensor(ks, device=dev) + 1)
    flat_draft = [t for d in drafts for t in d + [-1]]
    draft_t = torch.tensor(flat_draft, dtype=torch.int64, device=dev)
    is_bonus = draft_t < 0
    pos = [j for k in ks for j in range(k + 1)]
    seeds = [step_seed(s.base_seed, s.num_output_tokens + j) for s, k in zip(seqs, ks) for j in range(k + 1)]
    temps = [s.params.temperature for s, k in zip(seqs, ks) for _ in range(k + 1)]
    greedy_row = torch.tensor([t == 0.0 for t in temps], device=dev)

    accept = torch.zeros(r, dtype=torch.bool, device=dev)
    token = torch.zeros(r, dtype=torch.int64, device=dev)
    if any(t == 0.0 for t in temps):
        best = argmax(target_logits).to(torch.int64)
        accept = torch.where(greedy_row, draft_t == best, accept)
        token = torch.where(greedy_row, best, token)

    params = [s.params for s, k in zip(seqs, ks) for _ in range(k + 1)]
    sampled = [i for i, t in enumerate(temps) if t != 0.0]
    # rows drawn by the plain sampler itself: bonus rows, and every row when the drafts are point masses
    plain_rows = sampled if draft_probs is None else [i for i in sampled if flat_draft[i] < 0]
    sampled_draft = [] if draft_probs is None else [i for i in sampled if flat_draft[i] >= 0]
    if plain_rows:
        idx = torch.tensor(plain_rows, device=dev)
        f = _filters([params[i] for i in plain_rows], v, dev)
        seed_t = torch.tensor([seeds[i] for i in plain_rows], dtype=torch.int64, device=dev)
        drawn = sample(target_logits[idx], *f, seed_t).to(torch.int64)
        token[idx] = drawn
        accept[idx] = drawn == draft_t[idx]  # bonus rows (draft -1) never
    if sampled_draft:
        # draft rows with the draft's q: the accept test and the residual draw, all rows at once
        idx = torch.tensor(sampled_draft, device=dev)
        p = _target_probs(target_logits[idx], [params[i] for i in sampled_draft], v)
        d = draft_t[idx]
        # draft_probs has no bonus rows: row i of target_logits is draft row i - (its sequence index)
        q = draft_probs[idx - seq_of[idx]].to(device=dev, dtype=p.dtype)
        p_d = p.gather(1, d[:, None]).squeeze(1)
        q_d = q.gather(1, d[:, None]).squeeze(1)
        u = hash_uniform(_seeds(seeds, sampled_draft, ACCEPT_STREAM, dev), 1).squeeze(1)
        accept[idx] = u * q_d <= p_d  # u <= p/q without dividing (q_d = 0 accepts, as p/q = inf)
        residual = (p - q).clamp(min=0.0)
        # p == q up to rounding leaves no mass; a rejection then has probability ~0: fall back to p
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
        # inverse CDF with one uniform: the first token whose cumulative mass exceeds u' * total
        # (a zero-mass token never is); one pass over V instead of V hashed uniforms
        cdf = residual.cumsum(-1)
        u2 = hash_uniform(_seeds(seeds, sampled_draft, RESIDUAL_STREAM, dev), 1)
        token[idx] = torch.searchsorted(cdf, u2 * cdf[:, -1:], right=True).squeeze(1).clamp(max=v - 1)

    # per sequence: m = the first row that is not accepted (the bonus row never is)
    pos_t = torch.tensor(pos, dtype=torch.int64, device=dev)
    first_stop = torch.where(accept & ~is_bonus, torch.full_like(pos_t, r), pos_t)
    m = torch.full((len(seqs),), r, dtype=torch.int64, device=dev).scatter_reduce_(0, seq_of, first_stop, "amin")
    lens = torch.tensor(ks, dtype=torch.int64, device=dev) + 1
    starts = lens.cumsum(0) - lens
    last = token[starts + m]
    m_host, last_host = torch.stack([m, last]).tolist()  # the one host read
    out = []
    for s, d, mi, t in zip(seqs, drafts, m_host, last_host):
        out.append(_emitted_limit(s, d[:mi] + [t], eos_ids))
    return out
