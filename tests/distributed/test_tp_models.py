"""Tensor parallelism inside the models, SPMD on gloo: every rank builds the same engine (identical
scheduler decisions) with its shard of the weights, and the greedy tokens equal the 1-process
engine's, with prefix caching (prompts sharing a prefix, admitted a step apart), chunked prefill
(a small token budget) and preemption (a small KV budget) reached and asserted.

Cases: tiny Llama / Qwen3 at TP 2 and 4 (Qwen3 at TP 4 > its 2 KV heads: KV heads replicated),
tiny DeepSeek-V3 (MLA heads sharded) at TP 2, a block-FP8 Qwen3 checkpoint at TP 2 (weights and
scales split on 128 boundaries), the bundled SmolLM2 GGUF (Q4_1/Q8_0 rows kept packed) at TP 3
(9 query / 3 KV heads). The collectives are counted (CommCounter) and compared with ``tokenfab
plan``'s TP figure. Slow tier: each case spawns 2-4 interpreters on a 2-core machine.
"""

from __future__ import annotations

import pytest

from tests.distributed.launch import run_ranks
from tests.tiny_models import run_batch, save_tiny_model, tiny_config
from tokenfab.distributed import parallel_state as ps

pytestmark = pytest.mark.slow

PROMPTS = [
    list(range(5, 45)),  # 40 tokens: chunked under a 16-token budget
    list(range(5, 37)) + [200, 201, 202, 203],  # shares 32 tokens (8 blocks of 4) with the first
    [7, 8, 9],
    list(range(100, 123)),
]
ARRIVALS = [0, 3, 1, 2]
MAX_TOKENS = 12
ENGINE = dict(block_size=4, num_kv_blocks=26, max_num_batched_tokens=16, max_num_seqs=4, seed=0)


def generate(model: str, engine_kwargs: dict, prompts=PROMPTS, arrivals=ARRIVALS,
             max_tokens: int = MAX_TOKENS) -> dict:
    """Greedy tokens of ``prompts`` through one LLMEngine, and what the run reached."""
    from tokenfab.engine.llm_engine import LLMEngine

    engine = LLMEngine(model=model, **engine_kwargs)
    counter = ps.CommCounter()
    ps.set_comm_counter(counter)
    try:
        tokens, _, batches = run_batch(engine, prompts, max_tokens, arrivals, logprobs=0)
    finally:
        ps.set_comm_counter(None)
    sampled = _seeded(engine, prompts[2:])
    num_tokens = sum(int(b.input_ids.numel()) for b in batches)
    split = sorted({type(m).__name__ for m in engine.model.modules() if getattr(m, "tp_split", None) is not None})
    from tokenfab.layers.mla import MLAAttention

    return {
        "split_layers": split,
        "mla_heads": sorted({m.num_heads for m in engine.model.modules() if isinstance(m, MLAAttention)}),
        "tokens": tokens,
        "sampled": sampled,
        "preemptions": engine.scheduler.num_preemptions_total,
        "prefix_hits": engine.block_manager.prefix_hits,
        "chunked": any(int((b.cu_seqlens_q[1:] - b.cu_seqlens_q[:-1]).max()) < n
                       for b in batches for n in [max(len(p) for p in prompts)]),
        "comm": counter.calls,
        "num_tokens": num_tokens,
        "num_steps": len(batches),
    }


