"""Multi-LoRA on MoE experts, Mixtral (tiny random, 2 layers, 8 experts, top-2, sliding window): the code that
serves Qwen3-MoE serves it too. PEFT's 3-D expert adapter (with attention) and a per-expert adapter in
transformers 4's Mixtral naming (``block_sparse_moe.experts.<e>.w1/w3/w2``, which PEFT itself converts on load),
mixed with the base in one batch: each request's greedy tokens equal transformers' with the adapter merged by PEFT."""

from __future__ import annotations

import pytest

from tests.lora.adapters import merged_greedy
from tests.lora.moe_adapters import EXPERT_PARAMS, make_moe_peft_adapter, per_expert_copy
from tests.moe_tiny_models import tiny_moe_config
from tests.tiny_models import save_tiny_model
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.lora_request import LoRARequest
from tokenfab.engine.requests.sampling_params import SamplingParams

pytest.importorskip("peft")

PROMPTS = [[5, 17, 33, 2, 90, 41, 7, 19, 4], [100, 3, 250, 19]]
N_NEW = 6


def test_mixtral_expert_adapters_mixed_equal_peft_merged(tmp_path):
    cfg = tiny_moe_config("mixtral")
    base = save_tiny_model(cfg, tmp_path / "base")
    e = make_moe_peft_adapter(base, tmp_path / "e", 8, 1, EXPERT_PARAMS, ["q_proj", "v_proj"])
    three_d = make_moe_peft_adapter(base, tmp_path / "p3", 4, 2, EXPERT_PARAMS)
    pe = per_expert_copy(three_d, tmp_path / "pe", cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size,
                         names=("w1", "w3", "w2"), block="block_sparse_moe", v4_config=True)
    refs = {name: merged_greedy(base, path, PROMPTS, N_NEW) for name, path in (("b", None), ("e", e), ("pe", pe))}
    assert refs["pe"] == merged_greedy(base, three_d, PROMPTS, N_NEW)  # PEFT reads the per-expert copy as the 3-D one
    assert refs["e"] != refs["b"] and refs["pe"] != refs["b"]

    engine = LLMEngine(model=str(tmp_path / "base"), device="cpu", dtype="float32", enable_lora=True, max_loras=2,
                       max_lora_rank=8, num_kv_blocks=64, block_size=4)
    loras = {"b": None, "e": LoRARequest("e", 1, str(e)), "pe": LoRARequest("pe", 2, str(pe))}
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    jobs = [(f"{n}{i}", p, n) for i, p in enumerate(PROMPTS) for n in loras]
    for rid, p, n in jobs:
        engine.add_request(rid, p, params, lora_request=loras[n])
    got = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = list(o.outputs[0].token_ids)
    for rid, p, n in jobs:
        assert got[rid] == refs[n][PROMPTS.index(p)], rid
