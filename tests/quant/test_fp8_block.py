"""Block-FP8 checkpoints (DeepSeek-V3 / Qwen3-FP8 layout, written by tests/quant/layouts_fp8.py from the
format description): tiny Qwen3 and DeepSeek-V3 models load with their weights kept float8, give the
greedy tokens transformers gives on the same files, the logits of their dequantized twin, and half
the weight bytes of bf16.

transformers runs FP8 checkpoints on CPU by dequantizing them at load (FineGrainedFP8, dequantize=True).
Its dequantizer derives the block size from the scale grid (rows // grid rows), which is only right
when N and K are multiples of 128 or below 128. So the "hf" cases keep every dimension so, and
transformers reads the FP8 folder itself; the "edge" cases have N and K that are not (a 200-wide
MLP, DeepSeek's kv_a_proj of 192 rows = 2 blocks, the second zero-padded; 64-wide experts): there
transformers runs on the dequantized twin.

Tolerances: our CPU path dequantizes the same float8 values times the same float32 scales as the
twin, in float32, so logits agree to float32 rounding of the products (1e-4). The W8A8 path
(Triton, activations quantized per token and 128 channels) is compared in test_w8a8_path below.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.test_deepseek import save_tiny_deepseek
from tests.quant.layouts_fp8 import write_fp8_block_checkpoint
from tests.tiny_models import (
    compiled_and_eager_logits,
    greedy_tokens,
    run_capturing_logits,
    save_tiny_model,
    tiny_config,
)
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.quant.fp8_block import FP8Linear
from tokenfab.quant.fp8_experts import FP8Experts

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], [1, 2, 3]]
STEPS = 6
LOGIT_TOL = dict(rtol=1e-4, atol=1e-4)

CASES = {
    # hidden 96 (one partial K block), qkv 128+64+64 rows (shards off the 128 grid), MLP 256 (two blocks)
    "qwen3-hf": ("qwen3", dict(hidden_size=96, intermediate_size=256, head_dim=32), True),
    # MLP 200 wide: gate/up N = 200 and down K = 200 (the second block zero-padded)
    "qwen3-edge": ("qwen3", dict(hidden_size=96, intermediate_size=200, head_dim=32), False),
    # v_head_dim 16: kv_b_proj 128 rows; everything else below 128
    "deepseek-hf": ("deepseek", dict(v_head_dim=16), True),
    # kv_a_proj_with_mqa: 160 + 32 = 192 rows (DeepSeek's 576 in small); 64-wide experts
    "deepseek-edge": ("deepseek", dict(hidden_size=96, kv_lora_rank=160, qk_rope_head_dim=32,
                                       moe_intermediate_size=64), False),
}


def _engine(path) -> LLMEngine:
    return LLMEngine(model=str(path), block_size=4, num_kv_blocks=96, max_num_batched_tokens=64)


_BUILT: dict[str, object] = {}
_LOADED: dict[object, object] = {}  # the FP8 model test_loads_... loaded, reused by the bytes test


def _build(name: str, tmp_path_factory):
    if name not in _BUILT:
        family, overrides, _ = CASES[name]
        root = tmp_path_factory.mktemp(name)
        if family == "qwen3":
            save_tiny_model(tiny_config("qwen3", architectures=["Qwen3ForCausalLM"], **overrides), root / "src")
        else:
            save_tiny_deepseek(root / "src", **overrides)
        write_fp8_block_checkpoint(root / "src", root / "fp8", root / "twin")
        _BUILT[name] = root
    return name, _BUILT[name], CASES[name][2]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


def _hf_greedy(path, prompts: list[list[int]], n: int) -> list[list[int]]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    res = []
    with torch.no_grad():
        for prompt in prompts:
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
            res.append(out[0, len(prompt):].tolist())
    return res


def test_loads_packed_and_matches_transformers(case):
    name, root, hf_reads_fp8 = case
    engine = _engine(root / "fp8")
    model = _LOADED[root] = engine.runner.model
    fp8 = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert fp8 and all(m.qweight.dtype == torch.float8_e4m3fn for m in fp8)
    assert not any(p.dtype == torch.float8_e4m3fn for p in model.parameters())  # no float copy beside them
    # built with its layers' weights on "meta": every tensor was allocated for real afterwards
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    if name.startswith("deepseek"):
        experts = [m for m in model.modules() if isinstance(m, FP8Experts)]
        assert experts and all(e.w13.dtype == torch.float8_e4m3fn for e in experts)
    ours = greedy_tokens(engine, PROMPTS, STEPS)
    reference = root / ("fp8" if hf_reads_fp8 else "twin")
    assert ours == _hf_greedy(reference, PROMPTS, STEPS)


def test_logits_match_dequantized_twin(case):
    _, root, _ = case
    ids = PROMPTS[0]
    toks, logits = run_capturing_logits(_engine(root / "fp8"), ids, 4)
    twin_toks, twin_logits = run_capturing_logits(_engine(root / "twin"), ids, 4)
    assert toks == twin_toks
    for a, b in zip(logits, twin_logits, strict=True):
        torch.testing.assert_close(a, b, **LOGIT_TOL)


def test_fp8_weight_bytes_are_half_of_bf16(case):
    _, root, _ = case
    model = _LOADED[root]
    layers = [m for m in model.modules() if isinstance(m, (FP8Linear, FP8Experts))]
    params = sum(m.num_weight_params() for m in layers)
    weights = sum(m.qweight.nbytes if isinstance(m, FP8Linear) else m.w13.nbytes + m.w2.nbytes for m in layers)
    held = sum(m.weight_bytes()[0] for m in layers)  # weights + scale grids
    assert weights * 2 == params * torch.finfo(torch.bfloat16).bits // 8
    # the scale grids: 4 bytes per 128x128 block, or per 128 weights where shards sit off the grid
    assert held < 0.5 * params * 2 * (1 + 4 / 128 + 0.01)


@pytest.mark.parametrize("name", ["qwen3-edge", "deepseek-edge"])
def test_w8a8_path(name, tmp_path_factory, monkeypatch):
    """The GPU path (activations quantized per token and 128 channels, the W8A8 Triton GEMM and, for
    DeepSeek's experts, the FP8 fused MoE; here in the interpreter) on the same model equals the same
    W8A8 computation done by the plain-torch references (1e-4), and stays within 10% (relative L2) of
    the dequantized twin's logits: the error of e4m3 activations (3 mantissa bits, up to 1/16 relative
    each) through a few random layers."""
    from tokenfab.kernels import moe_fp8, quant
    from tokenfab.quant import fp8_experts

    _, root, _ = _build(name, tmp_path_factory)  # odd shapes; the interpreter is slow, so two cases
    w8a8 = lambda t, native=False: "triton"  # noqa: E731
    monkeypatch.setattr(quant, "backend", w8a8)  # the FP8 layers take the W8A8 route
    monkeypatch.setattr(fp8_experts, "backend", w8a8)
    _, w8a8_ref = run_capturing_logits(_engine(root / "fp8"), PROMPTS[1], 2)
    monkeypatch.setattr(quant, "use_triton", lambda t: True)  # ... and their ops run the Triton kernels
    monkeypatch.setattr(moe_fp8, "use_triton", lambda t: True)
    _, w8a8 = run_capturing_logits(_engine(root / "fp8"), PROMPTS[1], 2)
    monkeypatch.undo()
    _, twin = run_capturing_logits(_engine(root / "twin"), PROMPTS[1], 2)
    for a, r, b in zip(w8a8, w8a8_ref, twin, strict=True):
        torch.testing.assert_close(a, r, **LOGIT_TOL)
        assert float((a - b).norm() / b.norm()) < 0.10


def test_scale_fmt_ue8m0_reaches_the_layers(tmp_path):
    """DeepSeek-V3.1's ``scale_fmt: "ue8m0"``: every FP8 layer quantizes its activations with
    power-of-two scales (the kernel's ue8m0 path, tested in tests/kernels/test_quant.py)."""
    save_tiny_model(tiny_config("qwen3", architectures=["Qwen3ForCausalLM"]), tmp_path / "src")
    write_fp8_block_checkpoint(tmp_path / "src", tmp_path / "fp8", scale_fmt="ue8m0")
    model = _engine(tmp_path / "fp8").runner.model
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert layers and all(m.ue8m0 for m in layers)
    assert "ue8m0" in model.quant_method.describe()


@pytest.mark.parametrize("layers", [1, pytest.param(None, marks=pytest.mark.slow)])
def test_fp8_model_compiles_fullgraph(tmp_path_factory, layers):
    """An FP8 model's forward (DeepSeek: FP8 linears, FP8 experts, MLA reading the dequantized kv_b_proj)
    traces as one graph and gives the eager logits. Fast tier: the edge case's shapes in one MoE layer
    (attention, shared and routed experts all FP8); slow twin: the whole 3-layer edge model (a dense layer too)."""
    if layers is None:
        _, root, _ = _build("deepseek-edge", tmp_path_factory)
    else:
        root = tmp_path_factory.mktemp("deepseek-edge-1layer")
        save_tiny_deepseek(root / "src", num_hidden_layers=layers, first_k_dense_replace=0, **CASES["deepseek-edge"][1])
        write_fp8_block_checkpoint(root / "src", root / "fp8")
    got, expected = compiled_and_eager_logits(_engine(root / "fp8"), "aot_eager")
    torch.testing.assert_close(got, expected, **LOGIT_TOL)


def test_quantized_build_never_allocates_the_float_weights(tmp_path, monkeypatch):
    """The float weights of the layers FP8 replaces are never allocated: building the model for a
    quantized checkpoint creates them on "meta"; tied embeddings stay tied after materializing."""
    from tokenfab.loader import model_loader

    seen: list[torch.device] = []
    original = model_loader.apply_quant_method

    def spy(model, method):
        seen.extend(m.weight.device for m in model.modules() if type(m).__name__ in ("Linear", "MergedLinear"))
        return original(model, method)

    monkeypatch.setattr(model_loader, "apply_quant_method", spy)
    save_tiny_model(tiny_config("qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True),
                    tmp_path / "src")
    write_fp8_block_checkpoint(tmp_path / "src", tmp_path / "fp8")
    model = _engine(tmp_path / "fp8").runner.model
    assert seen and all(d.type == "meta" for d in seen)
    assert model.lm_head.weight is model.model.embed_tokens.weight
