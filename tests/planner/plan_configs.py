"""Published config.json contents (the keys tokenfab plan reads) of real models, for the plan tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LLAMA_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                tie_word_embeddings=False, torch_dtype="bfloat16", max_position_embeddings=131072)
LLAMA_70B = {**LLAMA_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64}
QWEN3_235B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=4096,
                  intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64,
                  num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
                  mlp_only_layers=[], vocab_size=151936, tie_word_embeddings=False, torch_dtype="bfloat16")
GPT_OSS_120B = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880,
                    intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8,
                    head_dim=64, num_local_experts=128, num_experts_per_tok=4, vocab_size=201088, sliding_window=128,
                    tie_word_embeddings=False, torch_dtype="bfloat16",
                    quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
DEEPSEEK_V3 = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168,
                   intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                   num_nextn_predict_layers=1,
                   num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
                   routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                   qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
                   norm_topk_prob=True, vocab_size=129280, tie_word_embeddings=False, torch_dtype="bfloat16",
                   max_position_embeddings=163840,
                   quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                        "weight_block_size": [128, 128]})
DEEPSEEK_V32 = {**DEEPSEEK_V3, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
                "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}
KIMI_K2 = {**DEEPSEEK_V3, "model_type": "kimi_k2", "num_attention_heads": 64, "n_routed_experts": 384,
           "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "vocab_size": 163840,
           "num_nextn_predict_layers": 0,
           "quantization_config": {
               "quant_method": "compressed-tensors", "format": "pack-quantized",
               "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                   "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}}},
               "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                          "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]}}


def write_config(folder: Path, config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder
