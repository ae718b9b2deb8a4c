"""A failure that belongs to some requests fails only those: the batched forward and the batched
sampling are retried one sequence (one row) at a time when they raise, and the ones that fail
again are reported, not raised. A device error (``is_device_fatal``) or ``EngineDeadError`` still
raises: nothing can be served after it.

Retrying a forward alone is harmless: it rewrites the same K/V into the same slots. A model with
per-sequence recurrent state (the hybrid cache) is the exception: the failed forward may already have
advanced some layers' states, so applying the chunk again would count it twice. Such a sequence is
retried from position 0 instead (its whole context recomputed alone: a fresh state, the same K/V
rewritten), which gives the logits of an unfailed step. Retrying a
sampling row alone draws the same token: ``sample_next`` leaves the logits untouched and a row's
draws depend only on its seed and position (``runner/sampler.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tokenfab.engine.requests.errors import EngineDeadError, raise_if_fatal
from tokenfab.engine.requests.sequence import Sequence
from tokenfab.engine.runner.model_runner import ModelRunner
from tokenfab.engine.runner.sampler import sample_next
from tokenfab.forward_batch import ForwardBatch

log = logging.getLogger("tokenfab")

# (batch, its sequences, their new-token counts) -> (logits of the sampled rows, prompt rows' hidden states)
Execute = Callable[[ForwardBatch, list[Sequence], list[int]], tuple[torch.Tensor, torch.Tensor | None]]


def isolated_forward(
    runner: ModelRunner, execute: Execute, seqs: list[Sequence], counts: list[int], sample_mask: list[bool],
    prompt_rows: list[tuple[int, int]] | None, failed: dict[int, str],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Logits of the sampled rows and hidden states of the prompt rows, in batch order, of the
    sequences whose forward succeeded. If the batched forward fails, each sequence is run alone
    and the ones that fail again go to ``failed`` (batch index -> message)."""
    try:
        return execute(runner.prepare(seqs, counts, sample_mask, prompt_rows), seqs, counts)
    except EngineDeadError:
        raise
    except Exception as e:
        raise_if_fatal(e)
        log.warning("the forward of %d sequences failed (%r); running them one by one", len(seqs), e)
    logits: list[torch.Tensor] = []
    hidden: list[torch.Tensor] = []
    for i, (seq, n) in enumerate(zip(seqs, counts)):
        try:
            rows = None if prompt_rows is None else [prompt_rows[i]]
            lg, hd = _forward_alone(runner, execute, seq, n, sample_mask[i], rows)
        except EngineDeadError:
            raise
        except Exception as e:
            raise_if_fatal(e)
            failed[i] = f"the model's forward failed for this request: {e}"
            continue
        logits.append(lg)
        if hd is not None:
            hidden.append(hd)
    return (torch.cat(logits) if logits else None), (torch.cat(hidden) if hidden else None)


def _forward_alone(runner: ModelRunner, execute: Execute, seq: Sequence, n: int, sample: bool,
                   rows: list[tuple[int, int]] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One sequence's step alone; with recurrent state, from position 0 (see the module docstring)."""
    if not runner.state_caches:
        return execute(runner.prepare([seq], [n], [sample], rows), [seq], [n])
    start = seq.num_computed_tokens
    if rows is not None:  # prompt rows are offsets inside the chunk, which now begins at position 0
        rows = [(a + start, b + start) for a, b in rows]
    seq.num_computed_tokens = 0
    try:
        return execute(runner.prepare([seq], [start + n], [sample], rows), [seq], [start + n])
    finally:
        seq.num_computed_tokens = start


def isolated_sample(logits: torch.Tensor | None, seqs: list[Sequence], eos_token_ids: list[int]) -> list[tuple | str]:
    """Per row: (token, logprobs) or the error message of a row whose sampling failed (the batch is
    re-sampled row by row to find it)."""
    if not seqs:
        return []
    try:
        out = sample_next(logits, seqs, eos_token_ids)
        return list(zip(out.token_ids, out.logprobs))
    except EngineDeadError:
        raise
    except Exception as e:
        raise_if_fatal(e)
        log.warning("sampling %d rows failed (%r); sampling them one by one", len(seqs), e)
    results: list[tuple | str] = []
    for r, seq in enumerate(seqs):
        try:
            out = sample_next(logits[r : r + 1], [seq], eos_token_ids)
            results.append((out.token_ids[0], out.logprobs[0]))
        except Exception as e:
            raise_if_fatal(e)
            results.append(f"sampling failed for this request: {e}")
    return results
