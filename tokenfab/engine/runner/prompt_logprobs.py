"""Prompt logprobs (vLLM's ``prompt_logprobs``) from the positions a prefill computes anyway.

The logits at position q score the prompt token at q + 1. The model runner keeps the hidden
states of the chunk rows that score prompt tokens not scored yet (``ForwardBatch.prompt_indices``),
and the LM head runs on them here, in pieces, so a long prompt's [P, V] logits never exist at
once. Chunked prefill appends chunk by chunk; a recomputation after preemption scores nothing
twice. A prefix-cache hit has no logits, so such requests do not take cached blocks (kv_cache).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenfab.engine.requests.outputs import Logprob
from tokenfab.engine.requests.sequence import Sequence


def prompt_rows_of(seq: Sequence, start: int, n: int) -> tuple[int, int]:
    """The offsets [a, b) inside the chunk of ``n`` tokens from position ``start`` whose logits
    score prompt tokens ``seq`` has not scored yet; (0, 0) when none."""
    if seq.prompt_logprobs is None:
        return (0, 0)
    first = max(start, len(seq.prompt_logprobs) - 1)
    end = min(start + n, seq.num_prompt_tokens - 1)
    return (first - start, end - start) if end > first else (0, 0)


@torch.inference_mode()
def score_prompt(
    model: nn.Module, seq: Sequence, first_pos: int, hidden: torch.Tensor,
    decode_one: Callable[[int], str], piece: int = 256,
) -> None:
    """Append to ``seq.prompt_logprobs`` the logprobs of prompt tokens first_pos+1 ..
    first_pos+len(hidden) and their top-k, from the hidden states at positions first_pos..:
    the LM head in pieces of ``piece`` rows, log-softmax in float32."""
    k = seq.params.prompt_logprobs or 0
    targets = seq.token_ids[first_pos + 1 : first_pos + 1 + hidden.shape[0]]
    target_t = torch.tensor(targets, dtype=torch.int64, device=hidden.device)
    for lo in range(0, hidden.shape[0], piece):
        lp = torch.log_softmax(model.compute_logits(hidden[lo : lo + piece]).float(), dim=-1)
        chosen = lp.gather(1, target_t[lo : lo + piece, None]).squeeze(1)
        ranks = ((lp > chosen[:, None]).sum(-1) + 1).tolist()
        chosen_l = chosen.tolist()
        top_v, top_i = (x.tolist() for x in lp.topk(k, dim=-1))
        for j, tok in enumerate(targets[lo : lo + piece]):
            entry = {alt: Logprob(v, r + 1, decode_one(alt)) for r, (alt, v) in enumerate(zip(top_i[j], top_v[j]))}
            entry.setdefault(tok, Logprob(chosen_l[j], ranks[j], decode_one(tok)))
            seq.prompt_logprobs.append(entry)
