"""A model forward traces as one graph through our custom ops (their fake implementations
let torch.compile see shapes without running kernels) and gives the eager result."""

from __future__ import annotations

import torch

from tests.tiny_models import compiled_and_eager_logits, save_tiny_model, tiny_config
from tokenfab.engine.llm_engine import LLMEngine


def test_forward_compiles_fullgraph(tmp_path):
    save_tiny_model(tiny_config("qwen3", num_hidden_layers=1), tmp_path)
    eng = LLMEngine(model=str(tmp_path), num_kv_blocks=16, block_size=4)
    got, expected = compiled_and_eager_logits(eng, "inductor")
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    ops = {n.split(".")[0] for n in torch.ops.tokenfab.__dir__() if not n.startswith("_")}
    assert {"rms_norm", "add_rms_norm", "rotary_embedding", "silu_and_mul", "store_kv", "paged_attention"} <= ops
