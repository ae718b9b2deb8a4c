"""Multi-LoRA on MoE experts (tiny random Qwen3-MoE): adapters saved by PEFT on the fused 3-D expert parameters
(``target_parameters``), one also on attention, served mixed with each other and the base in one batch; each
request's greedy tokens (prefill and decode) equal transformers' with that adapter merged by PEFT, prompt logprobs
within 1e-4 (fp32). The per-expert layout (PEFT for transformers 4, vLLM) of the same adapter gives the same
tokens; adapters on the router or of too high a rank are refused by name; a step without adapters never takes
the LoRA experts' path."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.lora.adapters import assert_prompt_logprobs_equal_peft_merged, merged_greedy, run_greedy
from tests.lora.moe_adapters import EXPERT_PARAMS, make_moe_peft_adapter, per_expert_copy
from tests.moe_tiny_models import tiny_moe_config
from tests.tiny_models import save_tiny_model
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.lora_request import LoRARequest
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.layers import moe_lora as moe_lora_layer

peft = pytest.importorskip("peft")

PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [100, 3, 250, 19], [8, 8, 61, 200, 13, 77, 31, 5, 9, 300, 12], [44, 1]]
N_NEW = 6
IDS = {"e": 1, "ea": 2, "d": 3, "pe": 4}


@pytest.fixture(scope="module")
def moe_setup(tmp_path_factory):
    """(model dir, transformers model, adapters): Qwen3-MoE with 3 layers (MoE, dense, MoE; 8 experts, top-2) and
    PEFT adapters e (r 8, the experts' gate_up and down), ea (r 4, rsLoRA, experts + q/v/o + the dense layer's
    MLP), d (r 16, the experts' down_proj only), and pe: e rewritten per expert."""
    root = tmp_path_factory.mktemp("moe-lora")
    cfg = tiny_moe_config("qwen3_moe")
    base = save_tiny_model(cfg, root / "base")
    adapters = {
        "e": make_moe_peft_adapter(base, root / "e", 8, 1, EXPERT_PARAMS),
        "ea": make_moe_peft_adapter(base, root / "ea", 4, 2, EXPERT_PARAMS,
                                    ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                    use_rslora=True),
        "d": make_moe_peft_adapter(base, root / "d", 16, 3, ["mlp.experts.down_proj"]),
    }
    adapters["pe"] = per_expert_copy(adapters["e"], root / "pe", cfg.num_experts, cfg.hidden_size,
                                     cfg.moe_intermediate_size, v4_config=True)
    return str(root / "base"), base, adapters


@pytest.fixture(scope="module")
def references(moe_setup):
    _, base, adapters = moe_setup
    return {name: merged_greedy(base, None if name is None else adapters[name], PROMPTS, N_NEW)
            for name in (None, "e", "ea", "d", "pe")}


def _engine(base_dir: str, **kw) -> LLMEngine:
    args = dict(model=base_dir, device="cpu", dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16,
                num_kv_blocks=96, block_size=4)
    args.update(kw)
    return LLMEngine(**args)


def _req(adapters, name: str) -> LoRARequest:
    return LoRARequest(name, IDS[name], str(adapters[name]))


def _run(engine: LLMEngine, jobs: list[tuple[list[int], LoRARequest | None]]) -> list[list[int]]:
    return run_greedy(engine, jobs, N_NEW)


def test_peft_writes_the_3d_expert_layout(moe_setup):
    """What the loader reads: PEFT's nested ParamWrapper keys on the experts module, [r*E, in] / [out, r*E]."""
    _, _, adapters = moe_setup
    cfg = json.loads((adapters["e"] / "adapter_config.json").read_text())
    assert sorted(cfg["target_parameters"]) == sorted(EXPERT_PARAMS)
    from safetensors import safe_open

    with safe_open(str(adapters["e"] / "adapter_model.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    pre = "base_model.model.model.layers.0.mlp.experts"
    assert {shapes[f"{pre}.base_layer.lora_A.weight"][0], shapes[f"{pre}.lora_A.weight"][0]} == {8 * 8}


def test_mixed_expert_adapters_and_base_equal_peft_merged(moe_setup, references):
    """Every prompt under e, ea, d and the base, all submitted together (one step mixes them all)."""
    base_dir, _, adapters = moe_setup
    engine = _engine(base_dir)
    names = [None, "e", "ea", "d"]
    jobs = [(p, None if n is None else _req(adapters, n)) for p in PROMPTS for n in names]
    got = _run(engine, jobs)
    for (p, lora), tokens in zip(jobs, got):
        name = None if lora is None else lora.lora_name
        assert tokens == references[name][PROMPTS.index(p)], (name, p)
    for n in ("e", "ea", "d"):  # the adapters change the output (the test can fail)
        assert references[n] != references[None], n


def test_each_adapter_alone_equals_peft_merged(moe_setup, references):
    base_dir, _, adapters = moe_setup
    engine = _engine(base_dir, max_loras=1)
    for n in ("e", "ea", "d"):
        assert _run(engine, [(PROMPTS[2], _req(adapters, n))]) == [references[n][2]], n


def test_per_expert_layout_equals_the_3d_layout(moe_setup, references):
    """The per-expert naming (experts.<e>.gate_proj/up_proj/down_proj, a transformers-4 PEFT config) of adapter e:
    PEFT itself converts it on load to e's merged weights; the engine gives those tokens, next to e itself and the
    base in one batch."""
    base_dir, _, adapters = moe_setup
    assert references["pe"] == references["e"]  # PEFT's own reading of the per-expert layout
    engine = _engine(base_dir)
    jobs = [(PROMPTS[0], _req(adapters, "pe")), (PROMPTS[0], _req(adapters, "e")), (PROMPTS[1], None),
            (PROMPTS[3], _req(adapters, "pe"))]
    assert _run(engine, jobs) == [references["e"][0], references["e"][0], references[None][1], references["e"][3]]


def test_prompt_logprobs_equal_peft_merged(moe_setup):
    base_dir, base, adapters = moe_setup
    engine = _engine(base_dir)
    jobs = {"b": None, "e": _req(adapters, "e"), "ea": _req(adapters, "ea"), "d": _req(adapters, "d")}
    assert_prompt_logprobs_equal_peft_merged(engine, base, PROMPTS[2], jobs)


def test_mixed_batch_through_the_triton_kernels(moe_setup, references, monkeypatch):
    """TOKENFAB_KERNELS=triton: the LoRA experts' kernels (interpreter on CPU) give PEFT's tokens too."""
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    base_dir, _, adapters = moe_setup
    engine = _engine(base_dir, cpu_weight_packing=False)
    jobs = [(PROMPTS[3], None), (PROMPTS[3], _req(adapters, "e")), (PROMPTS[1], _req(adapters, "ea"))]
    assert _run(engine, jobs) == [references[None][3], references["e"][3], references["ea"][1]]


def test_steps_without_adapters_take_the_plain_experts(moe_setup, references, monkeypatch):
    base_dir, _, _ = moe_setup
    engine = _engine(base_dir)

    def boom(*_a, **_k):
        raise AssertionError("the LoRA experts ran in a step without adapters")

    monkeypatch.setattr(moe_lora_layer, "fused_experts_lora", boom)
    assert _run(engine, [(PROMPTS[0], None), (PROMPTS[1], None)]) == [references[None][0], references[None][1]]


def test_router_and_high_rank_adapters_are_refused(moe_setup, tmp_path):
    base_dir, base, adapters = moe_setup
    engine = _engine(base_dir, max_lora_rank=8)
    params = SamplingParams(max_tokens=1)
    router = make_moe_peft_adapter(base, tmp_path / "router", 4, 5, ["mlp.gate.weight"])
    with pytest.raises(ValueError, match=r"router.*model\.layers\.0\.mlp\.gate: LoRA on the MoE router"):
        engine.add_request("a", PROMPTS[0], params, lora_request=LoRARequest("router", 7, str(router)))
    with pytest.raises(ValueError, match=r"/d: LoRA rank 16 is greater than --max-lora-rank 8"):
        engine.add_request("b", PROMPTS[0], params, lora_request=_req(adapters, "d"))
    assert not engine.has_unfinished_requests() and engine.lora.loaded_ids() == []


E, H, I, R = 8, 64, 32, 4
_PRE = "base_model.model.model.layers.0.mlp.experts"


@pytest.mark.parametrize("tensors,fragment", [
    ({f"{_PRE}.lora_A.weight": (R * E, 48), f"{_PRE}.lora_B.weight": (H, R * E)}, "fit neither gate_up_proj"),
    ({f"{_PRE}.lora_A.weight": (R * E, I), f"{_PRE}.lora_B.weight": (H, R * E),
      f"{_PRE}.base_layer.lora_A.weight": (R * E, I), f"{_PRE}.base_layer.lora_B.weight": (H, R * E)},
     "a second LoRA pair for the experts' down_proj"),
    ({f"{_PRE}.3.gate_proj.lora_A.weight": (R, H), f"{_PRE}.3.gate_proj.lora_B.weight": (I, R)},
     r"gate LoRA of experts \[0, 1, 2, 4"),
    ({f"{_PRE}.9.up_proj.lora_A.weight": (R, H), f"{_PRE}.9.up_proj.lora_B.weight": (I, R)}, "expert 9 of 8"),
    ({f"{_PRE}.lora_A.weight": (R * E, I), f"{_PRE}.lora_B.weight": (H, R * E),
      **{f"{_PRE}.{e}.up_proj.lora_A.weight": (R, H) for e in range(E)},
      **{f"{_PRE}.{e}.up_proj.lora_B.weight": (I, R) for e in range(E)}}, "mixed"),
    ({"base_model.model.model.layers.1.mlp.experts.lora_A.weight": (R * E, I),  # layer 1 is dense
      "base_model.model.model.layers.1.mlp.experts.lora_B.weight": (H, R * E)}, "not a LoRA target"),
])
def test_hand_made_bad_expert_adapters_are_refused(moe_setup, tmp_path, tensors, fragment):
    base_dir, _, _ = moe_setup
    engine = _engine(base_dir)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text(f'{{"peft_type": "LORA", "r": {R}, "lora_alpha": 8}}')
    save_file({k: torch.ones(s) for k, s in tensors.items()}, str(tmp_path / "a" / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=fragment):
        engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=1),
                           lora_request=LoRARequest("a", 5, str(tmp_path / "a")))
    assert not engine.has_unfinished_requests() and engine.lora.loaded_ids() == []


def test_targets_cross_a_process_boundary_and_check_expert_adapters(moe_setup, tmp_path):
    """The engine's LoRA targets (what an API server checks /v1/load_lora_adapter against) are plain data with the
    MoE layers in them: after a JSON round trip they accept the expert adapters and refuse a router adapter."""
    from tokenfab.loader.lora_adapter import check_adapter_files

    base_dir, base, adapters = moe_setup
    engine = _engine(base_dir)
    targets = json.loads(json.dumps(engine.lora_targets))
    assert targets["moe"] == {"model.layers.0.mlp": [8, 64, 32], "model.layers.2.mlp": [8, 64, 32]}
    assert targets["moe_refused"] == {}
    for name in ("e", "ea", "d", "pe"):
        _, _, plans = check_adapter_files(adapters[name], targets, 16)
        assert sorted(plans) == ["model.layers.0.mlp", "model.layers.2.mlp"], name
    router = make_moe_peft_adapter(base, tmp_path / "router", 4, 5, ["mlp.gate.weight"])
    with pytest.raises(ValueError, match="router gate is not supported"):
        check_adapter_files(router, targets, 16)


def test_rank_and_alpha_patterns_equal_peft_merged(moe_setup, tmp_path):
    """PEFT's per-module ranks and alphas (rank_pattern / alpha_pattern) on attention projections and an expert
    parameter: the shapes are checked at each module's own rank, the scale is each module's alpha over its rank;
    a pattern rank above --max-lora-rank is refused naming the module."""
    base_dir, base, _ = moe_setup
    p = make_moe_peft_adapter(base, tmp_path / "p", 8, 9, ["mlp.experts.down_proj"], ["q_proj", "v_proj", "o_proj"],
                              rank_pattern={"v_proj": 2, "o_proj": 12, "experts.down_proj": 4},
                              alpha_pattern={"o_proj": 3, "down_proj": 40})
    cfg = json.loads((p / "adapter_config.json").read_text())
    assert cfg["rank_pattern"]["o_proj"] == 12 and cfg["alpha_pattern"]["down_proj"] == 40
    want = merged_greedy(base, p, PROMPTS[:2], N_NEW)
    assert want != merged_greedy(base, None, PROMPTS[:2], N_NEW)
    engine = _engine(base_dir)
    assert _run(engine, [(PROMPTS[0], LoRARequest("p", 9, str(p))), (PROMPTS[1], LoRARequest("p", 9, str(p)))]) == want
    small = _engine(base_dir, max_lora_rank=8)
    with pytest.raises(ValueError, match=r"o_proj: LoRA rank 12 \(rank_pattern\) is greater than --max-lora-rank 8"):
        small.add_request("x", PROMPTS[0], SamplingParams(max_tokens=1), lora_request=LoRARequest("p", 9, str(p)))
