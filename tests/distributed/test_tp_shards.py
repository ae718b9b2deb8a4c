"""What each tensor-parallel rank keeps of a checkpoint, in one process (no collectives run: the
parallel state is set to "rank r of t" while the model is built and loaded, as each rank would).

For every split layer, against the full (TP 1) model loaded from the same files:
- column-parallel (plain, merged, QKV with KV heads split or replicated, FP8, INT4, GGUF packed):
  rank r's output columns of each projection equal the full layer's output columns in its range,
  and the ranks' ranges cover every column;
- row-parallel: the ranks' partial products (before the all-reduce) sum to the full output;
- vocabulary-parallel embedding / LM head: the ranks' rows, stacked, are the full table plus zero rows.
And a split that does not fall on the format's blocks is a clear load error.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tests.loader.tiny_gguf import TinySpec, write_tiny_gguf
from tests.tiny_models import save_tiny_model, tiny_config
from tokenfab.distributed import parallel_state as ps
from tokenfab.loader.errors import ModelLoadError
from tokenfab.loader.model_loader import load_model

CPU = torch.device("cpu")


def _load(path: Path, monkeypatch, rank: int = 0, tp: int = 1):
    monkeypatch.setattr(ps, "_state", ps.ParallelState(tp_rank=rank, tp_size=tp))
    try:
        return load_model(path, torch.float32, CPU, 128, load_tokenizer=False).model
    finally:
        monkeypatch.setattr(ps, "_state", ps.ParallelState())


def _rows(m, n: int) -> torch.Tensor:
    """The embedding rows of ids 0..n-1 (plain or packed), without the vocabulary-parallel reduce."""
    from tokenfab.kernels.cpu.ggml_matmul import ggml_dequantize_rows

    ids = torch.arange(n)
    if hasattr(m, "qweight"):  # packed GGUF rows
        return ggml_dequantize_rows(m.qweight, m.qtype, getattr(m, "hidden_size", None) or m.in_features, ids)
    return torch.nn.functional.embedding(ids, m.weight)


def check_shards(path: Path, tp: int, monkeypatch) -> set[str]:
    """Every split layer of ``tp`` ranks against the full model; returns the split layer classes seen."""
    full = _load(path, monkeypatch)
    ranks = [_load(path, monkeypatch, r, tp) for r in range(tp)]
    modules = [dict(m.named_modules()) for m in ranks]
    seen: set[str] = set()
    g = torch.Generator().manual_seed(0)
    for name, mod in modules[0].items():
        split = getattr(mod, "tp_split", None)
        if split is None:
            continue
        seen.add(type(mod).__name__)
        ref = full.get_submodule(name)
        parts = [mods[name] for mods in modules]
        for m in (ref, *parts):
            # compressed-tensors FP8 rounds activations through FP8 per token: at TP each rank scales by
            # its own K slice's amax (as any TP engine does), a different rounding; the weights are compared here
            if getattr(m, "cpu_act_quant", False):
                m.cpu_act_quant = False
        if "embed" in name or "lm_head" in name:
            vocab = ref.vocab_size if hasattr(ref, "vocab_size") else ref.num_embeddings
            stacked = torch.cat([_rows(p, p.tp_split.local_sizes()[0]) for p in parts])
            torch.testing.assert_close(stacked[:vocab], _rows(ref, vocab), rtol=0, atol=0)
            assert not stacked[vocab:].any(), f"{name}: padding rows are not zero"
            continue
        if split.dim == 1:
            k = split.full[0]
            x = torch.randn(5, k, generator=g)
            total = 0
            for p in parts:
                lo, hi = p.tp_split.ranges[0]
                p.reduce_output = False  # the all-reduce, summed here
                total = total + p.forward(x[:, lo:hi])
            torch.testing.assert_close(total, ref.forward(x), msg=lambda m, name=name: f"{name}: {m}")
            continue
        x = torch.randn(5, ref.in_features, generator=g)
        full_out = ref.forward(x).split(list(split.full), dim=-1)
        for i, n in enumerate(split.full):
            covered = torch.zeros(n, dtype=torch.bool)
            for p in parts:
                lo, hi = p.tp_split.ranges[i]
                out = p.forward(x).split(p.tp_split.local_sizes(), dim=-1)[i]
                torch.testing.assert_close(out, full_out[i][:, lo:hi], rtol=0, atol=0, msg=f"{name} shard {i}")
                covered[lo:hi] = True
            assert covered.all(), f"{name} shard {i}: columns no rank holds"
    return seen


@pytest.mark.parametrize("tp,kv", [(2, 2), (4, 2)])
def test_plain_llama_shards(tmp_path, monkeypatch, tp, kv):
    save_tiny_model(tiny_config("llama", num_key_value_heads=kv, attention_bias=True, vocab_size=300), tmp_path)
    seen = check_shards(tmp_path, tp, monkeypatch)
    assert seen == {"Linear", "MergedLinear", "VocabEmbedding", "LMHead"}


def test_gguf_packed_shards(tmp_path, monkeypatch):
    """Q4_1 / Q8_0 rows kept packed: column-parallel whole rows, row-parallel whole 32-element blocks
    (o_proj K 48 over 3 ranks = 16 per rank would not be whole blocks: 96 = 3 x 32 here)."""
    spec = TinySpec(n_head=6, n_kv=3, hidden=96, inter=192, vocab=100, head_dim=16,
                    types={"embed_tokens.weight": QT.Q8_0}, default_type=QT.Q4_1)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, spec)
    seen = check_shards(path, 3, monkeypatch)
    assert seen == {"GGMLLinear", "GGMLEmbedding", "GGMLLMHead"}


def test_gguf_split_off_block_boundary_is_an_error(tmp_path, monkeypatch):
    spec = TinySpec(n_head=4, n_kv=2, hidden=64, inter=128, head_dim=16, default_type=QT.Q4_1)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, spec)
    # o_proj: K 64 over 4 ranks = 16 per rank
    with pytest.raises(ModelLoadError, match="not whole 32-element Q4_1 blocks"):
        _load(path, monkeypatch, 1, 4)


@pytest.fixture(scope="module")
def fp8_qwen3(tmp_path_factory) -> Path:
    from tests.quant.layouts_fp8 import write_fp8_block_checkpoint

    root = tmp_path_factory.mktemp("fp8")
    save_tiny_model(tiny_config("qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=256, intermediate_size=256,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=128), root / "src")
    write_fp8_block_checkpoint(root / "src", root / "fp8")
    return root / "fp8"


def test_fp8_block_shards(fp8_qwen3, monkeypatch):
    assert "FP8Linear" in check_shards(fp8_qwen3, 2, monkeypatch)


def test_fp8_block_split_off_block_boundary_is_an_error(fp8_qwen3, monkeypatch):
    with pytest.raises(ModelLoadError, match="128-element blocks"):  # gate/up: 256 rows over 4 ranks, 64 each
        _load(fp8_qwen3, monkeypatch, 1, 4)


def test_fp8_channel_and_int4_shards(tmp_path, monkeypatch):
    from tests.quant.layouts_fp8 import write_ct_fp8_checkpoint
    from tests.quant.layouts_w4 import write_int4_ct_checkpoint

    save_tiny_model(tiny_config("llama", architectures=["LlamaForCausalLM"]), tmp_path / "src")
    write_ct_fp8_checkpoint(tmp_path / "src", tmp_path / "ct")
    (tmp_path / "int4").mkdir()
    write_int4_ct_checkpoint(tmp_path / "src", tmp_path / "int4", ignore=["lm_head"])
    assert "FP8Linear" in check_shards(tmp_path / "ct", 2, monkeypatch)
    assert "W4Linear" in check_shards(tmp_path / "int4", 2, monkeypatch)


def test_gpt_oss_sinks_split_with_heads(tmp_path, monkeypatch):
    from tests.moe_tiny_models import tiny_moe_config

    save_tiny_model(tiny_moe_config("gpt_oss"), tmp_path)
    full = _load(tmp_path, monkeypatch)
    ranks = [_load(tmp_path, monkeypatch, r, 2) for r in range(2)]
    for i, layer in enumerate(full.model.layers):
        sinks = [m.model.layers[i].self_attn.attn.sinks for m in ranks]
        assert sinks[0].numel() == layer.self_attn.attn.num_heads // 2
        torch.testing.assert_close(torch.cat(sinks), layer.self_attn.attn.sinks, rtol=0, atol=0)


def test_heads_that_do_not_divide_are_a_load_error(monkeypatch):
    from tokenfab.loader.bundled import bundled_model_path

    with pytest.raises(ModelLoadError, match="cannot be split for tensor parallelism: 3 KV heads and tensor parallel "
                       "size 2: neither divides the other"):
        _load(bundled_model_path(), monkeypatch, 0, 2)
