"""The C-driven step of a packed-GGUF Llama (``models/llama_native.py``, ``kernels/cpu/llama_step.c``):
every step of a run -- prefill chunks, decodes, both in one batch, a sliding-window layer with
contexts past its window next to short ones, Qwen2's qkv bias, Qwen3's q/k norm, Q4_0/Q4_1/Q8_0 weights, float32 and
int8 activations -- gives the Python layers' hidden states and KV cache bit for bit; the models and
settings it does not take run the Python layers; bad indices are clear errors."""

from __future__ import annotations

import pytest
import torch

from tests.loader.tiny_gguf import QT, TinySpec, write_tiny_gguf
from tests.tiny_models import run_batch, small_engine
from tokenfab.kernels.cpu import native_library
from tokenfab.models import llama_native
from tokenfab.models.llama_native import NativeLlamaStep, native_hidden

pytestmark = pytest.mark.skipif(native_library() is None, reason="the native CPU library could not be built")

PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(50, 71)), [9]]
TYPES = {"embed_tokens.weight": QT.Q8_0, "o_proj.weight": QT.Q4_0, "down_proj.weight": QT.Q8_0}


def _write(tmp_path, arch: str) -> str:
    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, TinySpec(arch=arch, n_layers=3, hidden=64, inter=96, vocab=96, types=TYPES,
                                   default_type=QT.Q4_1), tokenizer=True)
    return str(path)


def _compare_every_step(engine, monkeypatch) -> list:
    """Run each batch through the Python layers and through the C driver from the same KV cache;
    the hidden states and the cache after the step must be equal bit for bit. Returns the batches."""
    model, runner = engine.model, engine.runner
    python_forward = model.model.forward
    seen = []

    def both(batch):
        cache = runner.kv_cache
        before = cache.clone()
        monkeypatch.setenv(llama_native.ENV, "0")
        ref = python_forward(batch)
        after_ref = cache.clone()
        cache.copy_(before)
        monkeypatch.setenv(llama_native.ENV, "1")
        got = native_hidden(model, batch)
        assert got is not None, model._native_step.why_not
        assert torch.equal(got, ref)
        assert torch.equal(cache, after_ref)
        seen.append(batch)
        return got

    monkeypatch.setattr(model, "forward", both)
    return seen


@pytest.mark.parametrize("arch,quantization", [("llama", "gguf"), ("qwen2", "gguf"), ("qwen3", "gguf"),
                                               ("llama", "gguf-q8act")])
def test_every_step_equals_the_python_layers(tmp_path, monkeypatch, arch, quantization):
    engine = small_engine(_write(tmp_path, arch), quantization=quantization)
    layers = engine.model.model.layers
    assert type(layers[0].self_attn.qkv_proj).__name__ == "GGMLLinear"
    assert (layers[0].self_attn.qkv_proj.bias is not None) == (arch == "qwen2")
    assert layers[0].self_attn.qk_norm == (arch == "qwen3")
    layers[1].self_attn.attn.sliding_window = 8  # a sliding layer between full ones
    seen = _compare_every_step(engine, monkeypatch)
    run_batch(engine, PROMPTS, max_tokens=12, arrivals=[0, 0, 2, 3], logprobs=0)
    assert any(b.max_query_len == 1 for b in seen)  # decode-only steps
    assert any(b.max_query_len > 1 and b.num_seqs > 1 for b in seen)  # prefill chunks beside decodes
    assert max(b.max_context_len for b in seen) > 8 + 16  # contexts far past the window...
    assert min(int(b.context_lens.min()) for b in seen) < 8  # ...batched with ones inside it


def test_python_layers_run_where_the_driver_cannot(tmp_path, monkeypatch):
    engine = small_engine(_write(tmp_path, "llama"))
    model = engine.model
    run_batch(engine, PROMPTS[:2], max_tokens=2, logprobs=0)
    assert model._native_step.why_not is None
    calls = []
    orig = NativeLlamaStep.forward
    monkeypatch.setattr(NativeLlamaStep, "forward", lambda self, b: calls.append(b) or orig(self, b))
    for env, value in ((llama_native.ENV, "0"), ("TOKENFAB_KERNELS", "torch"), ("TOKENFAB_CPU_NATIVE", "0")):
        monkeypatch.setenv(env, value)
        run_batch(engine, PROMPTS[:1], max_tokens=2, logprobs=0)
        assert not calls, env
        monkeypatch.delenv(env)
    run_batch(engine, PROMPTS[:1], max_tokens=2, logprobs=0)
    assert calls
    # a model the driver does not take says why, and runs the Python layers
    engine.model.model.layers[0].self_attn.attn.softcap = 30.0
    step = NativeLlamaStep(model)
    assert "softcap" in step.why_not


def test_new_tensors_rebuild_the_tables(tmp_path):
    engine = small_engine(_write(tmp_path, "llama"))
    model = engine.model
    run_batch(engine, PROMPTS[:1], max_tokens=2, logprobs=0)
    first = model._native_step
    assert first.current()
    norm = model.model.layers[2].post_attention_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone() * 2, requires_grad=False)
    assert not first.current()
    run_batch(engine, PROMPTS[:1], max_tokens=2, logprobs=0)
    assert model._native_step is not first and model._native_step.layers[2, 1] == norm.weight.data_ptr()


def test_bad_indices_are_value_errors(tmp_path):
    engine = small_engine(_write(tmp_path, "llama"))
    model = engine.model
    batches = run_batch(engine, PROMPTS[:2], max_tokens=2, logprobs=0)[2]
    b = batches[-1]
    step = model._native_step
    with torch.inference_mode():
        assert torch.equal(step.forward(b), step.forward(b))
        for field, value, match in (("input_ids", 96, "outside the vocabulary"),
                                    ("positions", 10**6, "rotary cache"),
                                    ("slot_mapping", 10**6, "slot_mapping holds slot"),
                                    ("block_tables", 10**6, "outside the cache")):
            t = getattr(b, field).clone()
            t.view(-1)[0] = value
            bad = type(b)(**{**b.__dict__, field: t})
            with pytest.raises(ValueError, match=match):
                step.forward(bad)
