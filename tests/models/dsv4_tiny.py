"""A tiny random-weight DeepSeek-V4 in the official checkpoint layout (transformers' ``save_pretrained``),
shared by the DeepSeek-V4 tests: every attention type (sliding, CSA, HCA), both routings (hash, top-k),
mHC with three streams, a clamped SwiGLU that clamps, YaRN on the compressed layers' RoPE; a window of 6,
compression ratios 4 and 8 and an indexer top-2, so prompts of a few dozen tokens exceed all of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.tiny_models import randomize_

DSV4_TINY = dict(
    vocab_size=320, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    head_dim=32, q_lora_rank=24, partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=8,
    n_shared_experts=1, routed_scaling_factor=1.5, swiglu_limit=1.0,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    sliding_window=6, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=2, hc_mult=3,
    hc_sinkhorn_iters=20, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                     "beta_fast": 32.0, "beta_slow": 1.0},
)


def save_tiny_dsv4(path: Path, seed: int = 0, **overrides: Any):
    """Build transformers' DeepseekV4ForCausalLM with random weights (fp32; every parameter ~N(0, 0.2), a
    random routing correction bias and a random hash table of distinct experts per token), save it, return it."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.DeepseekV4Config(**{**DSV4_TINY, **overrides})
    model = randomize_(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                picks = torch.rand(buf.shape[0], config.n_routed_experts).argsort(dim=-1)
                buf.copy_(picks[:, : buf.shape[1]])
    model.save_pretrained(path, safe_serialization=True)
    return model


def save_tiny_dsv4_mtp(path: Path, layer_type: str = "sliding_attention", seed: int = 1):
    """Add DeepSeek-V4's MTP layer to a tiny checkpoint in ``path`` in DeepSeek's official layout (``mtp.0.*`` in
    its own shard, ``mtp.safetensors``): the block of a one-layer transformers DeepseekV4ForCausalLM whose layer
    is of ``layer_type`` (random, saved by transformers and renamed from ``model.layers.0.`` to ``mtp.0.``),
    plus ``e_proj``, ``h_proj``, ``enorm``, ``hnorm``, ``norm`` and ``hc_head_{fn,base,scale}``. No embedding or
    head of its own: DeepSeek's MTP shares the target's. Returns (the one-layer transformers model, whose
    ``model.layers[0]`` is the block, the extra tensors by their official names)."""
    import tempfile

    import transformers
    from safetensors import safe_open
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    config = transformers.DeepseekV4Config(**{**DSV4_TINY, "num_hidden_layers": 1, "layer_types": [layer_type],
                                              "mlp_layer_types": ["moe"]})
    block_model = randomize_(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    d, n = config.hidden_size, config.hc_mult
    extras = {"e_proj.weight": 0.2 * torch.randn(d, d), "h_proj.weight": 0.2 * torch.randn(d, d),
              "enorm.weight": 1 + 0.2 * torch.randn(d), "hnorm.weight": 1 + 0.2 * torch.randn(d),
              "norm.weight": 1 + 0.2 * torch.randn(d), "hc_head_fn": 0.2 * torch.randn(n, n * d),
              "hc_head_base": 0.2 * torch.randn(n), "hc_head_scale": 1 + 0.2 * torch.randn(1)}
    tensors = {f"mtp.0.{k}": v for k, v in extras.items()}
    with tempfile.TemporaryDirectory() as tmp:
        block_model.save_pretrained(tmp, safe_serialization=True)
        for f in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(str(f), "pt") as s:
                for k in s.keys():
                    if k.startswith("model.layers.0."):
                        tensors["mtp.0." + k.removeprefix("model.layers.0.")] = s.get_tensor(k)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "mtp.safetensors"))
    return block_model, extras


def dsv4_engine(path, **kw):
    """An engine on a tiny V4 checkpoint: small blocks and batches, one CPU thread (tiny matrices)."""
    from tokenfab.engine.llm_engine import LLMEngine

    args = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64, cpu_threads=1)
    args.update(kw)
    return LLMEngine(model=str(path), **args)


def one_torch_thread():
    """For an autouse fixture (``yield from one_torch_thread()``): torch on one thread, restored after. Tiny
    matrices: one thread is far faster on a shared machine (the engines run one too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
