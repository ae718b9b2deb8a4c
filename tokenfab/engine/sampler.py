"""From a step's logits to next tokens: penalties, constraints, then the batched sample op.

Everything is one tensor op over the batch rows; the only per-row Python is for rows that
carry a grammar constraint (which is per-request state by nature).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenfab.engine.sequence import Sequence
from tokenfab.kernels import argmax, sample

_M32 = 0xFFFFFFFF


def step_seed(base_seed: int, step: int) -> int:
    """A request's 32-bit seed for its ``step``-th generated token (deterministic)."""
    x = (base_seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 29)) & _M32


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: (logprob of the chosen token, rank of it, [(token, logprob), ...] top alternatives)
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]


def _pad_tokens(rows: list[list[int]], device: torch.device, pad: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64, device=device)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Presence/frequency penalties on generated tokens (OpenAI's definition) and the
    repetition penalty on prompt + generated tokens (divide positive logits, multiply
    negative ones, as in CTRL / transformers). In place; returns logits."""
    dev, v = logits.device, logits.shape[1]
    pres = [s.params.presence_penalty for s in seqs]
    freq = [s.params.frequency_penalty for s in seqs]
    rep = [s.params.repetition_penalty for s in seqs]
    if any(pres) or any(freq):
        out = _pad_tokens([s.output_token_ids for s in seqs], dev, v)
        counts = torch.zeros(len(seqs), v + 1, device=dev).scatter_add_(1, out, torch.ones_like(out, dtype=torch.float))
        counts = counts[:, :v]
        logits -= torch.tensor(freq, device=dev)[:, None] * counts
        logits -= torch.tensor(pres, device=dev)[:, None] * (counts > 0).float()
    if any(r != 1.0 for r in rep):
        toks = _pad_tokens([s.token_ids for s in seqs], dev, v)
        seen = torch.zeros(len(seqs), v + 1, dtype=torch.bool, device=dev).scatter_(1, toks, True)[:, :v]
        r = torch.tensor(rep, device=dev)[:, None]
        penalized = torch.where(logits > 0, logits / r, logits * r)
        logits = torch.where(seen, penalized, logits)
    return logits


def _min_tokens_mask(logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]) -> None:
    for i, s in enumerate(seqs):
        if s.num_output_tokens < s.params.min_tokens:
            banned = list(s.params.stop_token_ids or []) + ([] if s.params.ignore_eos else eos_ids)
            if banned:
                logits[i, banned] = float("-inf")


def sample_next(logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]) -> SamplerOutput:
    """Pick one token per row of ``logits`` [R, V] (R == len(seqs))."""
    dev = logits.device
    want_logprobs = any(s.params.logprobs is not None for s in seqs)
    raw = logits.clone() if want_logprobs else logits
    logits = apply_penalties(logits, seqs)
    _min_tokens_mask(logits, seqs, eos_ids)
    for i, s in enumerate(seqs):
        if s.params.constraint is not None:
            s.params.constraint.mask_logits(logits[i])
    if all(s.params.temperature == 0.0 for s in seqs):
        tokens = argmax(logits)
    else:
        p = [s.params for s in seqs]
        tokens = sample(
            logits,
            torch.tensor([x.temperature for x in p], dtype=torch.float32, device=dev),
            torch.tensor([x.top_k for x in p], dtype=torch.int64, device=dev),
            torch.tensor([x.top_p for x in p], dtype=torch.float32, device=dev),
            torch.tensor([x.min_p for x in p], dtype=torch.float32, device=dev),
            torch.tensor([step_seed(s.base_seed, s.num_output_tokens) for s in seqs], dtype=torch.int64, device=dev),
        )
    token_list = tokens.tolist()
    lp_out: list = [None] * len(seqs)
    if want_logprobs:
        lp = torch.log_softmax(raw.float(), dim=-1)
        k = max(s.params.logprobs or 0 for s in seqs)
        top_v, top_i = lp.topk(max(k, 1), dim=-1)
        chosen = lp.gather(1, tokens.view(-1, 1)).squeeze(1)
        ranks = (lp > chosen[:, None]).sum(-1) + 1
        top_v, top_i, chosen, ranks = top_v.tolist(), top_i.tolist(), chosen.tolist(), ranks.tolist()
        for i, s in enumerate(seqs):
            n = s.params.logprobs
            if n is not None:
                lp_out[i] = (chosen[i], ranks[i], list(zip(top_i[i][:n], top_v[i][:n])))
    return SamplerOutput(token_list, lp_out)
