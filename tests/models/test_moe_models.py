"""MoE models (Qwen3-MoE, Qwen2-MoE, Mixtral, GPT-OSS): logits equal transformers' (fp32) at prefill and
over 5 decode steps through the paged cache; greedy generations equal alone and batched; GPT-OSS
MXFP4 expert weights dequantized at load."""

from __future__ import annotations

import json

import pytest
import torch

from tests.moe_tiny_models import mxfp4_pack, mxfp4_unpack, tiny_moe_config
from tests.tiny_models import (
    assert_batch_matches_hf,
    assert_batched_equals_alone,
    assert_step_logits_match_hf,
    hf_logits,
    paths_reached,
    run_batch,
    run_capturing_logits,
    save_tiny_model,
)
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.layers.moe import FusedMoE

CASES = ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"]
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], [1, 2, 3], list(range(30, 60))]


def _engine(path, **kw) -> LLMEngine:
    args = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64)
    return LLMEngine(model=str(path), **{**args, **kw})


@pytest.fixture(scope="module", params=CASES)
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(tiny_moe_config(request.param), path)
    return request.param, hf, _engine(path)




def test_model_structure(tiny):
    """The dense/MoE mix and the sliding/full alternation follow the config."""
    case, _, engine = tiny
    layers = engine.runner.model.model.layers
    is_moe = [isinstance(layer.mlp, FusedMoE) for layer in layers]
    windows = [layer.self_attn.attn.sliding_window for layer in layers]
    expected_moe = {"qwen3_moe": [True, False, True], "qwen2_moe": [False, True, False]}.get(case, [True] * len(layers))
    assert is_moe == expected_moe
    if case == "gpt_oss":
        assert windows == [4, 0]
        assert all(layer.self_attn.attn.sinks is not None for layer in layers)
    if case == "mixtral":
        assert windows == [7, 7]
    if case == "qwen2_moe":
        assert layers[1].mlp.shared_experts is not None and layers[1].mlp.shared_expert_gate is not None


def test_prefill_and_decode_logits_match(tiny):
    _, hf, engine = tiny
    assert_step_logits_match_hf(engine, hf, PROMPTS)


def test_batched_equals_alone(tiny):
    _, _, engine = tiny
    assert_batched_equals_alone(engine)


# contexts past the sliding window (7 Mixtral, 4 GPT-OSS) batched with shorter ones, a prompt arriving
# mid-decode and chunked prefills (8-token budget): per request, equal to transformers
WINDOW_PROMPTS = [[5, 17, 42], list(range(30, 43)), [1, 2, 3, 4, 5, 6], [250]]
WINDOW_ARRIVALS = [0, 0, 2, 4]


@pytest.mark.parametrize("case", ["mixtral", "gpt_oss"])
def test_sliding_window_batched_long_and_short(case, tmp_path):
    hf = save_tiny_model(tiny_moe_config(case), tmp_path)
    window = hf.config.sliding_window
    tokens, logprobs, batches = run_batch(_engine(tmp_path, max_num_batched_tokens=8), WINDOW_PROMPTS, 8,
                                          WINDOW_ARRIVALS)
    assert {"mixed", "chunked", "long+short decodes"} <= paths_reached(batches, window)
    assert_batch_matches_hf(hf, WINDOW_PROMPTS, tokens, logprobs)


def test_gpt_oss_mxfp4_checkpoint(tmp_path):
    """Expert matrices stored as MXFP4 blocks/scales (OpenAI's layout) load to the values they encode."""
    from safetensors.torch import load_file, save_file

    config = tiny_moe_config("gpt_oss")
    plain = tmp_path / "plain"
    hf = save_tiny_model(config, plain)
    tensors = load_file(str(plain / "model.safetensors"))
    packed = {}
    with torch.no_grad():
        for name, t in tensors.items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = mxfp4_pack(t.transpose(1, 2))  # [E, out, in] rows, as OpenAI stores them
                packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
                # the transformers model gets exactly the values the blocks encode
                hf.get_parameter(name).copy_(mxfp4_unpack(blocks, scales).transpose(1, 2))
            else:
                packed[name] = t
    q = tmp_path / "mxfp4"
    q.mkdir()
    save_file(packed, str(q / "model.safetensors"))
    cfg = json.loads((plain / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                      "model.layers.*.mlp.router"]}
    (q / "config.json").write_text(json.dumps(cfg))
    engine = _engine(q)
    prompt = PROMPTS[0]
    generated, step_logits = run_capturing_logits(engine, list(prompt), 2)
    ref = hf_logits(hf, list(prompt) + generated)
    for s, logits in enumerate(step_logits):
        torch.testing.assert_close(logits[0], ref[len(prompt) - 1 + s], atol=1e-3, rtol=0)


def test_gpt_oss_through_triton_kernels(tmp_path, monkeypatch):
    """The whole engine on the Triton kernels (interpreter on CPU): fused MoE with biases and the
    clamped SwiGLU, attention with sinks and a sliding window; logits still equal transformers'."""
    from tokenfab.kernels._launch import interpreting

    if not (torch.cuda.is_available() or interpreting()):
        pytest.skip("triton was imported without the interpreter")
    hf = save_tiny_model(tiny_moe_config("gpt_oss"), tmp_path)
    engine = _engine(tmp_path, max_num_batched_tokens=8)
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    # a context past the window (4) decoding beside short ones, prompts arriving mid-decode
    prompts, arrivals = [WINDOW_PROMPTS[1], WINDOW_PROMPTS[3], WINDOW_PROMPTS[2]], [0, 2, 3]
    tokens, logprobs, batches = run_batch(engine, prompts, 4, arrivals)
    assert {"mixed", "long+short decodes"} <= paths_reached(batches, hf.config.sliding_window)
    assert_batch_matches_hf(hf, prompts, tokens, logprobs)
