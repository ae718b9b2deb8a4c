"""DeepSeek-V3 (MLA + grouped sigmoid MoE with shared experts): logits equal transformers' (fp32) at
prefill and over 5 decode steps through the paged latent cache; greedy generations equal alone,
batched, with chunked prefill and with prefix-cache hits; the cache holds only latent + rope key."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import (
    assert_batched_equals_alone,
    assert_step_logits_match_hf,
    compiled_and_eager_logits,
    greedy_tokens,
    hf_logits,
    run_capturing_logits,
    save_tiny_model,
)
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.runner.model_runner import kv_bytes_per_token
from tokenfab.layers.mla import MLAAttention
from tokenfab.layers.moe import FusedMoE

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0}
DEEPSEEK_COMMON = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3, routed_scaling_factor=2.5,
    norm_topk_prob=True, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16,
    v_head_dim=24, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
CASES = {
    # q through the low-rank path, interleaved rope, YaRN with mscale_all_dim (softmax scale corrected)
    "v3-yarn": dict(rope_parameters=YARN),
    # plain q_proj, NeoX-layout rope, no scaling
    "v3-plain-q": dict(q_lora_rank=None, rope_interleave=False, rope_parameters={"rope_type": "default",
                                                                                "rope_theta": 10000.0}),
}
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], [1, 2, 3], list(range(30, 60))]


def save_tiny_deepseek(path, seed: int = 0, **overrides):
    """A random-weight transformers DeepseekV3ForCausalLM (fp32, weights ~N(0, 0.2), a random
    routing correction bias), saved as safetensors; returns it (eval)."""
    import transformers

    return save_tiny_model(transformers.DeepseekV3Config(**{**DEEPSEEK_COMMON, **overrides}), path, seed)


def _engine(path, **kw) -> LLMEngine:
    args = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64)
    args.update(kw)
    return LLMEngine(model=str(path), **args)


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_deepseek(path, **CASES[request.param])
    return hf, path, _engine(path)



def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(hf_logits(hf, out)[-1].argmax()))
    return out[len(ids):]



def test_structure_and_latent_cache(tiny):
    """Dense first layer then MoE with shared experts; the cache holds r + rope values per token."""
    hf, _, engine = tiny
    cfg = hf.config
    layers = engine.runner.model.model.layers
    assert [isinstance(layer.mlp, FusedMoE) for layer in layers] == [False, True, True]
    assert all(layer.mlp.shared_experts is not None for layer in layers[1:])
    mla = [m for m in engine.runner.model.modules() if isinstance(m, MLAAttention)]
    assert len(mla) == cfg.num_hidden_layers
    per_token = cfg.kv_lora_rank + cfg.qk_rope_head_dim  # 48, vs 2 * 4 heads * 32 = 256 expanded
    kv = engine.runner.kv_cache
    assert kv.shape == (cfg.num_hidden_layers, 64, 4, 1, per_token)
    for i, m in enumerate(mla):
        assert m.kv_cache.shape == (64, 4, 1, per_token)
        assert m.kv_cache.data_ptr() == kv[i].data_ptr()
    assert kv_bytes_per_token(engine.runner.model, torch.float32) == cfg.num_hidden_layers * per_token * 4


def test_prefill_and_decode_logits_match(tiny):
    hf, _, engine = tiny
    assert_step_logits_match_hf(engine, hf, PROMPTS)


def test_batched_equals_alone(tiny):
    hf, _, engine = tiny
    alone = assert_batched_equals_alone(engine)
    assert alone[1] == _hf_greedy(hf, [1, 2, 3, 4, 5, 6, 7, 8, 9], 8)


def test_chunked_prefill_and_prefix_cache(tiny):
    """Prompts longer than the step's token budget are prefilled in chunks, mixed with other
    sequences' decodes; a repeated prompt and one sharing its first blocks hit the prefix cache."""
    hf, path, _ = tiny
    engine = _engine(path, max_num_batched_tokens=8, enable_prefix_caching=True)
    long = list(range(40, 63))  # 23 tokens: 3 chunks
    shared = long[:16] + [7, 8, 9]  # shares 4 full blocks
    expect = [_hf_greedy(hf, p, 5) for p in (long, shared, [3, 1, 4])]
    assert greedy_tokens(engine, [long, [3, 1, 4]], 5, "c") == [expect[0], expect[2]]
    computed = engine.computed_prompt_tokens_total
    assert greedy_tokens(engine, [long, shared], 5, "d") == [expect[0], expect[1]]
    # both reuse the cached first blocks of `long`: fewer prompt tokens computed than given
    assert engine.computed_prompt_tokens_total - computed <= len(long) + len(shared) - 2 * 16
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("layers,steps", [(2, 2), pytest.param(3, 3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("expand_from", [128, 8])
def test_through_triton_kernels(tmp_path, monkeypatch, expand_from, layers, steps):
    """The whole engine on the Triton kernels (interpreter on CPU): MLA attention (absorbed prefill
    and decodes; or the prefill expanded through the paged prefill kernel), store, rope, grouped
    routing, fused MoE; logits still equal transformers'. Fast tier: a dense layer and an MoE layer,
    prefill and one decode; slow twin: the 3-layer model over 3 steps."""
    from tokenfab.kernels._launch import interpreting
    from tokenfab.layers.mla import MLAAttention

    if not (torch.cuda.is_available() or interpreting()):
        pytest.skip("triton was imported without the interpreter")
    monkeypatch.setattr(MLAAttention, "expand_min_query_len", expand_from)
    hf = save_tiny_deepseek(tmp_path, num_hidden_layers=layers, **CASES["v3-yarn"])
    engine = _engine(tmp_path)
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    prompt = list(range(30, 43))
    generated, step_logits = run_capturing_logits(engine, prompt, steps)
    assert len(step_logits) == steps
    ref = hf_logits(hf, prompt + generated)
    for s, logits in enumerate(step_logits):
        torch.testing.assert_close(logits[0], ref[len(prompt) - 1 + s], atol=1e-3, rtol=0)


def test_kimi_k25_text_checkpoint_loads(tmp_path):
    """Kimi K2.5 (a vision wrapper around a DeepSeek-V3 text model): built from the text config; its
    checkpoint names (``language_model.model.*`` as shipped, ``model.language_model.*`` as transformers
    saves them) map onto ours, the vision tower and projector are skipped, MTP layers are kept aside."""
    import transformers
    from safetensors.torch import load_file

    from tokenfab.loader.weights import load_weights
    from tokenfab.models.registry import resolve_model_class

    hf = save_tiny_deepseek(tmp_path, **CASES["v3-yarn"])
    tensors = load_file(str(tmp_path / "model.safetensors"))
    text = hf.config.to_dict()
    config = transformers.AutoConfig.for_model("kimi_k25", text_config=text)
    cls = resolve_model_class("KimiK25ForConditionalGeneration")
    for style in ("shipped", "transformers"):
        renamed = {}
        for name, t in tensors.items():
            if style == "shipped":
                renamed["language_model." + name] = t
            else:
                renamed[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = t
        renamed["vision_tower.encoder.blocks.0.wqkv.weight"] = torch.zeros(3, 3)
        renamed["mm_projector.proj.0.weight"] = torch.zeros(2, 2)
        renamed["language_model.model.layers.3.eh_proj.weight"] = torch.zeros(2, 2)  # an MTP layer
        ours = cls(config, max_position=64)
        load_weights(ours, renamed.items(), "kimi")
        assert len(ours.model.layers) == text["num_hidden_layers"]
        torch.testing.assert_close(ours.model.layers[0].self_attn.kv_b_proj.weight,
                                   hf.model.layers[0].self_attn.kv_b_proj.weight)
        torch.testing.assert_close(ours.lm_head.weight, hf.lm_head.weight)
        assert list(ours.mtp_weights) == ["model.layers.3.eh_proj.weight"]
        torch.testing.assert_close(ours.model.layers[2].mlp.e_score_correction_bias,
                                   hf.model.layers[2].mlp.gate.e_score_correction_bias)


def test_expanded_prefill_form(tiny, monkeypatch):
    """Steps with long query chunks expand the cached latents to per-head K/V and run the paged prefill
    kernel; with the threshold lowered, prefill (whole and chunked, after prefix-cache hits) still
    matches transformers, and decodes (absorbed form) continue from that cache."""
    from tokenfab.layers.mla import MLAAttention

    hf, path, _ = tiny
    monkeypatch.setattr(MLAAttention, "expand_min_query_len", 2)
    calls = []
    expanded = MLAAttention.expanded

    def spy(self, *args):
        calls.append(args[-1].max_query_len)
        return expanded(self, *args)

    monkeypatch.setattr(MLAAttention, "expanded", spy)
    engine = _engine(path, max_num_batched_tokens=12)
    prompt = list(range(30, 53))
    generated, step_logits = run_capturing_logits(engine, prompt, 4)
    ref = hf_logits(hf, prompt + generated)
    logits = [x for x in step_logits if x.shape[0]]  # chunk steps that sample nothing return no rows
    assert len(logits) == 4 and calls and min(calls) >= 2
    for s, x in enumerate(logits):
        torch.testing.assert_close(x[0], ref[len(prompt) - 1 + s], atol=1e-3, rtol=0)
    shared = prompt[:16] + [9, 8, 7, 6]
    assert greedy_tokens(engine, [shared, [4, 4, 4]], 4, "e") == [_hf_greedy(hf, p, 4) for p in (shared, [4, 4, 4])]


def test_forward_compiles_fullgraph(tmp_path):
    """The MLA + MoE forward traces as one graph through the custom ops' fake implementations
    (store_latent mutating the cache, mla_attention, grouped routing, fused experts) and gives the
    eager result."""
    save_tiny_deepseek(tmp_path, num_hidden_layers=1, first_k_dense_replace=0)
    eng = LLMEngine(model=str(tmp_path), num_kv_blocks=16, block_size=4)
    got, expected = compiled_and_eager_logits(eng, "inductor")
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
