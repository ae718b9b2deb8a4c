"""DeepSeek MTP (tokenfab/speculative/mtp.py): a tiny DeepSeek-V3 whose checkpoint carries an MTP layer at
index num_hidden_layers, written in DeepSeek's published layout (per-expert tensors); loaded through
the target's ``mtp_weights``, run through the paged latent cache (prefill, then decode) and compared
with a plain torch re-statement of the MTP fusion around transformers' own DeepseekV3DecoderLayer."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tests.models.test_deepseek import DEEPSEEK_COMMON, save_tiny_deepseek
from tests.speculative.paged_batch import paged_batch
from tests.tiny_models import randomize_
from tokenfab.engine.runner.model_runner import ModelRunner
from tokenfab.loader.errors import ModelLoadError
from tokenfab.loader.model_loader import load_model
from tokenfab.speculative.mtp import load_mtp, num_mtp_layers

LAYERS = 2  # the MTP layer sits at index 2


def write_mtp_layer(path, layer_cls, config, index: int, shared: bool = True, seed: int = 1):
    """transformers' decoder layer ``layer_cls`` at ``index`` (random, larger weights) + enorm/hnorm/
    eh_proj/shared_head (and, unless ``shared``, the MTP layer's own embedding and head), saved as an
    extra shard under model.layers.{index}.* in DeepSeek's published layout (one tensor per expert);
    returns (hf layer, MTP extras)."""
    torch.manual_seed(seed)
    layer = randomize_(layer_cls(config, layer_idx=index))
    h, v = config.hidden_size, config.vocab_size
    extras = {"enorm.weight": 1 + 0.2 * torch.randn(h), "hnorm.weight": 1 + 0.2 * torch.randn(h),
              "eh_proj.weight": 0.2 * torch.randn(h, 2 * h), "shared_head.norm.weight": 1 + 0.2 * torch.randn(h)}
    if not shared:
        extras |= {"embed_tokens.weight": torch.randn(v, h), "shared_head.head.weight": 0.2 * torch.randn(v, h)}
    tensors = {}
    for k, t in layer.state_dict().items():
        if k == "mlp.experts.gate_up_proj":  # DeepSeek's published layout: one tensor per expert
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                tensors[f"mlp.experts.{e}.gate_proj.weight"] = t[e, :inter]
                tensors[f"mlp.experts.{e}.up_proj.weight"] = t[e, inter:]
        elif k == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                tensors[f"mlp.experts.{e}.down_proj.weight"] = t[e]
        else:
            tensors[k] = t
    tensors |= extras
    save_file({f"model.layers.{index}.{k}": t.contiguous() for k, t in tensors.items()},
              str(path / "mtp.safetensors"))
    return layer, extras


def _reference(hf_target, hf_layer, extras, ids: list[int], prev: torch.Tensor) -> torch.Tensor:
    """MTP logits for every position of one sequence (input_ids = the following tokens)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    cfg = hf_target.config

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    embed = extras.get("embed_tokens.weight", hf_target.model.embed_tokens.weight)
    head = extras.get("shared_head.head.weight", hf_target.lm_head.weight)
    t = len(ids)
    e = embed[torch.tensor(ids)].clone()
    e[0] = 0.0  # position 0
    g = torch.cat([rms(e, extras["enorm.weight"]), rms(prev, extras["hnorm.weight"])], -1) @ extras["eh_proj.weight"].T
    pos = torch.arange(t)[None]
    cos_sin = DeepseekV3RotaryEmbedding(cfg)(g[None], pos)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    hf_layer.self_attn.config._attn_implementation = "eager"
    n = hf_layer(g[None], attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
    n = n[0] if isinstance(n, tuple) else n
    return rms(n[0], extras["shared_head.norm.weight"]) @ head.T


@pytest.mark.parametrize("shared", [False, True], ids=["own-embed-head", "shared-embed-head"])
def test_mtp_forward_matches_the_restatement(tmp_path, shared):
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    hf = save_tiny_deepseek(tmp_path, num_hidden_layers=LAYERS, num_nextn_predict_layers=1)
    config = transformers.DeepseekV3Config(**{**DEEPSEEK_COMMON, "num_hidden_layers": LAYERS})
    hf_layer, extras = write_mtp_layer(tmp_path, DeepseekV3DecoderLayer, config, LAYERS, shared)
    target = load_model(tmp_path, torch.float32, torch.device("cpu"), load_tokenizer=False).model
    assert num_mtp_layers(target.config) == 1 and target.mtp_weights
    mtp = load_mtp(target)
    assert mtp.layer_index == LAYERS
    if shared:
        assert mtp.embed_tokens.weight is target.model.embed_tokens.weight
        assert mtp.shared_head.head.weight is target.lm_head.weight
    ModelRunner(mtp, torch.device("cpu"), torch.float32, block_size=4, num_blocks=8)  # binds the latent cache
    g = torch.Generator().manual_seed(3)
    seqs = [[5, 17, 42, 99, 3, 250, 7], [1, 2, 3, 300, 8]]
    prevs = [torch.randn(len(s), config.hidden_size, generator=g) for s in seqs]
    with torch.no_grad():
        pre = paged_batch([(s[:-1], 0, i) for i, s in enumerate(seqs)], block_size=4, blocks_per_seq=4)
        out1 = mtp.compute_logits(mtp.forward(pre.input_ids, torch.cat([p[:-1] for p in prevs]), pre))
        dec = paged_batch([(s[-1:], len(s) - 1, i) for i, s in enumerate(seqs)], block_size=4, blocks_per_seq=4)
        out2 = mtp.compute_logits(mtp.forward(dec.input_ids, torch.stack([p[-1] for p in prevs]), dec))
        row = 0
        for i, (s, p) in enumerate(zip(seqs, prevs)):
            ref = _reference(hf, hf_layer, extras, s, p)
            torch.testing.assert_close(out1[row:row + len(s) - 1], ref[:-1], atol=2e-4, rtol=1e-4)
            torch.testing.assert_close(out2[i], ref[-1], atol=2e-4, rtol=1e-4)
            row += len(s) - 1


def test_missing_mtp_layer_is_a_clear_error(tmp_path):
    save_tiny_deepseek(tmp_path, num_hidden_layers=LAYERS)
    target = load_model(tmp_path, torch.float32, torch.device("cpu"), load_tokenizer=False).model
    with pytest.raises(ModelLoadError, match="no MTP layer 2"):
        load_mtp(target)
