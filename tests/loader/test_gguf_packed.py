"""Packed loading of tiny GGUF files written from the format spec (tests/loader/tiny_gguf.py): which
layers run packed, what falls back to float32, the Llama q/k row un-permutation on packed rows, an
untied LM head, and the same greedy tokens as the dequantized path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tests.loader.tiny_gguf import TinySpec, write_tiny_gguf
from tokenfab import LLM, SamplingParams
from tokenfab.kernels.cpu.ggml_matmul import ggml_dequantize_rows
from tokenfab.layers.embedding import LMHead
from tokenfab.layers.ggml_linear import GGMLEmbedding, GGMLLinear, GGMLLMHead
from tokenfab.layers.linear import Linear, MergedLinear
from tokenfab.loader.model_loader import load_model

CPU = torch.device("cpu")


def _load(path: Path, quantization: str):
    return load_model(path, torch.float32, CPU, 128, load_tokenizer=False, quantization=quantization).model


def _dense(mod) -> torch.Tensor:
    if isinstance(mod, GGMLLinear):
        return ggml_dequantize_rows(mod.qweight, mod.qtype, mod.in_features, torch.arange(mod.out_features))
    return mod.weight


@pytest.mark.parametrize("tied", [True, False])
def test_mixed_types_pack_what_they_can(tmp_path: Path, tied: bool) -> None:
    spec = TinySpec(
        arch="llama", n_head=4, n_kv=2, tied=tied,
        types={"embed_tokens.weight": QT.Q8_0, "lm_head.weight": QT.Q4_0, "q_proj.weight": QT.Q4_0,
               "k_proj.weight": QT.Q4_1, "mlp.down_proj.weight": QT.BF16, "o_proj.weight": QT.F16},
        default_type=QT.Q4_1,
    )
    path = tmp_path / "llama.gguf"
    write_tiny_gguf(path, spec, tokenizer=True)
    packed, plain = _load(path, "gguf"), _load(path, "none")
    layer = packed.model.layers[0]
    # q (Q4_0) and k (Q4_1) differ: the merged qkv stays float32; F16/BF16 weights stay float32
    assert type(layer.self_attn.qkv_proj) is MergedLinear
    assert type(layer.self_attn.o_proj) is Linear and type(layer.mlp.down_proj) is Linear
    assert isinstance(layer.mlp.gate_up_proj, GGMLLinear) and layer.mlp.gate_up_proj.qtype == "Q4_1"
    assert isinstance(packed.model.embed_tokens, GGMLEmbedding) and packed.model.embed_tokens.qtype == "Q8_0"
    head = packed.lm_head
    assert isinstance(head, GGMLLMHead)
    assert head.qtype == ("Q8_0" if tied else "Q4_0")
    assert (head.qweight.data_ptr() == packed.model.embed_tokens.qweight.data_ptr()) == tied
    for name, mod in plain.named_modules():
        if isinstance(mod, Linear | LMHead):
            torch.testing.assert_close(_dense(packed.get_submodule(name)), mod.weight, rtol=0, atol=0)
    ids = torch.arange(spec.vocab)
    torch.testing.assert_close(packed.model.embed_tokens(ids), plain.model.embed_tokens(ids), rtol=0, atol=0)


def test_packed_qk_rows_are_unpermuted(tmp_path: Path) -> None:
    """All-Q8_0 Llama file: the merged qkv runs packed, its rows in HF order (llama.cpp's converter
    interleaves the rotary halves of q and k; a wrong order would differ from the plain weights)."""
    spec = TinySpec(arch="llama", n_head=4, n_kv=2, default_type=QT.Q8_0)
    path = tmp_path / "llama.gguf"
    write_tiny_gguf(path, spec, tokenizer=True)
    packed, plain = _load(path, "gguf"), _load(path, "none")
    qkv = packed.model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, GGMLLinear) and qkv.qtype == "Q8_0"
    torch.testing.assert_close(_dense(qkv), plain.model.layers[1].self_attn.qkv_proj.weight, rtol=0, atol=0)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 5, 9, 13], [7, 3, 40, 2, 11, 60, 6]]
    outs = {q: [o.outputs[0].token_ids for o in LLM(str(path), quantization=q, num_kv_blocks=32, block_size=4)
                .generate(prompts, params)] for q in ("gguf", "none")}
    assert outs["gguf"] == outs["none"]


def test_default_is_packed_and_falls_back_without_native_kernels(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "llama.gguf"
    write_tiny_gguf(path, TinySpec(arch="llama", default_type=QT.Q4_0), tokenizer=True)
    default = load_model(path, torch.float32, CPU, 128, load_tokenizer=False).model
    assert isinstance(default.model.layers[0].mlp.down_proj, GGMLLinear)
    bf16 = load_model(path, torch.bfloat16, CPU, 128, load_tokenizer=False).model  # packed needs float32
    assert type(bf16.model.layers[0].mlp.down_proj) is Linear
    monkeypatch.setenv("TOKENFAB_CPU_NATIVE", "0")
    fallback = load_model(path, torch.float32, CPU, 128, load_tokenizer=False).model
    assert type(fallback.model.layers[0].mlp.down_proj) is Linear
