"""Batched token sampling with per-row parameters and counter-based randomness.

Randomness comes from a 32-bit integer hash of (row seed, vocabulary index), so a row's
draw depends only on its own seed: same seed, same token, whatever else is in the batch,
on any device, in the reference and in the Triton kernel alike. The engine derives each
step's row seed from the request's seed and the number of tokens generated so far.

Sampling is the exponential race: token = argmax_i p_i / E_i with E_i = -log(u_i), which
draws from p without a cumulative sum. Filters, in order: temperature, top-k, top-p,
min-p. A temperature of 0 means greedy (argmax of the raw logits).
"""

from __future__ import annotations

import torch

from tokenfab.kernels._dispatch import use_triton

_M32 = 0xFFFFFFFF


def hash_uniform(seeds: torch.Tensor, n: int) -> torch.Tensor:
    """[B] int64 seeds -> [B, n] float32 uniforms in (0, 1), one per vocabulary index."""
    idx = torch.arange(n, device=seeds.device, dtype=torch.int64)
    x = ((seeds[:, None] & _M32) ^ ((idx[None, :] * 0x9E3779B9) & _M32)) & _M32
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & _M32
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & _M32
    x = x ^ (x >> 16)
    return ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))


def filter_probs_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Probabilities after temperature, top-k (<=0: off), top-p (1: off), min-p (0: off).

    Rows with temperature 0 are computed at temperature 1 (the caller takes argmax).
    """
    v = logits.shape[-1]
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    probs = torch.softmax(logits.float() / t[:, None].float(), dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v)).long()
    rank = torch.arange(v, device=logits.device)[None, :]
    keep = rank < k[:, None]
    # top-p: keep the smallest prefix whose mass reaches top_p (always the first token)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    keep &= mass_before < top_p[:, None].float()
    keep &= sorted_p >= (min_p[:, None].float() * sorted_p[:, :1])
    keep[:, 0] = True
    sorted_p = sorted_p * keep
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return out / out.sum(-1, keepdim=True)


def sample_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
) -> torch.Tensor:
    """logits [B, V]; per-row temperature/top_p/min_p float, top_k int, seeds int64 -> [B] int64."""
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    probs = filter_probs_ref(logits, temperature, top_k, top_p, min_p)
    u = hash_uniform(seeds, logits.shape[-1])
    race = probs / (-torch.log(u))
    sampled = race.argmax(-1)
    greedy = logits.argmax(-1)
    return torch.where(temperature > 0, sampled, greedy)


def _sample_triton(logits, temperature, top_k, top_p, min_p, seeds):
    raise NotImplementedError("Triton sample not written yet")


@torch.library.custom_op("tokenfab::sample", mutates_args=())
def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
) -> torch.Tensor:
    if use_triton(logits):
        return _sample_triton(logits, temperature, top_k, top_p, min_p, seeds)
    return sample_ref(logits, temperature, top_k, top_p, min_p, seeds)


@sample.register_fake
def _(logits, temperature, top_k, top_p, min_p, seeds):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)
