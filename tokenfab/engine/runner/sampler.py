"""From a step's logits to next tokens. The semantics are vLLM's, in this order:

1. ``logit_bias`` is added to the raw logits (one ``index_put_`` over the batch's (row, token, bias)
   triples);
2. penalties: first repetition on the prompt and generated tokens (divide positive logits,
   multiply negative ones; CTRL/transformers), then frequency and presence on the generated
   tokens (OpenAI's definition);
3. the grammar constraint masks its row;
4. ``min_tokens``: until a request has generated that many tokens, its EOS and ``stop_token_ids``
   are masked to -inf (stop strings are not checked before then either; see LLMEngine), except
   where that would leave a constrained row nothing to draw (its grammar is complete: it ends);
5. the filters and the draw (``kernels.sampling``): temperature, then top-k, then top-p on the
   renormalised top-k distribution, then min-p; temperature 0 is the argmax. ``top_k`` larger than
   the vocabulary is off.

Randomness: each request has a 63-bit base seed (its ``seed``, or one drawn from OS entropy when
unseeded) and every step's row seed is a hash of (base seed, tokens generated so far), so a draw
never depends on the rest of the batch. Returned logprobs are those of the raw logits (vLLM's
default "raw" mode). The input logits are never modified (the engine may re-sample a row alone
after a failure), and everything is one tensor op over the batch rows; the only per-row Python is
for rows that carry a grammar constraint (per-request state by nature).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenfab.engine.requests.sequence import Sequence
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


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Add each request's ``logit_bias`` to its row, in place; returns logits."""
    rows: list[int] = []
    toks: list[int] = []
    vals: list[float] = []
    for i, s in enumerate(seqs):
        bias = s.params.logit_bias
        if bias:
            rows += [i] * len(bias)
            toks += bias.keys()
            vals += bias.values()
    if rows:
        dev = logits.device
        idx = (torch.tensor(rows, device=dev), torch.tensor(toks, device=dev))
        logits.index_put_(idx, torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)
    return logits


def _known(tokens: list[int]) -> list[int]:
    """Without a trailing not-yet-read token (the overlap scheduler's negative placeholder)."""
    return tokens[:-1] if tokens and tokens[-1] < 0 else tokens


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], pending: torch.Tensor | None = None) -> torch.Tensor:
    """vLLM's order: first the repetition penalty on prompt + generated tokens (divide positive
    logits, multiply negative ones, as in CTRL / transformers), then the frequency and presence
    penalties on generated tokens (OpenAI's definition). In place; returns logits.

    ``pending`` [R] (overlap scheduling): per row, its latest generated token, still on the device
    (its place in ``token_ids`` holds a placeholder), or -1."""
    dev, v = logits.device, logits.shape[1]
    pres = [s.params.presence_penalty for s in seqs]
    freq = [s.params.frequency_penalty for s in seqs]
    rep = [s.params.repetition_penalty for s in seqs]
    # the pending token's column, or the padding column v
    extra = None if pending is None else torch.where(pending >= 0, pending, v).view(-1, 1)
    if any(r != 1.0 for r in rep):
        toks = _pad_tokens([_known(s.token_ids) for s in seqs], dev, v)
        seen = torch.zeros(len(seqs), v + 1, dtype=torch.bool, device=dev).scatter_(1, toks, True)
        if extra is not None:
            seen.scatter_(1, extra, True)
        seen = seen[:, :v]
        r = torch.tensor(rep, device=dev)[:, None]
        penalized = torch.where(logits > 0, logits / r, logits * r)
        logits.copy_(torch.where(seen, penalized, logits))
    if any(pres) or any(freq):
        out = _pad_tokens([_known(s.output_token_ids) for s in seqs], dev, v)
        counts = torch.zeros(len(seqs), v + 1, device=dev).scatter_add_(1, out, torch.ones_like(out, dtype=torch.float))
        if extra is not None:
            counts.scatter_add_(1, extra, torch.ones(len(seqs), 1, device=dev))
        counts = counts[:, :v]
        logits -= torch.tensor(freq, device=dev)[:, None] * counts
        logits -= torch.tensor(pres, device=dev)[:, None] * (counts > 0).float()
    return logits


