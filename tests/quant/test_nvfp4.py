"""ModelOpt NVFP4 (tokenfab/quant/nvfp4.py) on a tiny Llama written in the official layout
(tests/quant/layouts_w4.py): declared by hf_quant_config.json or by quantization_config
(quant_method "modelopt"); weights stay uint8 + E4M3; logits equal the dequantized float twin's and
greedy tokens equal transformers' on the twin. (transformers cannot load a pre-quantized NVFP4
checkpoint: its NVFP4 quantizer refuses pre-quantized weights and needs a Blackwell GPU, so the
twin is the reference.)"""

from __future__ import annotations

import json

import pytest
import torch

from tests.quant.layouts_w4 import with_twin, write_nvfp4_checkpoint, write_twin
from tests.tiny_models import hf_logits, run_capturing_logits, save_tiny_model, small_engine, tiny_config
from tokenfab.quant.w4_linear import W4Linear

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], list(range(30, 60))]
STEPS = 5


@pytest.fixture(scope="module", params=["hf_quant_config", "quantization_config"])
def ckpt(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("nvfp4")
    save_tiny_model(tiny_config("llama"), root / "plain")
    return with_twin(root, write_nvfp4_checkpoint(root / "plain", root / "nvfp4",
                                                  via_config=request.param == "quantization_config"))


def test_weights_stay_packed(ckpt):
    model = small_engine(ckpt / "nvfp4").runner.model
    layers = [m for m in model.modules() if isinstance(m, W4Linear)]
    assert len(layers) == 4 * model.config.num_hidden_layers  # qkv, o, gate_up, down; lm_head excluded
    assert not isinstance(model.lm_head, W4Linear)
    for m in layers:
        assert m.qweight.dtype == torch.uint8 and m.scales.dtype == torch.uint8 and m.codec == "nvfp4"
        n, k = m.out_features, m.in_features
        held = sum(b.numel() * b.element_size() for b in (m.qweight, m.scales, m.global_scale))
        assert held == n * (k // 2 + k // 16 + 4)  # nibbles, one E4M3 per 16, one fp32 global per row
    from tokenfab.quant.memory import weight_bytes_report

    q = weight_bytes_report(model)["quantized"]
    assert 0.5625 < q["bytes_per_param"] < 0.5625 + 4 / 64  # 4.5 bits + the per-row global (K >= 64 here)


# the declaration routes differ in loading only (test_weights_stay_packed runs both fast): the engine runs
# below take the quantization_config route in the slow tier
ROUTES = ["hf_quant_config", pytest.param("quantization_config", marks=pytest.mark.slow)]


@pytest.mark.parametrize("ckpt", ROUTES, indirect=True)
def test_logits_match_twin_and_greedy_matches_transformers(ckpt):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt / "twin", dtype=torch.float32).eval()
    for prompt in PROMPTS:
        tokens, logits = run_capturing_logits(small_engine(ckpt / "nvfp4"), list(prompt), STEPS)
        _, twin_logits = run_capturing_logits(small_engine(ckpt / "twin"), list(prompt), STEPS)
        for a, b in zip(logits, twin_logits):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # fp32: only summation order differs
        ids = list(prompt)
        for _ in range(STEPS):
            ids.append(int(hf_logits(hf, ids)[-1].argmax()))
        assert tokens == ids[len(prompt):]


@pytest.mark.parametrize("ckpt", ROUTES, indirect=True)
def test_through_triton_kernels(ckpt, monkeypatch):
    from tokenfab.kernels._launch import interpreting

    if not (torch.cuda.is_available() or interpreting()):
        pytest.skip("triton was imported without the interpreter")
    _, ref = run_capturing_logits(small_engine(ckpt / "twin"), list(PROMPTS[0]), 2)
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    _, got = run_capturing_logits(small_engine(ckpt / "nvfp4"), list(PROMPTS[0]), 2)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("change,match", [
    (dict(quant_algo="FP8"), "quant_algo"),
    (dict(group_size=32), "group_size"),
])
def test_unsupported_variants_are_refused(tmp_path, change, match):
    from tokenfab.loader.errors import ModelLoadError

    save_tiny_model(tiny_config("llama"), tmp_path / "plain")
    write_nvfp4_checkpoint(tmp_path / "plain", tmp_path / "q")
    path = tmp_path / "q" / "hf_quant_config.json"
    cfg = json.loads(path.read_text())
    cfg["quantization"].update(change)
    path.write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match):
        small_engine(tmp_path / "q")


def test_moe_experts_nvfp4(tmp_path):
    """A tiny Qwen3-MoE with every linear NVFP4 (experts one by one, gate and up with their own global
    scales) but lm_head and the routers: experts stay packed, logits equal the dequantized twin's,
    greedy tokens equal transformers' on the twin."""
    import transformers

    from tests.moe_tiny_models import tiny_moe_config
    from tokenfab.layers.moe import FusedMoE
    from tokenfab.quant.nvfp4 import Nvfp4Experts

    save_tiny_model(tiny_moe_config("qwen3_moe"), tmp_path / "plain")
    twin = write_nvfp4_checkpoint(tmp_path / "plain", tmp_path / "nvfp4",
                                  exclude=["lm_head", "model.layers.*.mlp.gate"])
    write_twin(tmp_path / "plain", tmp_path / "twin", twin)
    engine = small_engine(tmp_path / "nvfp4")
    moes = [m for m in engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(isinstance(m.quant_experts, Nvfp4Experts) for m in moes)
    assert all(not bool((m.quant_experts.w13_g[:, 0] == m.quant_experts.w13_g[:, 1]).all()) for m in moes)
    tokens, logits = run_capturing_logits(engine, list(PROMPTS[0]), STEPS)
    _, twin_logits = run_capturing_logits(small_engine(tmp_path / "twin"), list(PROMPTS[0]), STEPS)
    for a, b in zip(logits, twin_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "twin", dtype=torch.float32).eval()
    ids = list(PROMPTS[0])
    for _ in range(STEPS):
        ids.append(int(hf_logits(hf, ids)[-1].argmax()))
    assert tokens == ids[len(PROMPTS[0]):]
