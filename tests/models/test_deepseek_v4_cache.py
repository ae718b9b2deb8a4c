"""KV bytes per token at 128k context: DeepSeek-V4 (transformers' default DeepseekV4Config: 43 layers, 20 CSA at
ratio 4 and 23 HCA at ratio 128, head_dim 512, index_head_dim 128, window 128) against DeepSeek-V3's MLA cache
(the default DeepseekV3Config: 61 layers of 512 + 64), bf16, block size 16, both from the per-layer shapes the
model runner allocates. Layers are built on the meta device (no weights).

Printed with ``pytest -s``; the figures are in docs/hybrid-cache.md (DeepSeek-V4 section)."""

from __future__ import annotations

import torch
from torch import nn

from tokenfab.engine.runner.model_runner import kv_bytes_per_token
from tokenfab.layers.dsv4_attention import DeepseekV4Attention, cache_bytes_per_token
from tokenfab.models.deepseek_v3 import make_mla

CONTEXT, BLOCK = 128 * 1024, 16


def _v4_layers() -> tuple[object, list[DeepseekV4Attention]]:
    import transformers

    config = transformers.DeepseekV4Config()
    with torch.device("meta"):
        return config, [DeepseekV4Attention(config, t) for t in config.layer_types]


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

    allocated = cache_bytes_per_token(layers, CONTEXT, BLOCK, torch.bfloat16)
    # every token keeps its row (CSA: kv + C, Z at 2d + the indexer's at 2 d_I; HCA: kv + C, Z at d);
    # entries: CSA (d + d_I) every 4 tokens, HCA d once a 16-token block (the entry's block: ratio 128 > 16)
    per_token = n_csa * (d + 4 * d + 4 * di + (d + di) / 4) + n_hca * (3 * d + d / BLOCK)
    assert allocated == per_token * 2
    assert kv_bytes_per_token(nn.ModuleList(layers), torch.bfloat16, BLOCK) == allocated

    live = cache_bytes_per_token(layers, CONTEXT, BLOCK, torch.bfloat16, live_only=True)
    rows = lambda lookback: (-(-max(w, lookback) // BLOCK) + 1) * BLOCK  # noqa: E731 - whole blocks of rows
    window_rows = n_csa * rows(8) * (5 * d + 4 * di) + n_hca * rows(128) * 3 * d
    assert live == (n_csa * (d + di) / 4 * CONTEXT + n_hca * d / BLOCK * CONTEXT + window_rows) * 2 / CONTEXT
    print(f"\nKV bytes/token at {CONTEXT} tokens (bf16, block {BLOCK}): DeepSeek-V3 MLA {v3}, DeepSeek-V4 as "
          f"allocated {allocated:.0f} ({allocated / v3:.2f}x), V4 live (out-of-window rows released) {live:.0f} "
          f"({live / v3:.3f}x)")
    assert live < v3 / 8