def _min_tokens_mask(logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]) -> None:
    """EOS and stop_token_ids to -inf for rows that have not generated ``min_tokens`` yet."""
    rows: list[int] = []
    toks: list[int] = []
    for i, s in enumerate(seqs):
        if s.num_output_tokens < s.params.min_tokens:
            banned = list(s.params.stop_token_ids or []) + ([] if s.params.ignore_eos else eos_ids)
            rows += [i] * len(banned)
            toks += banned
    if rows:
        dev = logits.device
        logits[torch.tensor(rows, device=dev), torch.tensor(toks, device=dev)] = float("-inf")


def _grammar_over_min_tokens(logits: torch.Tensor, rows: list[int], unbanned: torch.Tensor) -> None:
    """A grammar whose document is complete allows only the tokens that end it (EOS), which
    ``min_tokens`` bans: such a row has nothing left to draw. The grammar wins there (vLLM's
    structured output cannot be extended either): the row gets its grammar-masked logits back, the
    request ends as its grammar terminates, and it never draws a token the grammar rejects."""
    idx = torch.tensor(rows, device=logits.device)
    empty = ~torch.isfinite(logits[idx]).any(dim=-1)
    if bool(empty.any()):
        logits[idx[empty]] = unbanned[empty]


def _needs_edit(s: Sequence) -> bool:
    return s.edits_logits or (s.params.min_tokens > 0 and s.num_output_tokens < s.params.min_tokens)


def sample_next(logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]) -> SamplerOutput:
    """Pick one token per row of ``logits`` [R, V] (R == len(seqs)); ``logits`` is left as it was."""
    tokens = sample_tokens(logits, seqs, eos_ids)
    lp = logprob_tensors(logits, tokens, seqs)
    return SamplerOutput(tokens.tolist(), logprob_rows(seqs, *(t.tolist() for t in lp)) if lp else [None] * len(seqs))


def logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]) -> tuple | None:
    """(chosen logprob [R], its rank [R], top values [R, k], top ids [R, k]) of the raw logits, on
    the device; None when no row asked for logprobs."""
    if all(s.params.logprobs is None for s in seqs):
        return None
    lp = torch.log_softmax(logits.float(), dim=-1)
    k = max(s.params.logprobs or 0 for s in seqs)
    top_v, top_i = lp.topk(max(k, 1), dim=-1)
    chosen = lp.gather(1, tokens.view(-1, 1)).squeeze(1)
    ranks = (lp > chosen[:, None]).sum(-1) + 1
    return chosen, ranks, top_v, top_i


def logprob_rows(seqs: list[Sequence], chosen: list, ranks: list, top_v: list, top_i: list) -> list:
    """``logprob_tensors`` read back (as lists) -> one (chosen, rank, [(token, logprob), ...]) per row
    that asked for logprobs, None for the others."""
    out: list = [None] * len(seqs)
    for i, s in enumerate(seqs):
        n = s.params.logprobs
        if n is not None:
            out[i] = (chosen[i], ranks[i], list(zip(top_i[i][:n], top_v[i][:n])))
    return out


def sample_tokens(
    logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int], pending: torch.Tensor | None = None,
) -> torch.Tensor:
    """The drawn token ids [R] int64, left on the logits' device (no host sync here, except for
    grammar-constrained rows: the overlap scheduler runs those synchronously anyway).
    ``pending``: see ``apply_penalties``."""
    dev = logits.device
    v = logits.shape[1]
    if any(_needs_edit(s) for s in seqs):
        logits = logits.clone()  # edits below are in place; the caller's tensor stays raw
        apply_logit_bias(logits, seqs)
        logits = apply_penalties(logits, seqs, pending)
        constrained = [i for i, s in enumerate(seqs) if s.params.constraint is not None]
        for i in constrained:
            seqs[i].params.constraint.mask_logits(logits[i])
        saved = logits[constrained] if constrained else None  # a copy (advanced indexing)
        _min_tokens_mask(logits, seqs, eos_ids)
        if constrained:
            _grammar_over_min_tokens(logits, constrained, saved)
    if all(s.params.temperature == 0.0 for s in seqs):
        tokens = argmax(logits)
    else:
        p = [s.params for s in seqs]
        tokens = sample(
            logits,
            torch.tensor([x.temperature for x in p], dtype=torch.float32, device=dev),
            torch.tensor([x.top_k if x.top_k < v else 0 for x in p], dtype=torch.int64, device=dev),
            torch.tensor([x.top_p for x in p], dtype=torch.float32, device=dev),
            torch.tensor([x.min_p for x in p], dtype=torch.float32, device=dev),
            torch.tensor([step_seed(s.base_seed, s.num_output_tokens) for s in seqs], dtype=torch.int64, device=dev),
        )
    return tokens
