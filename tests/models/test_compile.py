"""A model forward traces as one graph through our custom ops (their fake implementations
let torch.compile see shapes without running kernels) and gives the eager result."""

from __future__ import annotations

import torch

from tests.tiny_models import save_tiny_model, tiny_config
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.sequence import Sequence


def test_forward_compiles_fullgraph(tmp_path):
    save_tiny_model(tiny_config("qwen3", num_hidden_layers=1), tmp_path)
    eng = LLMEngine(model=str(tmp_path), num_kv_blocks=16, block_size=4)
    seqs = [Sequence(f"s{i}", None, list(range(1, n + 1)), SamplingParams(), 0) for i, n in enumerate((5, 3))]
    for s in seqs:
        eng.block_manager.allocate(s, s.num_tokens)
    batch = eng.runner.prepare(seqs, [s.num_tokens for s in seqs], [True, True])
    model = eng.runner.model
    with torch.inference_mode():
        expected = model.compute_logits(model(batch)[batch.logits_indices])
        compiled = torch.compile(lambda b: model.compute_logits(model(b)[b.logits_indices]), fullgraph=True,
                                 backend="inductor")
        got = compiled(batch)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    ops = {n.split(".")[0] for n in torch.ops.tokenfab.__dir__() if not n.startswith("_")}
    assert {"rms_norm", "add_rms_norm", "rotary_embedding", "silu_and_mul", "store_kv", "paged_attention"} <= ops
