"""The sampling promises written out plainly in numpy (float64), independent of tokenfab's code.

These are the definitions the tests hold the engine to (vLLM's semantics, OpenAI's and CTRL's
penalty formulas). They are deliberately naive: sort, cumulative sum, loops over a small vocab.
"""

from __future__ import annotations

import numpy as np


def softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def kept_tokens(logits, temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The tokens a sampler may draw: temperature, then top-k, then top-p on the renormalised
    top-k distribution (the smallest set of most likely tokens whose mass reaches top_p), then
    min-p relative to the largest probability. Assumes no two logits are equal."""
    p = softmax(np.asarray(logits, dtype=np.float64) / temperature)
    order = [int(i) for i in np.argsort(-p, kind="stable")]
    if 0 < top_k < len(order):
        order = order[:top_k]
    q = p[order] / p[order].sum()
    if top_p < 1.0:
        total, n = 0.0, 0
        while n < len(order) and total < top_p:  # add tokens until the mass reaches top_p
            total += q[n]
            n += 1
        order = order[:n]
    return {i for i in order if p[i] >= min_p * p.max()}


def boundary_margin(logits, temperature: float, top_k: int, top_p: float) -> float:
    """How far top_p is from every cumulative mass of the renormalised top-k distribution (a test
    case with a tiny margin would be decided by rounding, not by the definition)."""
    p = np.sort(softmax(np.asarray(logits, dtype=np.float64) / temperature))[::-1]
    if 0 < top_k < len(p):
        p = p[:top_k]
    cum = np.cumsum(p / p.sum())
    return float(np.abs(cum - top_p).min()) if top_p < 1.0 else 1.0


def filtered_distribution(logits, temperature, top_k, top_p, min_p) -> np.ndarray:
    """softmax(logits / T) restricted to kept_tokens and renormalised."""
    p = softmax(np.asarray(logits, dtype=np.float64) / temperature)
    mask = np.zeros_like(p)
    mask[list(kept_tokens(logits, temperature, top_k, top_p, min_p))] = 1.0
    return p * mask / (p * mask).sum()


def penalized_logits(logits, prompt: list[int], output: list[int], presence: float, frequency: float,
                     repetition: float) -> np.ndarray:
    """OpenAI: logit[j] -= count[j] * frequency + (count[j] > 0) * presence, counting generated
    tokens only. CTRL (as in transformers and vLLM): every token seen in prompt or output has its
    logit divided by the penalty if positive, multiplied by it otherwise."""
    out = np.array(logits, dtype=np.float64)
    for j in range(len(out)):
        c = output.count(j)
        out[j] -= c * frequency + (1.0 if c > 0 else 0.0) * presence
        if j in prompt or j in output:
            out[j] = out[j] / repetition if out[j] > 0 else out[j] * repetition
    return out
