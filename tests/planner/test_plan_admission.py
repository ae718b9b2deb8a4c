"""tokenfab plan proposes only layouts the engine serves (issue 25).

For quantized MoE models (block FP8, compressed-tensors INT4, MXFP4, ModelOpt NVFP4 experts; online FP8)
on several clusters, every layout the planner proposes goes through the engine's own admission: the
``EngineArgs`` a user would launch it with (attention-DP + EP options, EPLB), then one MoE layer built
the way a rank of that layout builds it (its TP/EP sizes and redundant experts in the parallel state,
weights on meta, the checkpoint's QuantMethod from the loader handing it quantized experts), after the
launch rule ``tokenfab serve`` applies (DP replicas on one node; TP alone spans nodes under torchrun).
Every layout the planner excludes as refused by the engine must be refused by that same path, so the
walk fails if either side drifts; on multi-node clusters no proposed DP layout spans nodes. Online FP8
keeps the routed experts at 2 bytes a value."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from tests.planner.plan_configs import DEEPSEEK_V3, GPT_OSS_120B, KIMI_K2, QWEN3_235B, write_config
from tokenfab.distributed import admission
from tokenfab.distributed import parallel_state as ps
from tokenfab.engine.args import EngineArgs
from tokenfab.layers.moe import FusedMoE
from tokenfab.loader.formats import resolve_quant_method
from tokenfab.loader.quant_apply import weights_on_meta
from tokenfab.planner.hardware import get_gpu, parse_interconnect
from tokenfab.planner.model_spec import build_spec, load_config
from tokenfab.planner.plan import LayoutPlan, PlanRequest, plan_model
from tokenfab.quant.online import online_quant_method
from tokenfab.server.cli import add_arguments, run

NVFP4_QUANT = {"producer": {"name": "modelopt"}, "quantization": {
    "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
    "exclude_modules": ["lm_head", "model.layers.*.mlp.gate", "model.layers.*.self_attn*"]}}

# (id, config, hf_quant_config.json or None, --quantization, [(gpus, gpu, redundant experts)])
CASES = [
    ("fp8_block_deepseek_v3", DEEPSEEK_V3, None, None, [(8, "h200", 0), (16, "h200", 0), (16, "h200", 32),
                                                         (16, "h100", 0), (32, "h200", 0), (32, "h100", 32)]),
    ("int4_ct_kimi_k2", KIMI_K2, None, None, [(8, "h200", 0), (16, "h200", 0), (16, "b200", 64),
                                              (32, "h200", 0)]),
    ("mxfp4_gpt_oss_120b", GPT_OSS_120B, None, None, [(1, "h100", 0), (2, "h100", 0), (4, "h100", 0),
                                                      (8, "h100", 0), (8, "h100", 8), (6, "h100", 0)]),
    ("nvfp4_qwen3_235b", QWEN3_235B, NVFP4_QUANT, None, [(4, "h200", 0), (8, "h200", 0), (8, "b200", 16)]),
    ("online_fp8_qwen3_235b", QWEN3_235B, None, "fp8", [(4, "h200", 0), (8, "h200", 0), (16, "h100", 32),
                                                        (32, "h100", 0)]),
    ("online_fp8_block_qwen3_235b", QWEN3_235B, None, "fp8-block", [(8, "h200", 0)]),
]


def _folder(tmp_path: Path, config: dict, quant: dict | None) -> Path:
    folder = write_config(tmp_path / "model", config)
    if quant is not None:
        (folder / "hf_quant_config.json").write_text(json.dumps(quant))
    return folder


def _moe_shape(config: dict) -> dict:
    """FusedMoE's arguments for one routed-expert layer of ``config`` (as the model files build it)."""
    if config["model_type"] == "gpt_oss":
        return dict(hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
                    num_experts=config["num_local_experts"], top_k=config["num_experts_per_tok"],
                    router_bias=True, expert_bias=True, activation="swiglu_oai")
    experts = config.get("n_routed_experts") or config["num_experts"]
    return dict(hidden_size=config["hidden_size"], intermediate_size=config["moe_intermediate_size"],
                num_experts=experts, top_k=config["num_experts_per_tok"])


