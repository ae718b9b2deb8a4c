"""FP8 KV cache in the engine (issue 13): flags, per-dtype cache allocation and binding, first-batch
calibration, the bytes-per-token figure, end-to-end runs (tokenfab/quant/kv_fp8.py,
engine/runner/model_runner.py, layers/attention.py).

The reference for what the cache holds is the definition: a value x is stored as
e4m3(clamp(x / scale, +-448)) with scale = amax(first batch) / 448, so it reads back within half an
e4m3 step of x (2^-4 relative, or half the smallest subnormal step, scale * 2^-10), and the first
batch's largest value is stored as exactly +-448.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.tiny_models import run_capturing_logits, save_tiny_model, tiny_config
from tokenfab.engine.args import EngineArgs
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.quant.kv_fp8 import parse_kv_cache_dtype, parse_skip_layers

FP8 = torch.float8_e4m3fn


def test_flag_values_and_errors():
    assert parse_kv_cache_dtype("auto") is None and parse_kv_cache_dtype(None) is None
    assert parse_kv_cache_dtype("fp8") is FP8 and parse_kv_cache_dtype("FP8_E4M3") is FP8
    assert parse_skip_layers("0, 3,sliding_window") == ({0, 3}, True)
    assert parse_skip_layers([1, "2"]) == ({1, 2}, False)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3; got 'int8'"):
        EngineArgs(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="e5m2 is not supported"):
        EngineArgs(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="layer indices and/or 'sliding_window', not 'full'"):
        EngineArgs(kv_cache_dtype="fp8", kv_cache_dtype_skip_layers="0,full")
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["m", "--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "0,sliding_window"]))
    assert (args.kv_cache_dtype, args.kv_cache_dtype_skip_layers) == ("fp8", "0,sliding_window")
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--kv-cache-dtype", "int4"])


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(model=str(path), num_kv_blocks=32, block_size=4, max_num_batched_tokens=64, **kw)


def test_fp8_cache_layers_bytes_and_calibration(tmp_path):
    """A tiny Qwen2 with one sliding-window layer of three: with --kv-cache-dtype fp8 and
    --kv-cache-dtype-skip-layers sliding_window the two full layers store e4m3 (one tensor for them,
    one float32 tensor for the window layer), bytes per token count each layer's dtype, the caches hold
    the definition's values and the logits stay close to the float32 cache's."""
    cfg = tiny_config("qwen2", num_hidden_layers=3, use_sliding_window=True, sliding_window=8,
                      layer_types=["full_attention", "sliding_attention", "full_attention"])
    save_tiny_model(cfg, tmp_path)
    ref = _engine(tmp_path)
    fp8 = _engine(tmp_path, kv_cache_dtype="fp8", kv_cache_dtype_skip_layers="sliding_window")
    layers = [m.self_attn.attn for m in fp8.model.model.layers]
    assert [a.k_cache.dtype for a in layers] == [FP8, torch.float32, FP8]
    assert {d: tuple(t.shape[:2]) for d, t in fp8.runner.kv_caches.items()} == {torch.float32: (1, 2), FP8: (2, 2)}
    per_layer = 2 * 2 * 16  # k and v, 2 kv heads of 16
    assert ref.memory["kv_bytes_per_token"] == 3 * per_layer * 4
    assert fp8.memory["kv_bytes_per_token"] == 2 * per_layer * 1 + per_layer * 4
    assert layers[1].k_scale is None and fp8.runner.kv_calibrating

    prompt = [(7 * i + 3) % 320 for i in range(21)]  # crosses the window and several blocks
    _, ref_logits = run_capturing_logits(ref, prompt, 6)
    tokens, logits = run_capturing_logits(fp8, prompt, 6)
    assert len(tokens) == 6 and not fp8.runner.kv_calibrating
    assert all(a.kv_calibrate is False for a in layers)
    # layer 0 saw the same keys/values in both engines: the fp8 cache is their rounding
    slots = torch.arange(len(prompt))  # the first request's blocks are 0.. in order (fresh block manager)
    for name in ("k", "v"):
        exact = getattr(ref.model.model.layers[0].self_attn.attn, f"{name}_cache").flatten(0, 1)[slots].float()
        attn = layers[0]
        stored = getattr(attn, f"{name}_cache").flatten(0, 1)[slots].float()
        scale = getattr(attn, f"{name}_scale")
        torch.testing.assert_close(scale, (exact.abs().amax() / 448).reshape(1), rtol=1e-6, atol=0)
        assert stored.abs().max() == 448  # the first batch's amax
        assert ((stored * scale - exact).abs() <= exact.abs() * 2**-4 + scale * 2**-10).all()
    for a in (layers[0], layers[2]):  # each FP8 layer calibrated on its own first batch
        assert a.k_cache.flatten(0, 1)[slots].float().abs().max() == 448
    first = torch.log_softmax(logits[0], -1)
    expected = torch.log_softmax(ref_logits[0], -1)
    assert (first - expected).abs().max() < 0.1, float((first - expected).abs().max())


def test_skip_layer_index_out_of_range(tmp_path):
    save_tiny_model(tiny_config("llama"), tmp_path)
    with pytest.raises(ValueError, match="layer 5 is out of range .*0..1"):
        _engine(tmp_path, kv_cache_dtype="fp8", kv_cache_dtype_skip_layers="5")
    engine = _engine(tmp_path, kv_cache_dtype="fp8", kv_cache_dtype_skip_layers="-1")  # the last layer
    assert [m.self_attn.attn.k_cache.dtype for m in engine.model.model.layers] == [FP8, torch.float32]


@pytest.mark.slow  # ~9 s (bfloat16 on CPU)
def test_bfloat16_model_halves_bytes_per_token(tmp_path):
    save_tiny_model(tiny_config("llama"), tmp_path)
    bf16 = _engine(tmp_path, dtype="bfloat16")
    fp8 = _engine(tmp_path, dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    assert bf16.memory["kv_bytes_per_token"] == 2 * fp8.memory["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    tokens, _ = run_capturing_logits(fp8, [3, 1, 4, 1, 5, 9, 2, 6], 4)  # bf16 queries over the e4m3 cache (C kernel)
    assert len(tokens) == 4


@pytest.mark.slow
def test_triton_kernels_through_the_engine(tmp_path, monkeypatch):
    """The engine's FP8 plumbing through the Triton kernels (the interpreter here; what a GPU runs):
    store_kv quantizing with the bound scales, the prefill and decode kernels reading them. Same tokens
    as the native CPU path over the same FP8 cache, logits equal to float32 rounding."""
    save_tiny_model(tiny_config("llama"), tmp_path)
    prompt = [(5 * i + 2) % 320 for i in range(19)]
    native_tokens, native_logits = run_capturing_logits(_engine(tmp_path, kv_cache_dtype="fp8"), prompt, 4)
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    from tokenfab.kernels import attention

    calls = []
    for name in ("_prefill_attention_triton", "_paged_decode_attention_triton"):
        orig = getattr(attention, name)
        monkeypatch.setattr(attention, name, lambda *a, _o=orig, _n=name, **k: calls.append(_n) or _o(*a, **k))
    tokens, logits = run_capturing_logits(_engine(tmp_path, kv_cache_dtype="fp8"), prompt, 4)
    assert {"_prefill_attention_triton", "_paged_decode_attention_triton"} <= set(calls)
    assert tokens == native_tokens
    for a, b in zip(logits, native_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


BUNDLED_KV_FP8 = 30 * 2 * 3 * 64  # SmolLM2-135M: 30 layers, K and V, 3 kv heads of 64, one byte each


@pytest.mark.slow
def test_bundled_model_fp8_llm_prefix_cache_and_chunked_prefill():
    """LLM(kv_cache_dtype="fp8") on the bundled model: a quarter of float32's bytes per token, so four
    times the blocks in the same memory; greedy generation through chunked prefill (chunks of 32), then the
    same prompt again served from the prefix cache gives the same tokens; a plain fact stays right."""
    from tokenfab import LLM, SamplingParams

    budget = 48 << 20
    llm = LLM(kv_cache_dtype="fp8", max_num_batched_tokens=32, max_model_len=512, kv_cache_memory=budget)
    eng = llm.engine
    assert eng.memory["kv_bytes_per_token"] == BUNDLED_KV_FP8
    assert eng.block_manager.num_blocks == budget // (BUNDLED_KV_FP8 * 16)  # float32: 46080 B/token, 68 blocks
    greedy = SamplingParams(temperature=0, max_tokens=16)
    long_prompt = "Here is a short story about a lighthouse keeper who finds a message in a bottle. " * 6
    first = llm.generate(long_prompt, greedy)[0]
    assert len(first.prompt_token_ids) > 96 and len(first.outputs[0].token_ids) == 16
    computed = eng.computed_prompt_tokens_total
    again = llm.generate(long_prompt, greedy)[0]
    assert eng.computed_prompt_tokens_total - computed < 16  # all but the last partial block were cached
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert "Paris" in llm.generate("The capital of France is", greedy)[0].outputs[0].text


@pytest.mark.slow
def test_serve_with_fp8_kv_cache_reports_bytes_per_token():
    """`tokenfab serve --kv-cache-dtype fp8`: the start-up log and /metrics show 11,520 bytes per token
    (float32: 46,080) and the server answers."""
    import httpx

    from tests.server.conftest import metric
    from tests.server.test_cli_server import API_KEY, ServeProcess

    server = ServeProcess("--kv-cache-dtype", "fp8", "--max-model-len", "512", "--max-num-seqs", "4",
                          "--kv-cache-memory", str(64 << 20), "--no-access-log")
    try:
        assert f"KV cache {BUNDLED_KV_FP8} bytes/token" in server.output
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=120) as http:
            assert metric(http.get("/metrics").text, "tokenfab_kv_cache_bytes_per_token") == BUNDLED_KV_FP8
            body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8,
                    "temperature": 0}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert "Paris" in r.json()["choices"][0]["text"]
    finally:
        server.stop()
