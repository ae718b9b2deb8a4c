"""tokenfab plan: real configs (meta-device parameter counts, KV bytes per token from first principles,
quantized weight bytes from the module tree), layouts that do not fit, roofline figures recomputed by
hand for simple cases, communication volumes, and the CLI (a folder holding only config.json, bad input)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.planner.plan_configs import (
    DEEPSEEK_V3,
    DEEPSEEK_V32,
    GPT_OSS_120B,
    KIMI_K2,
    LLAMA_8B,
    LLAMA_70B,
    QWEN3_235B,
    write_config,
)
from tokenfab.cli import main
from tokenfab.planner.hardware import PlanInputError, get_gpu, parse_interconnect
from tokenfab.planner.model_spec import build_spec, load_config
from tokenfab.planner.plan import PlanRequest, expected_remote_ranks, plan_model
from tokenfab.planner.quant_bytes import parse_quantization

transformers = pytest.importorskip("transformers")


def request(gpus: int, gpu: str = "h200", **kw) -> PlanRequest:
    g = get_gpu(gpu)
    return PlanRequest(gpus=gpus, gpu=g, interconnect=parse_interconnect(kw.pop("interconnect", None), g), **kw)


def spec_of(config: dict, tmp_path, name: str = "m"):
    return build_spec(load_config(write_config(tmp_path / name, config)))


def meta_model(config: dict):
    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    cls = {"deepseek_v3": transformers.DeepseekV3Config, "gpt_oss": transformers.GptOssConfig,
           "qwen3_moe": transformers.Qwen3MoeConfig, "llama": transformers.LlamaConfig}[cfg["model_type"]]
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cls(**cfg))


# ------------------------------------------------------------------ parameters and cache, real shapes

@pytest.mark.parametrize("config", [DEEPSEEK_V3, GPT_OSS_120B, LLAMA_70B], ids=["deepseek_v3", "gpt_oss", "llama70b"])
def test_real_config_param_count_equals_transformers_meta(config, tmp_path):
    hf = sum(p.numel() for p in meta_model(config).parameters())
    assert spec_of(config, tmp_path).num_params == hf


def test_published_totals(tmp_path):
    assert round(spec_of(DEEPSEEK_V3, tmp_path, "a").num_params / 1e9) == 671
    assert round(spec_of(DEEPSEEK_V3, tmp_path, "a").active_params / 1e9, 0) == 37  # "37B activated"
    assert round(spec_of(QWEN3_235B, tmp_path, "b").num_params / 1e9) == 235
    assert round(spec_of(QWEN3_235B, tmp_path, "b").active_params / 1e9) == 22
    assert round(spec_of(GPT_OSS_120B, tmp_path, "c").num_params / 1e9) == 117


@pytest.mark.parametrize("config,values", [
    (LLAMA_70B, 2 * 8 * 128 * 80),            # K and V, 8 KV heads of 128, 80 layers
    (QWEN3_235B, 2 * 4 * 128 * 94),
    (GPT_OSS_120B, 2 * 8 * 64 * 36),          # tokenfab keeps the full context on sliding layers too
    (DEEPSEEK_V3, (512 + 64) * 61),           # MLA: latent 512 + rope key 64 = 576 values a layer
    (KIMI_K2, (512 + 64) * 61),
    (DEEPSEEK_V32, (512 + 64 + 128) * 61),    # DSA adds the indexer key (128) on every layer
], ids=["llama70b", "qwen3_235b", "gpt_oss", "deepseek_v3", "kimi_k2", "deepseek_v32"])
def test_kv_bytes_per_token(config, values, tmp_path):
    spec = spec_of(config, tmp_path)
    plan = plan_model(spec, request(8, context=1024))
    assert plan.model["kv_bytes_per_token"] == values * 2
    fp8 = plan_model(spec, request(8, context=1024, kv_cache_dtype="fp8_e4m3"))
    assert fp8.model["kv_bytes_per_token"] == values


def test_kv_per_rank_replication(tmp_path):
    llama = spec_of(LLAMA_70B, tmp_path, "l")
    per_rank = {p.tp: p.kv_bytes_per_token for p in plan_model(llama, request(16, context=1024)).layouts}
    assert set(per_rank) == {16}  # on two nodes only TP spans them (DP replicas stay on one node)
    per_rank.update({p.tp: p.kv_bytes_per_token for p in plan_model(llama, request(8, context=1024)).layouts})
    assert per_rank[4] == 2 * 2 * 128 * 80 * 2   # 8 KV heads over 4 ranks
    assert per_rank[16] == 2 * 1 * 128 * 80 * 2  # 16 > 8 KV heads: one (replicated) head per rank
    mla = plan_model(spec_of(DEEPSEEK_V3, tmp_path, "d"), request(16, context=1024))
    assert {p.kv_bytes_per_token for p in mla.layouts} == {576 * 61 * 2}  # the latent is not sharded


# ------------------------------------------------------------------ quantized weight bytes

def _hf_bytes(config: dict, quantized, matrix_bytes, dtype_bytes: int = 2) -> float:
    """Bytes of the transformers module tree: a quantized nn.Linear weight or stacked expert tensor
    in the format (experts split into their per-expert matrices), everything else in the dtype."""
    total = 0.0
    for mname, mod in meta_model(config).named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if isinstance(mod, torch.nn.Linear) and pname == "weight" and quantized(mname):
                total += matrix_bytes(*p.shape)
            elif p.dim() == 3 and quantized(f"{mname}.{pname}"):
                e, a, b = p.shape
                if pname == "gate_up_proj" and config["model_type"] != "gpt_oss":  # [E, 2I, H]: gate and up
                    total += 2 * e * matrix_bytes(a // 2, b)
                elif config["model_type"] == "gpt_oss":  # stored transposed: [E, K, N]
                    total += e * matrix_bytes(b, a)
                else:
                    total += e * matrix_bytes(a, b)
            else:
                total += p.numel() * dtype_bytes
    return total


SMALL_MLA = {**DEEPSEEK_V3, "hidden_size": 256, "intermediate_size": 320, "moe_intermediate_size": 96,
             "num_hidden_layers": 3, "num_attention_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
             "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 96, "kv_lora_rank": 64,
             "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32, "vocab_size": 512,
             "num_nextn_predict_layers": 0}


def _weight_bytes(config: dict, tmp_path) -> float:
    return plan_model(spec_of(config, tmp_path), request(1, context=16)).model["weight_gib"] * 2**30


def test_fp8_block_bytes_match_module_tree(tmp_path):
    config = {**SMALL_MLA, "quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}

    def fp8(rows, cols):  # kv_a_proj_with_mqa has 80 rows: an edge block of 16 rows counts whole
        return rows * cols + math.ceil(rows / 64) * math.ceil(cols / 64) * 4

    expected = _hf_bytes(config, lambda n: ".layers." in n, fp8)
    assert _weight_bytes(config, tmp_path) == pytest.approx(expected, rel=1e-12)


def test_int4_compressed_tensors_kimi_layout_bytes(tmp_path):
    config = {**SMALL_MLA, "quantization_config": KIMI_K2["quantization_config"]}

    def int4(rows, cols):
        return rows * cols / 2 + rows * math.ceil(cols / 32) * 2 + 8  # nibbles, bf16 scale per 32, weight_shape

    expected = _hf_bytes(config, lambda n: ".experts" in n and "shared" not in n, int4)  # only the routed experts
    assert _weight_bytes(config, tmp_path) == pytest.approx(expected, rel=1e-12)
    bf16 = _weight_bytes({**SMALL_MLA, "quantization_config": None}, tmp_path / "b")
    assert _weight_bytes(config, tmp_path / "c") < bf16


def test_mxfp4_gpt_oss_bytes(tmp_path):
    config = {**GPT_OSS_120B, "hidden_size": 128, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_local_experts": 4,
              "num_experts_per_tok": 2, "vocab_size": 256}
    expected = _hf_bytes(config, lambda n: n.endswith(("gate_up_proj", "down_proj")),
                         lambda rows, cols: rows * cols / 2 + rows * cols / 32)
    assert _weight_bytes(config, tmp_path) == pytest.approx(expected, rel=1e-12)


def test_nvfp4_from_hf_quant_config(tmp_path):
    folder = write_config(tmp_path / "m", {**LLAMA_8B, "num_hidden_layers": 2})
    (folder / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}))
    spec = build_spec(load_config(folder))
    scheme = parse_quantization(spec.quantization_config)
    assert scheme.method == "nvfp4"
    assert scheme.bytes_per_matrix(4096, 4096) == 4096 * 4096 / 2 + 4096 * 4096 / 16 + 8


def test_unsupported_quantization_is_a_clear_error(tmp_path):
    spec = spec_of({**LLAMA_8B, "quantization_config": {"quant_method": "awq-ish"}}, tmp_path)
    with pytest.raises(PlanInputError, match="quant_method 'awq-ish' is not supported"):
        plan_model(spec, request(1))


# ------------------------------------------------------------------ layouts, memory, roofline

def test_layout_that_does_not_fit_is_excluded(tmp_path):
    plan = plan_model(spec_of(DEEPSEEK_V3, tmp_path), request(16, context=8192))
    excluded = {p.layout: p.reason for p in plan.excluded}
    assert "span more than one node of 8" in excluded["TP1 DP16"]  # DP replicas start on one node
    one_node = {p.layout: p.reason for p in plan_model(spec_of(DEEPSEEK_V3, tmp_path, "c"), request(8)).excluded}
    assert "exceed" in one_node["TP1 DP8"]  # 627 GiB of FP8 weights on one GPU
    assert all(p.fits and p.max_concurrent_seqs >= 1 for p in plan.layouts)
    assert "TP16 EP16" in {p.layout for p in plan.layouts}
    assert "quantized experts split by tensor parallelism" in excluded["TP16"]  # FP8 experts: EP or nothing
    decode = [p.decode_tokens_per_s for p in plan.layouts]
    assert decode == sorted(decode, reverse=True)  # best first
    bf16_on_8 = plan_model(spec_of({**DEEPSEEK_V3, "quantization_config": None}, tmp_path, "b"), request(8))
    assert bf16_on_8.layouts == [] and bf16_on_8.excluded  # 1.3 TB of bf16 weights on 8 x 141 GB


def test_kv_boundary_one_sequence(tmp_path):
    spec = spec_of(LLAMA_8B, tmp_path)
    base = plan_model(spec, request(1, "h100", context=4096)).layouts[0]
    fixed = (base.weights_gib + base.activation_gib) * 2**30
    per_seq = base.kv_bytes_per_token * 4096
    gpu_bytes = get_gpu("h100").memory_bytes
    just_one = plan_model(spec, request(1, "h100", context=4096, gpu_memory_utilization=(fixed + 1.5 * per_seq)
                                        / gpu_bytes))
    assert [p.max_concurrent_seqs for p in just_one.layouts] == [1]
    none = plan_model(spec, request(1, "h100", context=4096, gpu_memory_utilization=(fixed + 0.5 * per_seq)
                                    / gpu_bytes))
    assert none.layouts == [] and "cannot hold one 4096-token sequence" in none.excluded[0].reason


def test_heads_not_divisible_excluded(tmp_path):
    plan = plan_model(spec_of(LLAMA_8B, tmp_path), request(6, "h100"))
    reasons = {p.layout: p.reason for p in plan.excluded}
    assert "do not divide by TP 3" in reasons["TP3 DP2"] and "TP6" in reasons


def test_tp_weights_per_rank(tmp_path):
    spec = spec_of(LLAMA_8B, tmp_path)
    norms = (2 * 32 + 1) * 4096 * 2  # replicated on every rank
    total = spec.num_params * 2
    tp2 = next(p for p in plan_model(spec, request(2, "h100")).layouts if p.tp == 2)
    assert tp2.weights_gib * 2**30 == (total - norms) / 2 + norms  # 128256 = 1002 * 128: no vocab padding


def test_decode_roofline_memory_bound_by_hand(tmp_path):
    spec = spec_of(LLAMA_8B, tmp_path)
    p = plan_model(spec, request(1, "h100", context=1024, max_num_seqs=1)).layouts[0]
    streamed = (spec.num_params - 128256 * 4096) * 2  # every weight but the embedding table
    kv = 2 * 8 * 128 * 32 * 2 * 1024
    assert p.decode_bound == "memory" and p.decode_comm_ms == 0
    assert p.decode_tokens_per_s == pytest.approx(3350e9 / (streamed + kv), rel=1e-9)


def test_prefill_roofline_compute_bound_by_hand(tmp_path):
    spec = spec_of(LLAMA_8B, tmp_path)
    p = plan_model(spec, request(1, "h100", context=8192, prefill_tokens=8192)).layouts[0]
    linear = spec.num_params - 2 * 128256 * 4096 - (2 * 32 + 1) * 4096  # no embedding, LM head, norms
    flops = 8192 * 2 * linear + 2 * 128256 * 4096 + 8192 * 4 * 32 * 128 * 4096 * 32  # LM head once; keys C/2
    assert p.prefill_tokens_per_s == pytest.approx(8192 / (flops / 989e12), rel=1e-9)


def test_tp_all_reduce_volume(tmp_path):
    p = next(p for p in plan_model(spec_of(LLAMA_8B, tmp_path), request(8, "h100", max_num_seqs=64)).layouts
             if p.tp == 8)
    ring = 2 * 7 / 8 * 4096 * 2   # bytes a rank sends per token per all-reduce of a bf16 hidden vector
    logits = 7 / 8 * (251 * 64) * 8 * 4  # all-gather of fp32 logits; 128256 padded to 251 x 64 rows per rank
    assert p.decode_comm_bytes_per_token == pytest.approx((1 + 2 * 32) * ring + logits, rel=1e-12)


def test_expected_remote_ranks_vs_simulation():
    gen = torch.Generator().manual_seed(0)
    for experts, k, ep in ((256, 8, 16), (8, 2, 4), (384, 8, 32)):
        picks = torch.rand(20000, experts, generator=gen).argsort(dim=1)[:, :k]
        ranks = picks // (experts // ep)
        hit = torch.zeros(20000, ep, dtype=torch.bool).scatter_(1, ranks, True)
        simulated = hit[:, 1:].sum(dim=1).float().mean().item()  # the token lives on rank 0
        assert expected_remote_ranks(experts, k, ep) == pytest.approx(simulated, abs=0.05)


def test_expert_parallel_memory(tmp_path):
    spec = spec_of(DEEPSEEK_V3, tmp_path)
    plan = plan_model(spec, request(8))  # attention-DP + EP on one node (DP replicas do not span nodes)
    ep = next(p for p in plan.layouts if p.layout == "TP1 DP8 EP8")
    tp = next(p for p in plan.layouts if p.layout == "TP8 EP8")
    assert ep.weights_gib > tp.weights_gib  # 32 whole experts a layer each + replicated attention/dense vs 1/8
    assert ep.max_concurrent_seqs > tp.max_concurrent_seqs  # attention DP: each rank caches only its requests
    tp16 = next(p for p in plan_model(spec, request(16)).layouts if p.layout == "TP16 EP16")
    redundant = plan_model(spec, request(16, redundant_experts=32))  # EPLB: 18 physical experts a layer a rank
    tp18 = next(p for p in redundant.layouts if p.layout == "TP16 EP16")
    expert_gib = 58 * 3 * 7168 * 2048 * (1 + 4 / 128**2) / 2**30  # 58 MoE layers, 3 FP8 matrices an expert
    assert tp18.weights_gib - tp16.weights_gib == pytest.approx(2 * expert_gib, rel=1e-9)
    redundant8 = plan_model(spec, request(8, redundant_experts=8))
    assert "--eplb-config" in {p.layout: p.reason for p in redundant8.excluded}["TP1 DP8 EP8"]  # not in lockstep


# ------------------------------------------------------------------ CLI

def test_cli_folder_with_only_config_json(tmp_path, capsys):
    folder = write_config(tmp_path / "kimi", KIMI_K2)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]
    assert main(["plan", str(folder), "--gpus", "16", "--gpu", "h200", "--interconnect", "nvlink,ib400",
                 "--context", "8192", "--gpu-hour-price", "3.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["quantization"] == "int"
    assert out["layouts"] and all(p["cost_per_1m_output_tokens"] > 0 for p in out["layouts"])
    assert main(["plan", str(folder), "--gpus", "16"]) == 0
    assert "decode tok/s" in capsys.readouterr().out


@pytest.mark.parametrize("content,message", [
    ("{not json", "not valid JSON"),
    (json.dumps({"model_type": "llama", "num_hidden_layers": 2}), "missing 'hidden_size'"),
    (json.dumps({**LLAMA_8B, "hidden_size": -4}), "'hidden_size' must be an integer >= 1"),
    (json.dumps({**LLAMA_8B, "model_type": "mamba"}), "model_type 'mamba' is not supported"),
    (json.dumps([1, 2]), "expected a JSON object"),
])
def test_cli_malformed_config(tmp_path, capsys, content, message):
    (tmp_path / "config.json").write_text(content)
    assert main(["plan", str(tmp_path), "--gpus", "8"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--gpu", "tpu9"], "unknown GPU 'tpu9'"),
    (["--interconnect", "carrier-pigeon"], "unknown interconnect"),
    (["--context", "0"], "--context must be >= 1"),
])
def test_cli_bad_options(tmp_path, capsys, args, message):
    write_config(tmp_path, LLAMA_8B)
    assert main(["plan", str(tmp_path), "--gpus", "8", *args]) == 2
    assert message in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "nope"), "--gpus", "8"]) == 2
    assert "no config.json" in capsys.readouterr().err