def engine_admits(folder: Path, config: dict, quantization: str | None, tp: int, dp: int, ep: bool,
                  redundant: int, monkeypatch: pytest.MonkeyPatch, gpus_per_node: int | None = None) -> None:
    """Raise as the engine would when asked to serve ``TPtp DPdp [EP]`` of this checkpoint.

    The launch rule first (DP x TP on one node of ``gpus_per_node``; ``tokenfab serve`` under torchrun,
    the multi-node launch, refuses DP with the same function); the launch options go through
    ``EngineArgs``; then one MoE layer is built with the parallel state a rank of that layout has (the
    TP group of its replica; EP over the TP group at DP 1, over every replica under attention-DP + EP;
    EPLB's redundant experts) and gets the checkpoint's quantized experts the way
    ``apply_quant_method`` hands them over."""
    admission.check_launch(tp, dp, gpus_per_node)
    eplb = {"num_redundant_experts": redundant} if ep and redundant else None
    EngineArgs(model=str(folder), tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep,
               eplb_config=eplb, quantization=quantization)
    method = online_quant_method(quantization) if quantization else resolve_quant_method(folder, config)
    ep_size = tp * dp if ep else 1
    monkeypatch.setattr(ps, "_state", ps.ParallelState(tp_size=tp, ep_size=ep_size,
                                                       ep_redundant=redundant if ep else 0))
    name = "model.layers.3.mlp"
    with torch.device("cpu"), weights_on_meta():  # a quantized build: weights on meta, EPLB maps real
        moe = FusedMoE(**_moe_shape(config))
    if method is not None and method.is_quantized(f"{name}.experts"):
        with torch.device("meta"):  # the packed expert buffers too: shapes only
            experts = method.make_experts(moe, name)
        if experts is not None:
            moe.set_quant_experts(experts)


def _request(gpus: int, gpu: str, redundant: int, quantization: str | None) -> PlanRequest:
    g = get_gpu(gpu)
    return PlanRequest(gpus=gpus, gpu=g, interconnect=parse_interconnect(None, g), context=8192,
                       quantization=quantization, redundant_experts=redundant)


def _ep(p: LayoutPlan) -> bool:
    return p.ep > 1 or "EP" in p.layout


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_proposed_layout_is_admitted_by_the_engine(case, tmp_path, monkeypatch):
    _, config, quant, quantization, clusters = case
    folder = _folder(tmp_path, config, quant)
    spec = build_spec(load_config(folder))
    proposed = refused = 0
    for gpus, gpu, redundant in clusters:
        plan = plan_model(spec, _request(gpus, gpu, redundant, quantization))
        node = get_gpu(gpu).gpus_per_node
        for p in plan.layouts:  # every layout proposed: the engine serves it
            engine_admits(folder, config, quantization, p.tp, p.dp, _ep(p), redundant, monkeypatch, node)
            assert p.dp == 1 or p.tp * p.dp <= node  # no DP deployment spans nodes
            proposed += 1
        for p in plan.excluded:  # every layout excluded as refused: the engine refuses it
            if p.reason.startswith("the engine refuses it: "):
                # (the format's expert module may refuse a TP-split shape first, in its own words)
                with pytest.raises((ValueError, NotImplementedError)):
                    engine_admits(folder, config, quantization, p.tp, p.dp, _ep(p), redundant, monkeypatch, node)
                refused += 1
        if gpus > node:  # every DP layout of a multi-node cluster is listed as excluded by the launch rule
            multi = [p for p in plan.excluded if p.dp > 1]
            assert multi and all("span more than one node" in p.reason for p in multi)
    assert proposed > 0
    assert refused > 0  # each case meets at least one refusal (TP-split quantized experts, TP under DP+EP)


