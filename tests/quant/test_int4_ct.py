"""compressed-tensors pack-quantized INT4 W4A16 (tokenfab/quant/int4_ct.py), from tiny checkpoints
written in the official layout (tests/quant/layouts_w4.py):

- a DeepSeek-V3-style MoE (Kimi K2 is DeepseekV3ForCausalLM) with Kimi's ``ignore`` list: only the
  routed experts are INT4 (attention, shared experts, dense MLP, lm_head stay float); greedy tokens
  equal transformers loading the same files with the ``compressed-tensors`` package (which
  decompresses to bf16 on CPU), logits equal the dequantized float twin;
- a Llama with every linear but lm_head INT4 (merged qkv / gate_up projections);
- the Triton path (interpreter) on both, and refusals of unsupported variants.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.models.test_deepseek import save_tiny_deepseek
from tests.quant.layouts_w4 import with_twin, write_int4_ct_checkpoint
from tests.tiny_models import hf_logits, run_capturing_logits, save_tiny_model, small_engine, tiny_config
from tokenfab.layers.linear import Linear
from tokenfab.layers.moe import FusedMoE
from tokenfab.quant.int4_ct import Int4Experts
from tokenfab.quant.w4_linear import W4Linear

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], list(range(30, 60))]
STEPS = 5


@pytest.fixture(scope="module")
def kimi_like(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4_deepseek")
    save_tiny_deepseek(root / "plain")
    return with_twin(root, write_int4_ct_checkpoint(root / "plain", root / "int4"))  # Kimi K2's ignore list


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4_llama")
    save_tiny_model(tiny_config("llama"), root / "plain")
    return with_twin(root, write_int4_ct_checkpoint(root / "plain", root / "int4", ignore=["lm_head"]))


def test_kimi_ignore_list_keeps_only_routed_experts_int4(kimi_like):
    model = small_engine(kimi_like / "int4").runner.model
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(isinstance(m.quant_experts, Int4Experts) for m in moes)
    assert not [n for n, m in model.named_modules() if isinstance(m, W4Linear)]
    for moe in moes:
        qe = moe.quant_experts
        assert moe.w13_weight is None and qe.w13_q.dtype == torch.uint8
        held = sum(b.numel() * b.element_size() for b in (qe.w13_q, qe.w13_s, qe.w2_q, qe.w2_s))
        full = 4 * qe.num_weight_params()  # the fp32 model's bytes
        # per 32 weights: 16 bytes of nibbles + one scale in the model dtype (fp32 here: 4 bytes) = 20/128
        # of fp32 (a bf16 model: 18/64 of bf16)
        assert held * 128 == full * 20


def _hf_greedy_all(path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """hf_greedy_tokens for each prompt, the checkpoint loaded once (the same full forward per token)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    res = []
    for ids in prompts:
        out = list(ids)
        for _ in range(n):
            out.append(int(hf_logits(hf, out)[-1].argmax()))
        res.append(out[len(ids):])
    return res


def test_kimi_like_greedy_matches_transformers_and_twin(kimi_like):
    pytest.importorskip("compressed_tensors")
    ours, twin = small_engine(kimi_like / "int4"), small_engine(kimi_like / "twin")  # one engine each, both prompts
    hf = _hf_greedy_all(kimi_like / "int4", PROMPTS, STEPS)
    for prompt, hf_tokens in zip(PROMPTS, hf, strict=True):
        tokens, logits = run_capturing_logits(ours, list(prompt), STEPS)
        assert tokens == hf_tokens
        twin_tokens, twin_logits = run_capturing_logits(twin, list(prompt), STEPS)
        assert tokens == twin_tokens
        for a, b in zip(logits, twin_logits):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # fp32: only summation order differs


def test_dense_llama_int4(llama):
    model = small_engine(llama / "int4").runner.model
    w4 = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, W4Linear)}
    assert w4 == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert not isinstance(model.lm_head, W4Linear)
    from tokenfab.quant.memory import weight_bytes_report

    q = weight_bytes_report(model)["quantized"]
    assert q["bytes_per_param"] == pytest.approx(0.5 + 4 / 32)  # nibbles + an fp32 scale per 32 (fp32 model)
    ours, twin = small_engine(llama / "int4"), small_engine(llama / "twin")
    hf = _hf_greedy_all(llama / "int4", PROMPTS, STEPS)
    for prompt, hf_tokens in zip(PROMPTS, hf, strict=True):
        tokens, logits = run_capturing_logits(ours, list(prompt), STEPS)
        _, twin_logits = run_capturing_logits(twin, list(prompt), STEPS)
        for a, b in zip(logits, twin_logits):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert tokens == hf_tokens


def test_through_triton_kernels(kimi_like, llama, monkeypatch):
    from tokenfab.kernels._launch import interpreting

    if not (torch.cuda.is_available() or interpreting()):
        pytest.skip("triton was imported without the interpreter")
    refs = {d: run_capturing_logits(small_engine(d / "twin"), list(PROMPTS[0]), 2)[1] for d in (kimi_like, llama)}
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    for d, ref in refs.items():
        _, got = run_capturing_logits(small_engine(d / "int4"), list(PROMPTS[0]), 2)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("change,match", [
    (lambda w: w.update(group_size=128), "group size 32"),
    (lambda w: w.update(symmetric=False), "symmetric"),
    (lambda w: w.update(num_bits=8), "4-bit"),
])
def test_unsupported_variants_are_refused(llama, tmp_path, change, match):
    from tokenfab.loader.errors import ModelLoadError

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in (llama / "int4").iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    change(cfg["quantization_config"]["config_groups"]["group_0"]["weights"])
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match):
        small_engine(bad)


def test_ignored_linear_stays_float(llama):
    model = small_engine(llama / "int4").runner.model
    assert type(model.lm_head) is not W4Linear
    assert all(type(m) is not Linear or "lm_head" in n for n, m in model.named_modules() if "layers." in n
               and n.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")))


def test_bfloat16_model(kimi_like):
    """In bf16 (scales stored in bf16, the C kernel's bf16 path, bf16 experts' activations) the logits
    stay within bf16 rounding of the dequantized twin run in bf16."""
    def engine(d):
        return small_engine(d, dtype="bfloat16")

    model = engine(kimi_like / "int4").runner.model
    qe = next(m for m in model.modules() if isinstance(m, FusedMoE)).quant_experts
    assert qe.w13_s.dtype == torch.bfloat16
    _, got = run_capturing_logits(engine(kimi_like / "int4"), list(PROMPTS[0]), 3)
    _, ref = run_capturing_logits(engine(kimi_like / "twin"), list(PROMPTS[0]), 3)
    for a, b in zip(got, ref):
        scale = float(b.float().abs().max())
        assert float((a.float() - b.float()).abs().max()) < 0.05 * scale
