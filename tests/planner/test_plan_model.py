"""tokenfab plan's model inventory: parameter counts equal transformers' models built on the meta device
from the same configs (exact), and per-token cache sizes from first principles."""

from __future__ import annotations

import json

import pytest
import torch

from tokenfab.planner.model_spec import build_spec, load_config

transformers = pytest.importorskip("transformers")

MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
           moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1)
DSA = dict(index_n_heads=2, index_head_dim=16, index_topk=4)
COMMON = dict(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, num_key_value_heads=2),
    "llama_bias": lambda: transformers.LlamaConfig(**COMMON, num_key_value_heads=2, attention_bias=True,
                                                   mlp_bias=True, tie_word_embeddings=True),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, num_key_value_heads=2),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=24),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, num_key_value_heads=2, head_dim=16,
                                                     moe_intermediate_size=32, num_experts=8, mlp_only_layers=[1]),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, num_key_value_heads=2, moe_intermediate_size=32,
                                                     num_experts=8, decoder_sparse_step=2,
                                                     shared_expert_intermediate_size=48),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_key_value_heads=2, num_local_experts=8),
    "gpt_oss": lambda: transformers.GptOssConfig(**{**COMMON, "intermediate_size": 32}, num_key_value_heads=2,
                                                 head_dim=16, num_local_experts=8, num_experts_per_tok=2),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**COMMON, **MLA, first_k_dense_replace=1, n_group=2,
                                                         topk_group=1),
    "deepseek_v3_no_qlora": lambda: transformers.DeepseekV3Config(**COMMON, **{**MLA, "q_lora_rank": None},
                                                                  first_k_dense_replace=2),
    "deepseek_v32": lambda: transformers.DeepseekV32Config(**COMMON, **MLA, **DSA, first_k_dense_replace=1),
    "glm_moe_dsa": lambda: transformers.GlmMoeDsaConfig(**COMMON, **MLA, **DSA,
                                                        indexer_types=["full", "shared", "full"],
                                                        mlp_layer_types=["dense", "sparse", "sparse"]),
}


def hf_param_count(config) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_param_count_equals_transformers(name, tmp_path):
    config = CONFIGS[name]()
    config.save_pretrained(tmp_path)  # a folder holding only config.json
    spec = build_spec(load_config(tmp_path))
    assert spec.num_params == hf_param_count(config)


def test_kimi_k25_counts_its_text_model(tmp_path):
    text = CONFIGS["deepseek_v3"]().to_dict()
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": text, "vision_config": {"hidden_size": 32}}))
    spec = build_spec(load_config(tmp_path))
    assert spec.num_params == hf_param_count(transformers.DeepseekV3Config(**text))
    assert spec.architecture == "KimiK25ForConditionalGeneration"