def test_quantized_moe_refusals_are_real(tmp_path, monkeypatch):
    """The layouts the issue names are refused by the engine, and the planner lists them as excluded."""
    folder = _folder(tmp_path, DEEPSEEK_V3, None)
    with pytest.raises(NotImplementedError, match="quantized experts split by tensor parallelism"):
        engine_admits(folder, DEEPSEEK_V3, None, 8, 1, False, 0, monkeypatch)  # TP 8 over FP8 experts, no EP
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 \(TP 1 per replica only"):
        engine_admits(folder, DEEPSEEK_V3, None, 2, 4, True, 0, monkeypatch)  # TP > 1 under attention-DP + EP
    with pytest.raises(ValueError, match="--eplb-config"):
        engine_admits(folder, DEEPSEEK_V3, None, 1, 8, True, 8, monkeypatch)  # EPLB under attention-DP + EP
    with pytest.raises(ValueError, match="128 experts do not divide over 6 expert-parallel ranks"):
        engine_admits(_folder(tmp_path / "o", GPT_OSS_120B, None), GPT_OSS_120B, None, 1, 6, True, 0, monkeypatch)
    engine_admits(folder, DEEPSEEK_V3, None, 8, 1, True, 0, monkeypatch)  # the same GPUs with EP: served
    engine_admits(folder, DEEPSEEK_V3, None, 1, 8, True, 0, monkeypatch)
    plan = plan_model(build_spec(load_config(folder)), _request(8, "h200", 0, None))
    reasons = {p.layout: p.reason for p in plan.excluded}
    assert "quantized experts split by tensor parallelism" in reasons["TP8"]
    assert "TP 1 per replica only" in reasons["TP2 DP4 EP8"]
    assert {p.layout for p in plan.layouts} <= {"TP8 EP8", "TP1 DP8 EP8"}


def test_admission_functions_refuse_and_accept():
    """The shared rules on their own: the refusals raise with the engine's messages, the rest pass."""
    with pytest.raises(NotImplementedError, match="use --enable-expert-parallel"):
        admission.check_moe_layout(2, 1, quantized_experts=True)
    admission.check_moe_layout(2, 2, quantized_experts=True)  # EP: whole experts per rank
    admission.check_moe_layout(1, 1, quantized_experts=True)
    admission.check_moe_layout(4, 1, quantized_experts=False, intermediate_size=1536)  # plain experts split by TP
    with pytest.raises(ValueError, match="expert intermediate size 1536 does not divide by TP 5"):
        admission.check_moe_layout(5, 1, intermediate_size=1536)
    with pytest.raises(ValueError, match="TP 1 per replica only"):
        admission.check_dp_ep(2, True, 2)
    admission.check_dp_ep(2, False, 2)  # plain DP replicas with TP
    admission.check_dp_ep(1, True, 8)   # EP over one TP group
    with pytest.raises(ValueError, match="256 experts \\+ 8 redundant do not divide over 16 ranks"):
        admission.check_expert_placement(256, 8, 16)
    admission.check_expert_placement(256, 32, 16)


@pytest.mark.parametrize("experts,redundant,ep", [(8, 0, 4), (8, 0, 3), (8, 4, 4), (8, 2, 4), (6, 2, 4),
                                                  (16, 0, 16), (16, 0, 32)])
def test_expert_placement_rule_matches_eplb(experts, redundant, ep):
    """``check_expert_placement`` refuses exactly what the engine's initial placement refuses."""
    from tokenfab.distributed.eplb import identity_placement

    try:
        identity_placement(experts, ep, redundant)
        engine = ""
    except ValueError as e:
        engine = str(e)
    try:
        admission.check_expert_placement(experts, redundant, ep)
        rule = ""
    except ValueError as e:
        rule = str(e)
    assert rule == engine


def test_online_fp8_keeps_routed_experts_16_bit(tmp_path):
    """--quantization fp8 (online): only Linear layers become FP8 (a float32 scale per output row);
    the routed experts stay at 2 bytes a value, so TP may split them (no refusal)."""
    spec = build_spec(load_config(write_config(tmp_path, QWEN3_235B)))
    bf16 = plan_model(spec, _request(8, "h200", 0, None))
    fp8 = plan_model(spec, _request(8, "h200", 0, "fp8"))
    c = QWEN3_235B
    h, layers, heads, kv, hd = c["hidden_size"], c["num_hidden_layers"], 64, 4, 128
    experts = layers * 128 * 3 * h * c["moe_intermediate_size"]
    attn = [(heads * hd, h), (kv * hd, h), (kv * hd, h), (h, heads * hd)]  # q, k, v, o per layer
    saved = layers * sum(r * cols - 4 * r for r, cols in attn)  # 2 -> 1 byte a value, + float32 row scale
    assert (bf16.model["weight_gib"] - fp8.model["weight_gib"]) * 2**30 == pytest.approx(saved, rel=1e-12)
    assert fp8.model["weight_gib"] * 2**30 > 2 * experts  # the experts alone, at 2 bytes a value
    tp8 = {p.layout: p for p in fp8.layouts}["TP8"]  # TP-split plain experts: proposed
    per_rank_experts = 2 * experts / 8
    assert tp8.weights_gib * 2**30 > per_rank_experts
    block = plan_model(spec, _request(8, "h200", 0, "fp8-block"))
    blocks = layers * sum(math.ceil(r / 128) * math.ceil(cols / 128) * 4 for r, cols in attn)
    assert (bf16.model["weight_gib"] - block.model["weight_gib"]) * 2**30 == pytest.approx(
        layers * sum(r * cols for r, cols in attn) - blocks, rel=1e-12)


def test_launch_rule_keeps_dp_on_one_node():
    """DP replicas x TP ranks fit on one node, whatever the parallelism; TP alone may span nodes."""
    for tp, dp in ((1, 16), (2, 8), (8, 2), (16, 2), (3, 3)):
        with pytest.raises(ValueError, match=f"--data-parallel-size {dp} x --tensor-parallel-size {tp} = "
                                             f"{tp * dp} GPUs span more than one node of 8"):
            admission.check_launch(tp, dp, 8)
    for tp, dp in ((1, 8), (2, 4), (8, 1), (16, 1), (32, 1), (1, 1)):
        admission.check_launch(tp, dp, 8)
    admission.check_launch(1, 64)  # nodes unknown: nothing to check
    with pytest.raises(ValueError, match="under torchrun every rank is one TP group: drop --data-parallel-size"):
        admission.check_launch(16, 2, torchrun=True)
    admission.check_launch(16, 1, torchrun=True)


def test_planner_excludes_multi_node_dp_with_the_launch_message(tmp_path):
    """The layout that used to top the 16 x H200 DeepSeek plan spans two nodes: excluded, with the rule's
    message; the same model and cluster keep the TP-only layout, which torchrun spreads over the nodes."""
    spec = build_spec(load_config(_folder(tmp_path, DEEPSEEK_V3, None)))
    plan = plan_model(spec, _request(16, "h200", 0, None))
    reasons = {p.layout: p.reason for p in plan.excluded}
    with pytest.raises(ValueError) as refused:
        admission.check_launch(1, 16, 8)
    assert reasons["TP1 DP16 EP16"] == f"the engine refuses it: {refused.value}"
    assert [p.layout for p in plan.layouts] == ["TP16 EP16"]


def test_serve_under_torchrun_refuses_dp_with_the_rule(tmp_path, monkeypatch, capsys):
    """``tokenfab serve`` launched by torchrun refuses --data-parallel-size through ``check_launch``."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "16")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([str(tmp_path), "--data-parallel-size", "2"])
    assert run(args) == 2
    assert capsys.readouterr().err.strip() == f"tokenfab serve: {admission.TORCHRUN_DP_MESSAGE}"
