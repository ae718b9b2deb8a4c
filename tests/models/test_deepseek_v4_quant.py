"""DeepSeek-V4 in its released quantized layout (block FP8 linears with ue8m0 ``.scale`` grids, FP4 routed experts
with E8M0 scales per 32): the tiny model of ``dsv4_tiny`` written quantized by ``dsv4_quant`` (from the format,
not from our loader) loads packed (FP8Linear, the MXFP4 experts of the W4A16 kernels) and its logits equal
transformers' DeepseekV4 in fp32 on the dequantized tensors, prefill and every decode step; greedy tokens are
identical. transformers' own FP8/FP4 dequantization of the same files gives the same model, so the files are
what transformers reads. Malformed files are refused naming the file and the tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.dsv4_quant import (
    dequantize_fp4,
    load_reference,
    quantize_fp4,
    quantize_mtp_shard,
    save_tiny_dsv4_quantized,
)
from tests.models.dsv4_tiny import DSV4_TINY, dsv4_engine, one_torch_thread
from tests.tiny_models import assert_batch_matches_hf, hf_logits, run_batch, run_capturing_logits
from tokenfab.layers.linear import Linear
from tokenfab.loader.errors import ModelLoadError
from tokenfab.quant.fp4_experts import PerExpertFp4Experts
from tokenfab.quant.fp8_block import FP8Linear
from tokenfab.quant.fp8_experts import FP8Experts

PROMPTS = [list(range(30, 60)), [5, 17, 42], [7, 250, 3, 9, 77, 12, 5, 6, 1, 4, 100, 101, 102]]


_engine = dsv4_engine


@pytest.fixture(autouse=True)
def _one_thread():
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4q") / "q"
    official, twin = save_tiny_dsv4_quantized(path)
    return path, official, load_reference(twin), _engine(path)


def _assert_steps_match(engine, ref, prompts, steps: int = 8) -> None:
    for prompt in prompts:
        generated, step_logits = run_capturing_logits(engine, list(prompt), steps)
        step_logits = [row for row in step_logits if row.shape[0]]
        full = list(prompt) + generated
        expected = hf_logits(ref, full)
        assert len(step_logits) == steps
        for s, logits in enumerate(step_logits):
            pos = len(prompt) - 1 + s
            torch.testing.assert_close(logits[0], expected[pos], atol=1e-4, rtol=0)
            assert int(expected[pos].argmax()) == full[pos + 1]


def test_fp4_codes_round_trip():
    """The helper's FP4 writer against the format: every E2M1 value times a power of two comes back exactly, two
    codes a byte with element 2j in the low nibble."""
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, 6.0])
    w = torch.cat([values, values, 4 * values, 4 * values]).reshape(1, 64).repeat(3, 1) / 8  # groups: 2^-3, 2^-1
    packed, scale = quantize_fp4(w)
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (3, 32)
    assert scale.dtype == torch.float8_e8m0fnu and tuple(scale.shape) == (3, 2)
    assert int(packed.view(torch.uint8)[0, 0]) == 0x10  # 0.0 (code 0) low, 0.5 (code 1) high
    torch.testing.assert_close(dequantize_fp4(packed, scale), w, atol=0, rtol=0)


def test_files_are_what_transformers_reads(quantized):
    """transformers 5.24 loading the quantized directory itself (FineGrainedFP8Config(dequantize=True): its FP8 and
    FP4 dequantization, ``.scale`` names, ``expert_dtype``) gives the dequantized twin's logits, and they are not
    the fp32 model's (the quantization is visible)."""
    import transformers

    path, _, ref, _ = quantized
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, quantization_config=transformers.FineGrainedFP8Config(dequantize=True)
    ).eval()
    fp32 = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent / "q-fp32"), dtype=torch.float32).eval()
    ids = PROMPTS[0]
    torch.testing.assert_close(hf_logits(hf, ids), hf_logits(ref, ids), atol=1e-5, rtol=0)
    assert (hf_logits(fp32, ids) - hf_logits(ref, ids)).abs().max() > 1e-2


