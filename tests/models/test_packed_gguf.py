"""The bundled model with its GGUF weights kept packed (``--quantization gguf``): the packed rows are
the file's bytes (no float32 copy of a packed weight exists), greedy output equals transformers
in float32 (alone and batched), the int8-activation mode equals its emulating reference, and
``--quantization none`` still dequantizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenfab import LLM, SamplingParams
from tokenfab.bench.prompts import CHATS, TEXT_PROMPTS
from tokenfab.kernels.cpu.ggml_matmul import ggml_dequantize_rows, ggml_matmul_reference
from tokenfab.layers import ggml_linear
from tokenfab.layers.embedding import LMHead, VocabEmbedding
from tokenfab.layers.ggml_linear import GGMLEmbedding, GGMLLinear, GGMLLMHead, packed_bytes
from tokenfab.layers.linear import Linear
from tokenfab.loader.bundled import bundled_model_path
from tokenfab.loader.gguf import load_gguf
from tokenfab.loader.model_loader import load_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def packed_model():
    return load_model(None, torch.float32, CPU, 256, load_tokenizer=False, quantization="gguf").model


@pytest.fixture(scope="module")
def plain_model():
    return load_model(None, torch.float32, CPU, 256, load_tokenizer=False, quantization="none").model


def test_packed_weights_are_the_files_bytes(packed_model):
    reader = load_gguf(bundled_model_path())
    file_bytes = {e.hf_name: int(e.tensor.n_bytes) for e in reader._entries}
    types = reader.ggml_types()
    m = packed_model
    # no float32 (or any 2-D float) linear/embedding weight is left
    assert not [n for n, p in m.named_parameters() if p.dim() > 1]
    assert not [n for n, mod in m.named_modules() if isinstance(mod, Linear | LMHead | VocabEmbedding)]
    emb = m.model.embed_tokens
    assert isinstance(emb, GGMLEmbedding) and emb.qtype == "Q8_0"
    assert emb.qweight.dtype == torch.uint8 and emb.qweight.nbytes == file_bytes["model.embed_tokens.weight"]
    assert emb.qweight.nbytes == 49152 * 576 // 32 * 34
    head = m.lm_head
    assert isinstance(head, GGMLLMHead) and head.qweight.data_ptr() == emb.qweight.data_ptr()  # tied: one copy
    for i, layer in enumerate(m.model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        for mod, names in ((attn.qkv_proj, ["q_proj", "k_proj", "v_proj"]), (attn.o_proj, ["o_proj"]),
                           (mlp.gate_up_proj, ["gate_proj", "up_proj"]), (mlp.down_proj, ["down_proj"])):
            full = [p + ("self_attn." if n[0] in "qkvo" else "mlp.") + n + ".weight" for n in names]
            assert isinstance(mod, GGMLLinear) and mod.qtype == "Q4_1"
            assert all(types[f] == "Q4_1" for f in full)
            assert mod.qweight.nbytes == sum(file_bytes[f] for f in full)
    nbytes, numel = packed_bytes(m)
    assert numel == sum(int(np.prod(e.shape)) for e in reader._entries)
    assert nbytes == sum(file_bytes.values())  # every byte of the file's tensors, once, nothing more
    assert nbytes / numel < 0.75  # bytes per parameter (float32: 4)


def test_packed_rows_dequantize_to_the_plain_weights(packed_model, plain_model):
    """The packed rows (q/k un-permuted as whole rows) hold exactly the dequantized weights."""
    for (name, mod) in packed_model.named_modules():
        if not isinstance(mod, GGMLLinear) or isinstance(mod, GGMLLMHead):
            continue
        ref = plain_model.get_submodule(name).weight
        rows = torch.arange(mod.out_features)
        got = ggml_dequantize_rows(mod.qweight, mod.qtype, mod.in_features, rows)
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    ids = torch.tensor([0, 1, 5, 49151, 5])
    emb = packed_model.model.embed_tokens(ids)
    torch.testing.assert_close(emb, plain_model.model.embed_tokens(ids), rtol=0, atol=0)


@pytest.fixture(scope="module")
def llm_packed():
    llm = LLM(quantization="gguf", max_num_batched_tokens=512)
    assert isinstance(llm.engine.model.lm_head, GGMLLMHead)
    return llm


@pytest.fixture(scope="module")
def prompts(llm_packed):
    tok = llm_packed.tokenizer
    return [tok.encode(p) for p in TEXT_PROMPTS] + [llm_packed.apply_chat_template(c) for c in CHATS]


def test_the_default_llm_runs_packed():
    """``LLM()`` on the bundled model runs packed when the native kernels build, so the greedy
    comparison with transformers in tests/models/test_bundled_vs_transformers.py covers this path
    (alone, batched, chunked prefill); it is not repeated here."""
    from tokenfab.kernels.cpu import native_library

    if native_library() is None:
        pytest.skip("no native CPU kernels here: the default falls back to float32 weights")
    llm = LLM(max_num_batched_tokens=64)
    assert isinstance(llm.engine.model.lm_head, GGMLLMHead)
    assert isinstance(llm.engine.model.model.layers[0].mlp.down_proj, GGMLLinear)


def test_quantization_none_still_dequantizes(llm_packed, prompts):
    """The float32 path of before gives the packed path's greedy tokens (which are transformers'
    tokens: test_bundled_vs_transformers, on the default = packed path). 12 tokens: the 64-token
    drift check against transformers' float32 greedy tokens is that test's one-batch run."""
    llm = LLM(quantization="none", max_num_batched_tokens=512)
    assert isinstance(llm.engine.model.lm_head, LMHead) and llm.engine.model.lm_head.weight.dtype == torch.float32
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params)]
    assert plain == [o.outputs[0].token_ids for o in llm_packed.generate(prompts[:3], params)]


@pytest.fixture(scope="module")
def q8_llm():
    return LLM(quantization="gguf-q8act", max_num_batched_tokens=512)


def check_q8_products(llm: LLM, prompts: list[list[int]], max_tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    native = ggml_linear.ggml_matmul
    seen = []

    def both(x, w, qtype, k, act="f32"):
        got, ref = native(x, w, qtype, k, act=act), ggml_matmul_reference(x, w, qtype, k, act=act)
        seen.append((act, tuple(x.shape)))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        return got

    with monkeypatch.context() as mp:
        mp.setattr(ggml_linear, "ggml_matmul", both)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    assert {a for a, _ in seen} == {"q8"} and any(s[0] > 4 for _, s in seen) and any(s[0] <= 4 for _, s in seen)


def test_q8_activation_products_equal_the_reference_inside_the_model(q8_llm, prompts, monkeypatch):
    """Every product of a ``gguf-q8act`` generation (real weights, real activations, prefill and
    decode shapes) equals the reference (dequantize, int8 activation blocks emulated, matmul) to
    float32 summation order. Fast tier: two prompts, one decode step; the slow twin: four tokens."""
    check_q8_products(q8_llm, prompts[:2], 2, monkeypatch)


@pytest.mark.slow
def test_q8_activation_products_equal_the_reference_inside_the_model_full(q8_llm, prompts, monkeypatch):
    check_q8_products(q8_llm, prompts[:2], 4, monkeypatch)


def check_q8_mode(llm: LLM, few: list[list[int]], max_tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(few, params)]
    with monkeypatch.context() as mp:
        mp.setattr(ggml_linear, "ggml_matmul", ggml_matmul_reference)
        ref = [o.outputs[0].token_ids for o in llm.generate(few, params)]
    assert all(len(t) == max_tokens for t in got)
    assert got == ref


def test_q8_activation_mode_equals_its_reference(q8_llm, prompts, monkeypatch):
    """``gguf-q8act`` (native int8 products) gives the greedy tokens of the same model whose
    products are the reference: dequantize, quantize the activations to int8 blocks, matmul. (The two
    agree bit for bit: both sum the block terms in float64 in one fixed order; int8 rounding is
    chaotic, so agreement to float32 summation order was not enough.) Fast tier: a short text prompt
    and the longest chat, 6 tokens; the slow twin: three prompts, 12 tokens."""
    check_q8_mode(q8_llm, prompts[:1] + prompts[-1:], 6, monkeypatch)


@pytest.mark.slow
def test_q8_activation_mode_equals_its_reference_full(q8_llm, prompts, monkeypatch):
    check_q8_mode(q8_llm, prompts[:2] + prompts[-1:], 12, monkeypatch)


@pytest.mark.parametrize("kwargs, match", [
    ({"quantization": "gguf", "dtype": "bfloat16"}, "float32"),
    ({"quantization": "int3"}, "quantization must be one of"),
])
def test_bad_quantization_arguments_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(**kwargs)


def test_quantization_gguf_refused_for_a_directory(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    with pytest.raises(ValueError, match="applies to .gguf files"):
        load_model(tmp_path, torch.float32, CPU, 64, load_tokenizer=False, quantization="gguf")


def test_memory_figures_reported(llm_packed):
    """Bytes per parameter and per KV token: in the engine's stats (the /metrics gauges)."""
    stats = llm_packed.engine.get_stats()
    assert 0.5 < stats.weight_bytes_per_param < 0.75  # Q4_1 linears + Q8_0 embedding (float32: 4)
    # SmolLM2-135M: 30 layers x (k + v) x 3 kv heads x 64 dims x 4 bytes
    assert stats.kv_bytes_per_token == 30 * 2 * 3 * 64 * 4


def test_memory_gauges_in_metrics(llm_packed):
    from tokenfab.server.metrics import ServerMetrics

    stats = llm_packed.engine.get_stats()
    text = ServerMetrics("m", stats=lambda: stats, waiting=lambda: 0).render()
    text = text.decode() if isinstance(text, bytes) else text
    assert f'tokenfab_weight_bytes_per_param{{model_name="m"}} {stats.weight_bytes_per_param}' in text
    assert 'tokenfab_kv_cache_bytes_per_token{model_name="m"} 46080.0' in text
