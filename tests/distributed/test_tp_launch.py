"""Tensor-parallel launch (executors/tp_executor.py + tp_worker.py): ``LLM(tensor_parallel_size=N)``
spawns N-1 worker processes (gloo on CPU) that mirror rank 0's forwards; rank 0 alone samples.
The tokens must be those of the one-process engine, with prefix caching, chunked prefill and
preemption reached. The fast test is the feature's one smoke test (tiny Llama, TP 2); the bundled
model (9 query / 3 KV heads: TP 3) runs in the slow tier."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import save_tiny_model, tiny_config
from tokenfab import LLM, SamplingParams
from tokenfab.distributed.parallel_state import get_parallel_state
from tokenfab.executors.tp_protocol import CMD_FORWARD, MODE_SCORING, batch_header, pack_batch, unpack_batch
from tokenfab.forward_batch import ForwardBatch

# engine settings that reach chunked prefill (8-token chunks), prefix-cache hits (shared prompt
# heads) and preemption (a cache too small for every sequence at once)
STRESS = dict(block_size=4, max_num_batched_tokens=8, num_kv_blocks=14, max_num_seqs=4, enable_prefix_caching=True)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    head = torch.randint(3, vocab, (9,), generator=g).tolist()
    tails = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 7, 12, 1, 5)]
    return [head + t for t in tails] + [tails[2]]


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list, dict]:
    """Greedy and seeded-sampled rows in one batch (rank 0 samples both)."""
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.9, top_p=0.95, seed=7 + i, max_tokens=max_tokens, ignore_eos=True)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    s = llm.engine.get_stats()
    reached = {"preemptions": s.num_preemptions_total, "prefix_hit_rate": s.prefix_cache_hit_rate}
    return [o.outputs[0].token_ids for o in outs], reached


def test_batch_wire_format_round_trip():
    b = ForwardBatch(
        input_ids=torch.tensor([5, 6, 7]), positions=torch.tensor([0, 1, 4]), slot_mapping=torch.tensor([8, 9, -1]),
        block_tables=torch.tensor([[2, 0], [3, 1]], dtype=torch.int32), cu_seqlens_q=torch.tensor([0, 2, 3],
                                                                                                   dtype=torch.int32),
        context_lens=torch.tensor([2, 5], dtype=torch.int32), logits_indices=torch.tensor([1, 2]),
        max_query_len=2, max_context_len=5, prompt_indices=torch.tensor([0]),
    )
    h = batch_header(MODE_SCORING, b) + [0] * 7
    assert h[:2] == [CMD_FORWARD, MODE_SCORING]
    back = unpack_batch(h, pack_batch(b))
    for f in ("input_ids", "positions", "slot_mapping", "block_tables", "cu_seqlens_q", "context_lens",
              "logits_indices", "prompt_indices"):
        assert torch.equal(getattr(back, f), getattr(b, f)), f
        assert getattr(back, f).dtype == getattr(b, f).dtype, f
    assert (back.max_query_len, back.max_context_len) == (2, 5)


def test_tp2_spawned_workers_same_tokens_as_one_process(tmp_path):
    save_tiny_model(tiny_config("llama"), tmp_path)  # 4 query / 2 KV heads: TP 2 divides both
    prompts = _prompts(320)
    one = LLM(str(tmp_path), **STRESS)
    expected, reached = _run(one, prompts, 8)
    del one
    assert reached["preemptions"] > 0 and reached["prefix_hit_rate"] > 0
    tp = LLM(str(tmp_path), tensor_parallel_size=2, **STRESS)
    try:
        assert get_parallel_state().tp_size == 2
        got, reached_tp = _run(tp, prompts, 8)
        assert tp.engine.tp.bytes_sent > 0  # the workers were fed
        assert tp.engine.tp.dead is None
    finally:
        tp.shutdown()
    assert get_parallel_state().tp_size == 1
    assert got == expected
    assert reached_tp == reached  # the same schedule: preemptions and prefix hits included


@pytest.mark.slow
def test_tp3_bundled_model_same_tokens_as_one_process():
    prompts = ["The capital of France is", "def fibonacci(n):", "List three colors:", "Once upon a time",
               "The capital of France is a city that"]
    args = dict(max_model_len=256, block_size=4, max_num_batched_tokens=16, num_kv_blocks=14, max_num_seqs=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.8, seed=3 + i, max_tokens=12, ignore_eos=True) for i in range(5)]
    one = LLM(**args)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, greedy) + one.generate(prompts, seeded)]
    s1 = one.engine.get_stats()
    del one
    tp = LLM(tensor_parallel_size=3, **args)
    try:
        got = [o.outputs[0].token_ids for o in tp.generate(prompts, greedy) + tp.generate(prompts, seeded)]
        s3 = tp.engine.get_stats()
    finally:
        tp.shutdown()
    assert s1.num_preemptions_total > 0 and s1.prefix_cache_hit_rate > 0
    assert (s3.num_preemptions_total, s3.prefix_cache_hit_rate) == (s1.num_preemptions_total,
                                                                    s1.prefix_cache_hit_rate)
    assert got == expected


def test_bad_tensor_parallel_size_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(tmp_path), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(str(tmp_path), data_parallel_size=2)