def test_weights_stay_packed(quantized):
    """FP8 linears where the release has them, BF16 compressors / indexer weights / router, the routed experts as
    packed E2M1 bytes and E8M0 scale bytes (the scales as stored, not re-encoded)."""
    _, official, _, engine = quantized
    model = engine.runner.model
    attn = model.layers[1].attn
    for linear in (
        attn.wq_a,
        attn.wq_b,
        attn.wkv,
        attn.wo_a,
        attn.wo_b,
        attn.indexer.wq_b,
        model.layers[1].ffn.shared_experts.w1,
    ):
        assert isinstance(linear, FP8Linear) and linear.qweight.dtype == torch.float8_e4m3fn
    for linear in (
        attn.compressor.wkv,
        attn.compressor.wgate,
        attn.indexer.weights_proj,
        attn.indexer.compressor.wkv,
        model.layers[1].ffn.gate,
    ):
        assert type(linear) is Linear
    experts = model.layers[1].ffn.quant_experts
    assert isinstance(experts, PerExpertFp4Experts)
    assert model.layers[1].ffn.w13_weight is None
    i = DSV4_TINY["moe_intermediate_size"]
    w1 = official["layers.1.ffn.experts.5.w1.weight"].view(torch.uint8)
    w3s = official["layers.1.ffn.experts.5.w3.scale"].view(torch.uint8)
    w2 = official["layers.1.ffn.experts.5.w2.weight"].view(torch.uint8)
    assert torch.equal(experts.w13_q[5, :i], w1) and torch.equal(experts.w13_s[5, i:], w3s)
    assert torch.equal(experts.w2_q[5], w2)
    assert "MXFP4 experts" in model.quant_method.describe()


def test_prefill_and_decode_logits_match(quantized):
    """Each prompt alone: the prefill's last logits and 7 decode steps equal transformers' on the dequantized
    tensors (fp32), and the tokens are its argmax."""
    _, _, ref, engine = quantized
    _assert_steps_match(engine, ref, PROMPTS)


def test_batched_chunked_greedy_matches(quantized):
    """Long and short prompts arriving while others decode, in 7-token chunks: every request equals transformers."""
    path, _, ref, _ = quantized
    prompts = [list(range(30, 53)), [5, 17, 42], list(range(100, 111)), [250]]
    engine = _engine(path, max_num_batched_tokens=7)
    tokens, logprobs, _ = run_batch(engine, prompts, 6, [0, 0, 2, 5])
    assert_batch_matches_hf(ref, prompts, tokens, logprobs)


@pytest.mark.parametrize("variant", ["expert_dtype_in_qc", "fp8_experts"])
def test_layout_variants(tmp_path, variant):
    """V4.1 puts ``expert_dtype`` inside quantization_config; V4-Flash-Base (per vLLM) has FP8 block experts and
    float32 scale grids. Both load and match their dequantized reference."""
    kw = {"expert_dtype_in_qc": True} if variant == "expert_dtype_in_qc" else {"expert_dtype": "fp8"}
    _, twin = save_tiny_dsv4_quantized(tmp_path / "q", seed=1, **kw)
    engine = _engine(tmp_path / "q")
    experts = engine.runner.model.layers[2].ffn.quant_experts
    assert isinstance(experts, PerExpertFp4Experts if variant == "expert_dtype_in_qc" else FP8Experts)
    _assert_steps_match(engine, load_reference(twin), PROMPTS[:1], steps=3)


# ------------------------------------------------------------------ malformed files


def _rewrite(src, dst, edit_tensors=None, edit_config=None):
    """Copy the quantized checkpoint ``src`` to ``dst`` with its tensors and/or config edited."""
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _load(path):
    from tokenfab.loader.model_loader import load_model

    return load_model(path, torch.float32, torch.device("cpu"), load_tokenizer=False)


def test_wrong_expert_scale_shape_names_file_and_tensor(quantized, tmp_path):
    src = quantized[0]
    name = "layers.2.ffn.experts.3.w1.scale"
    bad = _rewrite(src, tmp_path / "bad", lambda t: t.__setitem__(name, t[name][:, :1].contiguous()))
    with pytest.raises(
        ModelLoadError, match=rf"model\.safetensors: tensor {name}: .*shape \(32, 1\), expected \(32, 2\)"
    ):
        _load(bad)


def test_wrong_fp8_scale_shape_names_file_and_tensor(quantized, tmp_path):
    src = quantized[0]
    name = "layers.1.attn.wq_b.scale"
    bad = _rewrite(src, tmp_path / "bad", lambda t: t.__setitem__(name, t[name].repeat(2, 1).contiguous()))
    with pytest.raises(
        ModelLoadError, match=rf"model\.safetensors: tensor {name}: .*shape \(2, 1\), expected \(1, 1\)"
    ):
        _load(bad)


def test_expert_scale_in_a_wrong_dtype_is_refused(quantized, tmp_path):
    src = quantized[0]
    name = "layers.0.ffn.experts.1.w2.scale"
    bad = _rewrite(src, tmp_path / "bad", lambda t: t.__setitem__(name, t[name].float()))
    with pytest.raises(ModelLoadError, match=rf"model\.safetensors: tensor {name}: FP4 expert scale w2 is float32"):
        _load(bad)


def test_nan_expert_scale_is_refused(quantized, tmp_path):
    name = "layers.3.ffn.experts.0.w3.scale"

    def nan(t):
        t[name] = t[name].view(torch.uint8).clone()
        t[name][1, 0] = 0xFF
        t[name] = t[name].view(torch.float8_e8m0fnu)

    with pytest.raises(ModelLoadError, match=rf"model\.safetensors: tensor {name}: .*0xFF, E8M0's NaN"):
        _load(_rewrite(quantized[0], tmp_path / "bad", nan))