def _seeded(engine, prompts: list[list[int]]) -> list[list[int]]:
    """Seeded sampled generations (temperature 0.9, top-p 0.95): the same seeds draw the same tokens
    on every rank, whose logits are the same all-gathered vector."""
    from tokenfab.engine.requests.sampling_params import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(f"seeded-{i}", list(p), SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i,
                                                                  max_tokens=8, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
    return [done[f"seeded-{i}"] for i in range(len(prompts))]


def _rank(rank: int, tp: int, model: str, engine_kwargs: dict) -> dict:
    ps.init_parallel(tp)
    return generate(model, engine_kwargs)


def check_tp(model: str, tp: int, engine_kwargs: dict = ENGINE, layers: set[str] = frozenset()) -> list[dict]:
    """The TP run's greedy tokens on every rank equal the 1-process engine's; ``layers``: layer
    classes that must be split on every rank (the quantized / packed ones the case is about)."""
    ref = generate(model, engine_kwargs)
    assert ref["preemptions"] > 0 and ref["prefix_hits"] > 0 and ref["chunked"], ref
    assert ref["split_layers"] == [] and ref["comm"] == []
    results = run_ranks(_rank, tp, tp, model, engine_kwargs)
    for rank, r in enumerate(results):
        assert r["tokens"] == ref["tokens"], f"rank {rank} of TP {tp}"
        assert r["sampled"] == results[0]["sampled"], f"rank {rank} sampled other tokens than rank 0"
        assert r["sampled"] == ref["sampled"], f"rank {rank} of TP {tp}: seeded samples"
        assert (r["preemptions"], r["prefix_hits"]) == (ref["preemptions"], ref["prefix_hits"])
        assert layers <= set(r["split_layers"]), r["split_layers"]
        assert r["comm"] == results[0]["comm"] and r["comm"]
    return results


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama")
    save_tiny_model(tiny_config("llama"), path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen3")
    save_tiny_model(tiny_config("qwen3"), path)
    return str(path)


@pytest.mark.parametrize("tp", [2, 4])
def test_llama(tiny_llama, tp):
    check_tp(tiny_llama, tp, layers={"Linear", "MergedLinear", "VocabEmbedding", "LMHead"})


@pytest.mark.parametrize("tp", [2, 4])
def test_qwen3(tiny_qwen3, tp):
    check_tp(tiny_qwen3, tp)  # TP 4 > 2 KV heads: ranks 0,1 hold KV head 0, ranks 2,3 head 1


def test_bundled_gguf_tp3():
    """SmolLM2-135M (the bundled Q4_1/Q8_0 GGUF, rows kept packed): 9 query / 3 KV heads over 3 ranks."""
    from tokenfab.loader.bundled import bundled_model_path

    check_tp(str(bundled_model_path()), 3, ENGINE, {"GGMLLinear", "GGMLEmbedding", "GGMLLMHead"})


def test_deepseek_v3_mla_tp2(tmp_path):
    """MLA heads sharded (q_b / kv_b column-parallel by head, o_proj row-parallel); the latent cache
    per token, replicated. The MoE layers' experts are split by the MoE layer itself (layers/moe.py)."""
    from tests.models.test_deepseek import YARN, save_tiny_deepseek

    save_tiny_deepseek(tmp_path, rope_parameters=YARN)
    results = check_tp(str(tmp_path), 2, layers={"Linear", "MergedLinear"})
    assert all(r["mla_heads"] == [2] for r in results)


def test_fp8_block_checkpoint_tp2(tmp_path):
    """A block-FP8 Qwen3 checkpoint (tests/quant/layouts_fp8.py) whose every split falls on 128-element
    blocks (q/k/v 256 rows, hidden and intermediate 256): weights and weight_scale_inv grids split."""
    from tests.quant.layouts_fp8 import write_fp8_block_checkpoint

    config = tiny_config("qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=256, intermediate_size=256,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=128)
    save_tiny_model(config, tmp_path / "src")
    write_fp8_block_checkpoint(tmp_path / "src", tmp_path / "fp8")
    check_tp(str(tmp_path / "fp8"), 2, layers={"FP8Linear", "VocabEmbedding", "LMHead"})


def test_comm_bytes_match_plan(tiny_qwen3):
    """One decode-only step at TP 2 sends (ring algorithms) exactly what ``tokenfab plan`` reports per
    token for TP 2 at that batch: the embedding's all-reduce, one after attention and one after the
    MLP per layer (float32 [batch, hidden]), and the LM head's all-gather of padded vocabulary rows."""
    from tokenfab.bench.comm import plan_bytes_per_token, ring_bytes, run_tp

    ranks = run_tp(2, tiny_qwen3, batch=4, prompt_len=9, steps=2)
    calls = ranks[0]["calls"]
    layers, hidden = 2, 64
    assert [k for k, _ in calls] == ["all_reduce"] * (1 + 2 * layers) + ["all_gather"]
    assert {b for k, b in calls if k == "all_reduce"} == {4 * hidden * 4}
    assert all(r["calls"] == calls for r in ranks)
    measured = ring_bytes(calls, 2) / 4
    assert measured == pytest.approx(plan_bytes_per_token(ranks[0]["config"], 2, 4), rel=1e-12)


def test_deepseek_v32_dsa_tp2(tmp_path):
    """DSA: the MLA heads split as in V3; the lightning indexer (its own heads) runs replicated on every
    rank, so each picks the same top-k keys (prompts longer than index_topk 6)."""
    from tests.models.test_deepseek_dsa import save_tiny_dsa

    save_tiny_dsa("deepseek_v32", tmp_path)
    results = check_tp(str(tmp_path), 2, layers={"Linear", "MergedLinear"})
    assert all(r["mla_heads"] == [2] for r in results)


def test_moe_comm_bytes_match_plan(tmp_path):
    """DeepSeek-V3 with TP-split experts and a shared expert: one all-reduce per MoE layer (the shared
    expert joins the routed experts' partial sum), so a decode step sends what ``tokenfab plan`` says."""
    from tests.models.test_deepseek import save_tiny_deepseek
    from tokenfab.bench.comm import plan_bytes_per_token, ring_bytes, run_tp

    save_tiny_deepseek(tmp_path)
    ranks = run_tp(2, str(tmp_path), batch=4, prompt_len=9, steps=2)
    calls = ranks[0]["calls"]
    layers = ranks[0]["config"]["num_hidden_layers"]
    assert [k for k, _ in calls] == ["all_reduce"] * (1 + 2 * layers) + ["all_gather"]
    measured = ring_bytes(calls, 2) / 4
    assert measured == pytest.approx(plan_bytes_per_token(ranks[0]["config"], 2, 4), rel=1e-12)
