"""compressed-tensors ``float-quantized`` FP8 (per-channel weight scales; dynamic per-token or static
per-tensor activation scales), written by tests/quant/layouts_fp8.py from the format description:
a tiny Qwen3 (MLP 200 wide, hidden 96: K and N off the 128 grid) loads with float8 weights and gives
transformers' greedy tokens and logits. transformers (with the compressed-tensors package) runs this
format on CPU with weights and activations rounded through float8, as our CPU path does, so the
logits agree to float32 rounding (1e-4)."""

from __future__ import annotations

import pytest
import torch

from tests.quant.layouts_fp8 import write_ct_fp8_checkpoint
from tests.tiny_models import hf_logits, run_capturing_logits, save_tiny_model, tiny_config
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.quant.fp8_block import FP8Linear

pytest.importorskip("compressed_tensors")

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], [1, 2, 3]]
STEPS = 6


@pytest.fixture(scope="module", params=["dynamic", "static"])
def folder(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"ct-{request.param}")
    save_tiny_model(tiny_config("qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=96, intermediate_size=200,
                                head_dim=32), root / "src")
    write_ct_fp8_checkpoint(root / "src", root / "ct", static_input=request.param == "static")
    return request.param, root / "ct"


def test_matches_transformers(folder):
    import transformers

    kind, path = folder
    engine = LLMEngine(model=str(path), block_size=4, num_kv_blocks=64, max_num_batched_tokens=64)
    layers = [m for m in engine.runner.model.modules() if isinstance(m, FP8Linear)]
    assert layers and all(m.qweight.dtype == torch.float8_e4m3fn and m.group_n == 1 for m in layers)
    assert all((m.input_scale is not None) == (kind == "static") for m in layers)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    toks, logits = run_capturing_logits(engine, PROMPTS[0], STEPS)
    ref = hf_logits(hf, PROMPTS[0] + toks[:-1])
    torch.testing.assert_close(logits[0][-1], ref[len(PROMPTS[0]) - 1], rtol=1e-4, atol=1e-4)
    for i, step in enumerate(logits[1:]):
        torch.testing.assert_close(step[-1], ref[len(PROMPTS[0]) + i], rtol=1e-4, atol=1e-4)
    out = list(PROMPTS[1])
    for _ in range(STEPS):
        out.append(int(hf_logits(hf, out)[-1].argmax()))
    engine.add_request("b", PROMPTS[1], SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    done = []
    while engine.has_unfinished_requests():
        done += engine.step()
    assert done[-1].outputs[0].token_ids == out[len(PROMPTS[1]):]
