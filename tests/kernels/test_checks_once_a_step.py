"""The engine's batches are inference tensors (no version counter): their paged-attention index
checks still run once a step, because a ``ForwardBatch``'s tensors are never changed in place while
it is the latest batch; inference tensors of no batch are checked every time."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_attention import _batch
from tokenfab.forward_batch import ForwardBatch
from tokenfab.kernels.cpu import attention as na
from tokenfab.kernels.cpu import checks


def _forward_batch(bt: torch.Tensor, cu: torch.Tensor, ctx: torch.Tensor) -> ForwardBatch:
    t = int(cu[-1])
    z = torch.zeros(t, dtype=torch.int64)
    return ForwardBatch(input_ids=z, positions=z, slot_mapping=z, block_tables=bt, cu_seqlens_q=cu,
                        context_lens=ctx, logits_indices=z, max_query_len=1, max_context_len=int(ctx.max()))


@pytest.mark.parametrize("decode", [True, False])
def test_inference_batch_checked_once_a_step(gen, decode, monkeypatch):
    q, kc, vc, bt, cu, ctx = _batch([1, 1, 1] if decode else [3, 1, 20], [5, 40, 17] if decode else [9, 40, 20],
                                    4, 2, 32, 16, torch.float32, gen, "cpu")
    calls = []
    real = checks.check_paged_indices
    monkeypatch.setattr(checks, "check_paged_indices", lambda *a: calls.append(1) or real(*a))

    def run(b: ForwardBatch) -> torch.Tensor:
        if decode:
            return na.paged_decode_attention_native(q, kc, vc, b.block_tables, b.context_lens, 0.2)
        return na.paged_attention_native(q, kc, vc, b.block_tables, b.cu_seqlens_q, b.context_lens, 0.2)

    with torch.inference_mode():
        batch = _forward_batch(bt.clone(), cu.clone(), ctx.clone())
        assert batch.block_tables.is_inference()
        first = run(batch)
        for _ in range(4):  # the other "layers" of the step
            assert torch.equal(run(batch), first)
        assert len(calls) == 1
        bad = bt.clone()
        bad[1, 2] = kc.shape[0]  # the next step's batch holds a block outside the cache
        with pytest.raises(ValueError, match="block id"):
            run(_forward_batch(bad, cu.clone(), ctx.clone()))
        _forward_batch(bt.clone(), cu.clone(), ctx.clone())  # a newer batch exists:
        n = len(calls)
        run(batch)  # the older batch's tensors are checked again
        assert len(calls) == n + 1
        loose_bt, loose_ctx = bt.clone(), ctx.clone()  # inference tensors of no batch: every time
        n = len(calls)
        run(_forward_batch(loose_bt.clone(), cu.clone(), loose_ctx.clone()))
        if decode:
            na.paged_decode_attention_native(q, kc, vc, loose_bt, loose_ctx, 0.2)
            na.paged_decode_attention_native(q, kc, vc, loose_bt, loose_ctx, 0.2)
        else:
            na.paged_attention_native(q, kc, vc, loose_bt, cu.clone(), loose_ctx, 0.2)
            na.paged_attention_native(q, kc, vc, loose_bt, cu.clone(), loose_ctx, 0.2)
        assert len(calls) == n + 3
