"""Kimi K2.5 in its official layout (tests/models/wrapped_layouts.py): a ``kimi_k25`` vision-language wrapper
config around a DeepSeek-V3 ``text_config``, the text weights under ``language_model.*``, a vision tower and
projector beside them, plain fp32 or with compressed-tensors W4A16 routed experts (Kimi's ignore list).

transformers 5.24 loads the same directory as ``Kimi_K25ForConditionalGeneration`` with no missing or
unexpected tensor (so the layout is the one it reads), and its text-only greedy tokens (fp32, full forward per
token) are ours, alone and batched with prompts of different lengths. We serve text only: the vision tower and
projector are skipped at load (never materialized), images are refused by the request schema.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.models.test_deepseek import CASES, save_tiny_deepseek
from tests.models.wrapped_layouts import write_kimi_k25
from tests.quant.layouts_w4 import write_int4_ct_checkpoint
from tests.tiny_models import assert_batched_equals_alone, greedy_tokens, hf_logits, small_engine
from tokenfab.layers.moe import FusedMoE
from tokenfab.loader.errors import ModelLoadError
from tokenfab.quant.int4_ct import Int4Experts
from tokenfab.quant.w4_linear import W4Linear

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], [1, 2, 3], list(range(30, 60))]
STEPS = 6


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi_k25")
    save_tiny_deepseek(root / "plain", **CASES["v3-yarn"])
    write_int4_ct_checkpoint(root / "plain", root / "int4")  # Kimi's ignore list: routed experts only
    return {"plain": write_kimi_k25(root / "plain", root / "k25-plain"),
            "int4": write_kimi_k25(root / "int4", root / "k25-int4")}


def _hf_greedy(path, prompts: list[list[int]], n: int) -> list[list[int]]:
    import transformers

    hf, info = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32,
                                                                        output_loading_info=True)
    assert type(hf).__name__ == "Kimi_K25ForConditionalGeneration"
    assert not any(info.values()), info  # every tensor of the layout is one transformers reads, none missing
    hf.eval()
    res = []
    for ids in prompts:
        out = list(ids)
        for _ in range(n):
            out.append(int(hf_logits(hf, out)[-1].argmax()))
        res.append(out[len(ids):])
    return res


@pytest.mark.parametrize("variant", ["plain", "int4"])
def test_official_layout_greedy_equals_transformers_alone_and_batched(kimi, variant):
    if variant == "int4":
        pytest.importorskip("compressed_tensors")
    path = kimi[variant]
    engine = small_engine(path)
    model = engine.runner.model
    names = [n for n, _ in model.named_parameters()]
    assert not any("vision" in n or "projector" in n for n in names)  # text only
    moe = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, FusedMoE)]
    assert len(moe) == 2
    # attention, dense MLP, shared experts and lm_head stay unquantized (Kimi's ignore list)
    assert not [n for n, m in model.named_modules() if isinstance(m, W4Linear)]
    int4 = [isinstance(m.quant_experts, Int4Experts) and m.w13_weight is None for m in moe]
    assert int4 == [variant == "int4"] * 2
    hf = _hf_greedy(path, PROMPTS, STEPS)
    assert [greedy_tokens(engine, [p], STEPS, f"a{i}")[0] for i, p in enumerate(PROMPTS)] == hf
    assert greedy_tokens(engine, PROMPTS, STEPS, "b") == hf
    assert_batched_equals_alone(engine)


def test_text_only_wrapper_without_vision_loads(kimi, tmp_path):
    """A checkpoint with the wrapper config but no vision tower at all (a text-only export) serves the same."""
    src = kimi["plain"]
    plain = src.parent / "plain"
    ours = greedy_tokens(small_engine(write_kimi_k25(plain, tmp_path / "novision", vision=False)), PROMPTS, 4)
    assert ours == greedy_tokens(small_engine(src), PROMPTS, 4)


def test_wrapper_without_text_config_is_a_clear_error(kimi, tmp_path):
    cfg = json.loads((kimi["plain"] / "config.json").read_text())
    del cfg["text_config"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(cfg))
    shutil.copy(kimi["plain"] / "model.safetensors", bad / "model.safetensors")
    with pytest.raises((ModelLoadError, ValueError)) as e:
        small_engine(bad)
    assert "text_config" in str(e.value) and "config.json" in str(e.value)


def test_missing_language_model_tensor_is_a_clear_error(kimi, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((kimi["plain"] / "config.json").read_text())
    tensors = load_file(str(kimi["plain"] / "model.safetensors"))
    del tensors["language_model.model.layers.1.self_attn.kv_b_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ModelLoadError) as e:
        small_engine(bad)
    assert "missing" in str(e.value) and "layers.1.self_attn.kv_b_proj" in str(e.value)


def test_image_parts_are_refused_with_a_400(kimi):
    """Text only: a chat message with an image part is a 400 with an OpenAI error body, and the server
    still answers the next request."""
    from fastapi.testclient import TestClient

    from tests.server.inprocess import assert_error
    from tokenfab import LLM
    from tokenfab.engine.core.async_engine import AsyncEngine
    from tokenfab.server.app import ServerConfig, build_app

    llm = LLM(model=str(kimi["plain"]), block_size=4, num_kv_blocks=64)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    body = {"model": llm.engine.model_name, "max_tokens": 3,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this"}, image]}]}
    with TestClient(build_app(AsyncEngine(llm.engine), ServerConfig(drain_timeout=1)),
                    raise_server_exceptions=False) as client:
        assert_error(client.post("/v1/chat/completions", json=body), 400)
        ok = client.post("/v1/completions", json={"model": llm.engine.model_name, "prompt": [1, 2, 3],
                                                  "max_tokens": 3, "temperature": 0})
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["finish_reason"] == "length"