@pytest.mark.parametrize(
    "name, missing",
    [
        ("layers.1.attn.wq_b.scale", "layers.1.attn.wq_b.weight_scale_inv"),
        ("layers.3.ffn.experts.6.w3.scale", "layers.3.ffn.quant_experts.experts.6.w3.scale"),
    ],
)
def test_missing_scale_is_named(quantized, tmp_path, name, missing):
    src = quantized[0]
    bad = _rewrite(src, tmp_path / "bad", lambda t: t.pop(name))
    with pytest.raises(ModelLoadError, match=rf"bad: missing tensors: .*{missing.replace('.', '[.]')}"):
        _load(bad)


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda c: c.__setitem__("expert_dtype", "int4"), "expert_dtype 'int4' is not supported; fp4 and fp8 are"),
        (
            lambda c: c["quantization_config"].__setitem__("weight_block_size", [64, 64]),
            r"weight_block_size \[64, 64\] is not supported",
        ),
        (lambda c: c["quantization_config"].__setitem__("quant_method", "fp6"), "quantization_config is fp6"),
    ],
)
def test_unsupported_quantization_names_config(quantized, tmp_path, edit, problem):
    bad = _rewrite(quantized[0], tmp_path / "bad", edit_config=edit)
    with pytest.raises(ModelLoadError, match=rf"config\.json: unsupported quantized checkpoint: .*{problem}"):
        _load(bad)


@pytest.mark.slow
def test_through_triton_kernels(quantized, monkeypatch):
    """Every op on its Triton kernel (the interpreter here: 2 minutes, hence slow; the kernels' own interpreter tests
    are the fast twins): the FP8 linears run the W8A8 GEMM (activations quantized per token and 128 channels, ue8m0
    scales), the FP4 experts ``moe_w4a16`` with the mxfp4 codec and the clamped SiLU. Equal, token for token and in
    log-probabilities, to the PyTorch path with the activations rounded through float8 the same way."""
    from tokenfab.kernels._launch import interpreting

    if not (torch.cuda.is_available() or interpreting()):
        pytest.skip("triton was imported without the interpreter")
    path = quantized[0]
    prompts = [list(range(30, 50)), [5, 17, 42]]
    w8a8_ref = _engine(path, max_num_batched_tokens=16)
    for m in w8a8_ref.runner.model.modules():
        if isinstance(m, FP8Linear):
            m.cpu_act_quant = True
    want_tokens, want_lps, _ = run_batch(w8a8_ref, prompts, 3, [0, 1])
    engine = _engine(path, max_num_batched_tokens=16)
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    tokens, logprobs, _ = run_batch(engine, prompts, 3, [0, 1])
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_lps):
        for g, w in zip(got, want):
            assert g.keys() == w.keys()
            torch.testing.assert_close(
                torch.tensor(list(g.values())), torch.tensor(list(w.values())), atol=1e-3, rtol=0
            )


def test_mtp_layer_of_a_quantized_release(tmp_path):
    """The release's MTP layer (``mtp.0.*``: FP8 linears, ``e_proj``/``h_proj`` among them, and FP4 experts, as a
    block has them) loads in the target's format, kept packed, and drafts exactly what the same layer dequantized
    drafts, step by step, and the outputs are the dequantized model's."""
    from tests.models.dsv4_tiny import save_tiny_dsv4_mtp
    from tests.speculative.spec_cases import outputs, record_drafts
    from tokenfab import LLM

    path = tmp_path / "q"
    _, twin = save_tiny_dsv4_quantized(path)
    save_tiny_dsv4_mtp(path)
    quantize_mtp_shard(path, twin)
    kw = dict(block_size=4, num_kv_blocks=96, cpu_threads=1)
    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    spec, twin_spec = (
        LLM(model=str(path), speculative_config=mtp, **kw),
        LLM(model=str(twin), speculative_config=mtp, **kw),
    )
    layer = spec.engine.spec.proposer.layer
    assert isinstance(layer.e_proj, FP8Linear) and isinstance(layer.block.attn.wq_a, FP8Linear)
    assert isinstance(layer.block.ffn.quant_experts, PerExpertFp4Experts)
    seen, twin_seen = record_drafts(spec), record_drafts(twin_spec)
    prompts = [list(range(30, 45)), [5, 17, 42]]
    got = outputs(spec, prompts, 6)
    assert got == outputs(twin_spec, prompts, 6)  # and the twin's equal transformers' (test_prefill_and_decode...)
    assert len(seen) >= 6 and seen == twin_seen  # (random weights: whether drafts are accepted is chance)
