"""KV bytes per token at 128k context: DeepSeek-V4 (transformers' default DeepseekV4Config: 43 layers, 20 CSA at
ratio 4 and 23 HCA at ratio 128, head_dim 512, index_head_dim 128, window 128) against DeepSeek-V3's MLA cache
(the default DeepseekV3Config: 61 layers of 512 + 64), bf16, block size 16, both from the shapes the model
runner allocates (V4: paged compressed entries and a ring of token rows per sequence in its state slot).
Layers are built on the meta device (no weights).

Printed with ``pytest -s``; the figures are in docs/hybrid-cache.md (DeepSeek-V4 section)."""

from __future__ import annotations

import torch
from torch import nn

from tokenfab.engine.runner.model_runner import kv_bytes_per_token
from tokenfab.engine.runner.state_cache import state_bytes_per_slot
from tokenfab.layers.dsv4_attention import DeepseekV4Attention, cache_bytes_per_token
from tokenfab.models.deepseek_v3 import make_mla

CONTEXT, BLOCK = 128 * 1024, 16


def _v4_layers() -> tuple[object, list[DeepseekV4Attention]]:
    import transformers

    config = transformers.DeepseekV4Config()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as the loader builds a bf16 model: the rings take its dtype
    try:
        with torch.device("meta"):
            return config, [DeepseekV4Attention(config, t) for t in config.layer_types]
    finally:
        torch.set_default_dtype(default)


def _v3_bytes() -> int:
    import transformers

    config = transformers.DeepseekV3Config()
    with torch.device("meta"):
        layers = nn.ModuleList(make_mla(config, 4096) for _ in range(config.num_hidden_layers))
    return kv_bytes_per_token(layers, torch.bfloat16, BLOCK)


def test_kv_bytes_per_token_at_128k_against_deepseek_v3():
    config, layers = _v4_layers()
    n_csa = config.layer_types.count("compressed_sparse_attention")
    n_hca = config.layer_types.count("heavily_compressed_attention")
    assert (n_csa, n_hca, len(layers)) == (20, 23, 43)
    # no [max_position, rope] table per layer (V4 runs to 1M tokens): RoPE angles come from the positions
    assert all(sum(b.numel() for b in a.buffers()) == config.qk_rope_head_dim // 2 for a in layers)
    d, di, w = config.head_dim, config.index_head_dim, config.sliding_window
    v3 = _v3_bytes()
    assert v3 == 61 * (512 + 64) * 2  # MLA: latent + rope key, bf16

    # paged: the compressed entries, CSA (d + d_I) every 4 tokens, HCA d once a 16-token block (the entry's
    # block: ratio 128 > 16); per sequence: each layer's ring of 128 token rows (the window; CSA: kv + C, Z at
    # 2d + the indexer's at 2 d_I; HCA: kv + C, Z at d)
    entries = n_csa * (d + di) / 4 + n_hca * d / BLOCK
    ring = n_csa * w * (5 * d + 4 * di) + n_hca * w * 3 * d
    model = nn.ModuleList(layers)
    assert kv_bytes_per_token(model, torch.bfloat16, BLOCK) == entries * 2
    assert state_bytes_per_slot(model) == ring * 2
    per_token = cache_bytes_per_token(layers, CONTEXT, BLOCK, torch.bfloat16)
    assert per_token == (entries * CONTEXT + ring) * 2 / CONTEXT
    print(f"\nKV bytes/token at {CONTEXT} tokens (bf16, block {BLOCK}): DeepSeek-V3 MLA {v3}; DeepSeek-V4 "
          f"{per_token:.0f} ({per_token / v3:.3f}x): entries {entries * 2:.0f} + the rings' {ring * 2 / 2**20:.1f} "
          f"MiB a sequence")
    assert per_token < v3 / 8
