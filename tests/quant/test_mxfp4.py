"""GPT-OSS with MXFP4 experts kept packed (tokenfab/quant/mxfp4.py): a tiny checkpoint written in
OpenAI's layout (tests/quant/layouts_w4.py) loads with its experts as uint8, generates the same
greedy tokens as transformers loading the same files (transformers dequantizes MXFP4 on CPU), and
the same logits as the dequantized float twin; the experts take ~1/4 of bf16's bytes."""

from __future__ import annotations

import pytest
import torch

from tests.moe_tiny_models import tiny_moe_config
from tests.quant.layouts_w4 import with_twin, write_mxfp4_checkpoint
from tests.tiny_models import hf_greedy_tokens, run_capturing_logits, save_tiny_model, small_engine
from tokenfab.layers.moe import FusedMoE
from tokenfab.quant.mxfp4 import Mxfp4Experts

PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11]
STEPS = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    save_tiny_model(tiny_moe_config("gpt_oss"), root / "plain")
    return with_twin(root, write_mxfp4_checkpoint(root / "plain", root / "mxfp4"))


def test_experts_stay_packed(ckpt):
    model = small_engine(ckpt / "mxfp4").runner.model
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert moes
    for moe in moes:
        qe = moe.quant_experts
        assert isinstance(qe, Mxfp4Experts) and moe.w13_weight is None and moe.w2_weight is None
        packed = sum(b.numel() * b.element_size() for b in (qe.w13_q, qe.w13_s, qe.w2_q, qe.w2_s))
        assert all(b.dtype == torch.uint8 for b in (qe.w13_q, qe.w13_s, qe.w2_q, qe.w2_s))
        bf16 = 2 * moe.num_experts * 3 * moe.intermediate_size * moe.hidden_size
        assert packed == bf16 * 17 // 64  # 4 bits + an 8-bit scale per 32 values, against 16 bits
    from tokenfab.quant.memory import weight_bytes_report

    q = weight_bytes_report(model)["quantized"]
    e, i, h = moes[0].num_experts, moes[0].intermediate_size, moes[0].hidden_size
    weights, biases = len(moes) * e * 3 * i * h, len(moes) * e * (2 * i + h)
    assert q["num_params"] == weights + biases
    assert q["weight_bytes"] == weights * 17 // 32 + biases * 4  # packed experts + their fp32 biases


def test_greedy_matches_transformers_and_logits_match_twin(ckpt):
    tokens, logits = run_capturing_logits(small_engine(ckpt / "mxfp4"), list(PROMPT), STEPS)
    assert tokens == hf_greedy_tokens(ckpt / "mxfp4", PROMPT, STEPS)
    twin_tokens, twin_logits = run_capturing_logits(small_engine(ckpt / "twin"), list(PROMPT), STEPS)
    assert tokens == twin_tokens
    for a, b in zip(logits, twin_logits):
        # fp32 both ways: the same weights, only the product's summation order differs
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_through_triton_kernels(ckpt, monkeypatch):
    """The packed experts through the Triton W4A16 MoE kernel (interpreter on CPU): same logits."""
    from tokenfab.kernels._launch import interpreting

    if not (torch.cuda.is_available() or interpreting()):
        pytest.skip("triton was imported without the interpreter")
    _, ref = run_capturing_logits(small_engine(ckpt / "twin"), list(PROMPT), 2)
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    _, got = run_capturing_logits(small_engine(ckpt / "mxfp4"), list(PROMPT), 2)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


def test_bad_blocks_are_a_clear_error(ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    from tokenfab.loader.errors import ModelLoadError

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in (ckpt / "mxfp4").iterdir():
        if f.suffix != ".safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    t = load_file(str(ckpt / "mxfp4" / "model.safetensors"))
    name = next(k for k in t if k.endswith("gate_up_proj_blocks"))
    t[name] = t[name][:, :, :1].contiguous()  # half the blocks of each row
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises((ModelLoadError, ValueError), match="gate_up_proj_blocks|w13 blocks"):
        small_engine(bad)
