"""Multi-LoRA on MoE experts beyond Qwen3-MoE, served by the same code: Mixtral (tiny random, 2 layers, 8 experts,
top-2, sliding window), Qwen2-MoE (a gated shared expert beside the routed ones) and DeepSeek-V3 (grouped routing,
a shared expert, MLA). PEFT's 3-D expert adapter (with attention) and a per-expert adapter in transformers 4's naming
(Mixtral: ``block_sparse_moe.experts.<e>.w1/w3/w2``; Qwen2-MoE: ``mlp.experts.<e>.gate_proj/up_proj/down_proj``),
mixed with the base in one batch: each request's greedy tokens equal transformers' with the adapter merged by PEFT
(PEFT converts the per-expert copy itself for Mixtral; for Qwen2-MoE it does not, and the 3-D source is the
reference). Qwen2-MoE's shared expert and dense MLPs, as PEFT targets them there."""

from __future__ import annotations

import pytest
from safetensors import safe_open

from tests.lora.adapters import merged_greedy, run_greedy
from tests.lora.moe_adapters import EXPERT_PARAMS, make_moe_peft_adapter, per_expert_copy
from tests.models.test_deepseek import save_tiny_deepseek
from tests.moe_tiny_models import tiny_moe_config
from tests.tiny_models import save_tiny_model
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.lora_request import LoRARequest

pytest.importorskip("peft")

PROMPTS = [[5, 17, 33, 2, 90, 41, 7, 19, 4], [100, 3, 250, 19]]
N_NEW = 6


# model type: (expert count, expert intermediate size, per-expert names, transformers 4's block name, whether PEFT
# converts such a per-expert adapter on load: PEFT 0.21 with transformers 5 does for Mixtral and Qwen3-MoE, not for
# Qwen2-MoE, where it drops the keys with a warning -- there the 3-D source adapter is the reference)
FAMILIES = {
    "mixtral": ("num_local_experts", "intermediate_size", ("w1", "w3", "w2"), "block_sparse_moe", True),
    "qwen2_moe": ("num_experts", "moe_intermediate_size", ("gate_proj", "up_proj", "down_proj"), None, False),
}


def _assert_mixed_batch_equals(engine: LLMEngine, loras: dict, refs: dict) -> None:
    """Every prompt under every adapter (name -> LoRARequest or None) in one run: each request's greedy tokens
    equal ``refs[name][prompt index]``."""
    jobs = [(p, n) for p in PROMPTS for n in loras]
    got = run_greedy(engine, [(p, loras[n]) for p, n in jobs], N_NEW)
    for (p, n), tokens in zip(jobs, got):
        assert tokens == refs[n][PROMPTS.index(p)], (n, PROMPTS.index(p))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_expert_adapters_mixed_equal_peft_merged(family, tmp_path):
    n_experts, inter, names, block, peft_converts = FAMILIES[family]
    cfg = tiny_moe_config(family)
    base = save_tiny_model(cfg, tmp_path / "base")
    e = make_moe_peft_adapter(base, tmp_path / "e", 8, 1, EXPERT_PARAMS, ["q_proj", "v_proj"])
    three_d = make_moe_peft_adapter(base, tmp_path / "p3", 4, 2, EXPERT_PARAMS)
    pe = per_expert_copy(three_d, tmp_path / "pe", getattr(cfg, n_experts), cfg.hidden_size, getattr(cfg, inter),
                         names=names, block=block, v4_config=True)
    refs = {name: merged_greedy(base, path, PROMPTS, N_NEW)
            for name, path in (("b", None), ("e", e), ("pe", pe if peft_converts else three_d))}
    if peft_converts:  # PEFT reads the per-expert copy as the 3-D one
        assert refs["pe"] == merged_greedy(base, three_d, PROMPTS, N_NEW)
    assert refs["e"] != refs["b"] and refs["pe"] != refs["b"]

    engine = LLMEngine(model=str(tmp_path / "base"), device="cpu", dtype="float32", enable_lora=True, max_loras=2,
                       max_lora_rank=8, num_kv_blocks=64, block_size=4)
    loras = {"b": None, "e": LoRARequest("e", 1, str(e)), "pe": LoRARequest("pe", 2, str(pe))}
    _assert_mixed_batch_equals(engine, loras, refs)


def test_qwen2_moe_shared_expert_and_dense_mlp_adapter_equals_peft_merged(tmp_path):
    """PEFT (transformers 5) on Qwen2-MoE with target_modules gate/up/down_proj targets the shared expert
    (``mlp.shared_expert.*``, ``shared_experts`` here) and the dense layers' MLPs; with the experts' own pairs
    beside them, mixed with the base."""
    cfg = tiny_moe_config("qwen2_moe")
    base = save_tiny_model(cfg, tmp_path / "base")
    s = make_moe_peft_adapter(base, tmp_path / "s", 4, 3, EXPERT_PARAMS,
                              ["gate_proj", "up_proj", "down_proj", "q_proj"])
    with safe_open(str(s / "adapter_model.safetensors"), "pt") as f:
        assert any(".mlp.shared_expert.gate_proj." in k for k in f.keys())  # noqa: SIM118
    want = {name: merged_greedy(base, path, PROMPTS, N_NEW) for name, path in (("b", None), ("s", s))}
    assert want["s"] != want["b"]
    engine = LLMEngine(model=str(tmp_path / "base"), device="cpu", dtype="float32", enable_lora=True, max_loras=1,
                       max_lora_rank=4, num_kv_blocks=64, block_size=4)
    _assert_mixed_batch_equals(engine, {n: None if n == "b" else LoRARequest("s", 1, str(s)) for n in want}, want)


def test_deepseek_v3_expert_adapter_equals_peft_merged(tmp_path):
    """DeepSeek-V3 (grouped top-k routing with a correction bias, a shared expert, MLA): PEFT's 3-D expert pairs
    with o_proj beside them, mixed with the base in one batch."""
    base = save_tiny_deepseek(tmp_path / "base")
    a = make_moe_peft_adapter(base, tmp_path / "a", 4, 1, EXPERT_PARAMS, ["o_proj"])
    want = {name: merged_greedy(base, path, PROMPTS, N_NEW) for name, path in (("b", None), ("a", a))}
    assert want["a"] != want["b"]
    engine = LLMEngine(model=str(tmp_path / "base"), device="cpu", dtype="float32", enable_lora=True, max_loras=1,
                       max_lora_rank=4, num_kv_blocks=64, block_size=4)
    assert sorted(engine.lora.targets["moe"]) == ["model.layers.1.mlp", "model.layers.2.mlp"]
    _assert_mixed_batch_equals(engine, {n: None if n == "b" else LoRARequest("a", 1, str(a)) for n in want}, want)
