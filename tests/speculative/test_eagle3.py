"""EAGLE-3 heads (tokenfab/speculative/eagle3.py): a tiny random head written in the published
``LlamaForCausalLMEagle3`` layout (from the format's description, not from our loader), loaded and
run through the paged cache (prefill, then decode), against a plain torch re-statement of the head;
the target's feature taps against transformers' ``output_hidden_states``."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from tests.speculative.paged_batch import paged_batch
from tokenfab.engine.runner.model_runner import ModelRunner
from tokenfab.loader.errors import ModelLoadError
from tokenfab.speculative.eagle3 import aux_layer_ids, load_eagle3, target_forward_with_aux

CFG = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
           vocab_size=64, draft_vocab_size=40, target_hidden_size=24, rms_norm_eps=1e-6, rope_theta=10000.0,
           max_position_embeddings=256, num_hidden_layers=1)


def write_tiny_eagle3(path, seed: int = 0, embed: bool = True, **override) -> dict[str, torch.Tensor]:
    cfg = dict(CFG, **override)
    g = torch.Generator().manual_seed(seed)
    h, ht, hd = cfg["hidden_size"], cfg["target_hidden_size"], cfg["head_dim"]
    nq, nkv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]

    def r(*shape, s=0.2):
        return torch.randn(*shape, generator=g) * s

    w = {
        "fc.weight": r(h, 3 * ht),
        "midlayer.input_layernorm.weight": 1 + r(h),
        "midlayer.hidden_norm.weight": 1 + r(h),
        "midlayer.post_attention_layernorm.weight": 1 + r(h),
        "midlayer.self_attn.q_proj.weight": r(nq * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": r(nkv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": r(nkv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": r(h, nq * hd),
        "midlayer.mlp.gate_proj.weight": r(inter, h),
        "midlayer.mlp.up_proj.weight": r(inter, h),
        "midlayer.mlp.down_proj.weight": r(h, inter),
        "norm.weight": 1 + r(h),
        "lm_head.weight": r(cfg["draft_vocab_size"], h),
    }
    # the draft vocabulary: a sorted subset of the target's; d2t holds target id - draft id
    kept = torch.randperm(cfg["vocab_size"], generator=g)[: cfg["draft_vocab_size"]].sort().values
    w["d2t"] = kept - torch.arange(cfg["draft_vocab_size"])
    w["t2d"] = torch.zeros(cfg["vocab_size"], dtype=torch.bool).index_fill_(0, kept, True)
    if embed:
        w["embed_tokens.weight"] = r(cfg["vocab_size"], h, s=1.0)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(dict(cfg, architectures=["LlamaForCausalLMEagle3"],
                                                      model_type="llama")))
    return w


# ---------------------------------------------------------------- the plain re-statement


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta=10000.0):
    """Neox-style rotary embedding: x [T, heads, d], pos [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None, :], torch.cat([ang.sin()] * 2, -1)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_head(w, ids: list[int], feats: torch.Tensor, embed: torch.Tensor):
    """One sequence, all positions at once, float64: (normed, pre-norm) [T, H]."""
    w = {k: v.double() for k, v in w.items()}
    t, nq, nkv, hd = len(ids), CFG["num_attention_heads"], CFG["num_key_value_heads"], CFG["head_dim"]
    g = feats.double() @ w["fc.weight"].T if feats.shape[-1] != CFG["hidden_size"] else feats.double()
    e = embed.double()[torch.tensor(ids)]
    x = torch.cat([_rms(e, w["midlayer.input_layernorm.weight"]), _rms(g, w["midlayer.hidden_norm.weight"])], -1)
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, nq, hd)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, nkv, hd)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, nkv, hd)
    pos = torch.arange(t)
    q, k = _rope(q, pos), _rope(k, pos)
    k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(t, nq * hd) @ w["midlayer.self_attn.o_proj.weight"].T
    r = g + o
    m = _rms(r, w["midlayer.post_attention_layernorm.weight"])
    m = (torch.nn.functional.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)
         @ w["midlayer.mlp.down_proj.weight"].T)
    n = r + m
    return _rms(n, w["norm.weight"]), n


# ---------------------------------------------------------------- tests


def test_head_forward_through_the_paged_cache_matches_the_restatement(tmp_path):
    w = write_tiny_eagle3(tmp_path / "head")
    head = load_eagle3(tmp_path / "head")
    ModelRunner(head, torch.device("cpu"), torch.float32, block_size=4, num_blocks=8)  # binds the cache
    g = torch.Generator().manual_seed(1)
    seqs = [[3, 9, 1, 22, 5, 7], [60, 2, 2, 31, 8, 0, 11, 4, 19]]
    feats = [torch.randn(len(s), 3 * CFG["target_hidden_size"], generator=g) for s in seqs]
    # prefill all but the last token of each sequence (ragged), then one decode row each
    pre = paged_batch([(s[:-1], 0, i) for i, s in enumerate(seqs)], block_size=4, blocks_per_seq=4)
    with torch.no_grad():
        n1, p1 = head.forward(pre.input_ids, torch.cat([f[:-1] for f in feats]), pre)
        dec = paged_batch([(s[-1:], len(s) - 1, i) for i, s in enumerate(seqs)], block_size=4, blocks_per_seq=4)
        n2, p2 = head.forward(dec.input_ids, torch.stack([f[-1] for f in feats]), dec)
        logits = head.compute_logits(n2)
    row = 0
    for i, (s, f) in enumerate(zip(seqs, feats)):
        ref_n, ref_p = reference_head(w, s, f, w["embed_tokens.weight"])
        torch.testing.assert_close(n1[row:row + len(s) - 1].double(), ref_n[:-1], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(p1[row:row + len(s) - 1].double(), ref_p[:-1], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(n2[i].double(), ref_n[-1], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(p2[i].double(), ref_p[-1], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(logits[i].double(), ref_n[-1] @ w["lm_head.weight"].double().T,
                                   atol=2e-5, rtol=1e-4)
        row += len(s) - 1


def test_recursive_step_takes_its_own_hidden_state(tmp_path):
    # the second draft position feeds the head's own pre-norm output (H wide: fc is skipped)
    w = write_tiny_eagle3(tmp_path / "head")
    head = load_eagle3(tmp_path / "head")
    ModelRunner(head, torch.device("cpu"), torch.float32, block_size=4, num_blocks=8)
    f0 = torch.randn(1, 3 * CFG["target_hidden_size"], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, pre0 = head.forward(torch.tensor([5]), f0, paged_batch([([5], 0, 0)], 4, 4))
        n1, _ = head.forward(torch.tensor([9]), pre0, paged_batch([([9], 1, 0)], 4, 4))
    w64 = {k: v.double() for k, v in w.items()}
    g0 = f0.double() @ w64["fc.weight"].T
    ref = reference_head(w, [5, 9], torch.cat([g0, pre0.double()]), w["embed_tokens.weight"])[0]
    torch.testing.assert_close(n1[0].double(), ref[1], atol=2e-5, rtol=1e-4)


def test_draft_vocabulary_maps_to_target_ids(tmp_path):
    w = write_tiny_eagle3(tmp_path / "head")
    head = load_eagle3(tmp_path / "head")
    kept = torch.nonzero(w["t2d"]).flatten()
    assert torch.equal(head.to_target_ids(torch.arange(CFG["draft_vocab_size"])), kept)
    probs = torch.softmax(torch.randn(3, CFG["draft_vocab_size"]), -1)
    full = head.draft_probs_in_target_vocab(probs, CFG["vocab_size"])
    outside = torch.ones(CFG["vocab_size"], dtype=torch.bool).index_fill_(0, kept, False)
    assert torch.equal(full[:, kept], probs) and not full[:, outside].any()


def test_embedding_shared_with_the_target_when_absent(tmp_path):
    write_tiny_eagle3(tmp_path / "head", embed=False)
    with pytest.raises(ModelLoadError, match="embed_tokens"):
        load_eagle3(tmp_path / "head")
    emb = SimpleNamespace(weight=torch.nn.Parameter(torch.randn(CFG["vocab_size"], CFG["hidden_size"])))
    head = load_eagle3(tmp_path / "head", target=SimpleNamespace(model=SimpleNamespace(embed_tokens=emb)))
    assert head.embed_tokens.weight is emb.weight


def test_bad_checkpoints_are_refused(tmp_path):
    from safetensors.torch import load_file

    w = write_tiny_eagle3(tmp_path / "h")
    wrong = dict(w, **{"fc.weight": torch.zeros(CFG["hidden_size"], 5)})
    save_file(wrong, str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="shape"):
        load_eagle3(tmp_path / "h")
    missing = {k: v for k, v in w.items() if k != "midlayer.self_attn.k_proj.weight"}
    save_file(missing, str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing"):
        load_eagle3(tmp_path / "h")
    save_file(dict(w, extra=torch.zeros(1)), str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="unexpected"):
        load_eagle3(tmp_path / "h")
    assert set(load_file(str(tmp_path / "h" / "model.safetensors"))) == set(w) | {"extra"}
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    (tmp_path / "h" / "config.json").write_text(json.dumps(dict(cfg, architectures=["LlamaForCausalLM"])))
    with pytest.raises(ModelLoadError, match="architectures"):
        load_eagle3(tmp_path / "h")


def test_aux_layers_default_and_configured():
    assert aux_layer_ids(32) == (2, 16, 29)
    cfg = SimpleNamespace(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 5, 9]})
    assert aux_layer_ids(32, cfg) == (1, 5, 9)


def test_target_taps_equal_transformers_hidden_states(tmp_path):
    from tests.tiny_models import save_tiny_model, tiny_config
    from tokenfab.loader.model_loader import load_model

    hf = save_tiny_model(tiny_config("llama", num_hidden_layers=6), tmp_path / "target")
    target = load_model(tmp_path / "target", torch.float32, torch.device("cpu"), load_tokenizer=False).model
    ModelRunner(target, torch.device("cpu"), torch.float32, block_size=4, num_blocks=8)
    ids = [5, 17, 200, 3, 99, 42, 7]
    layers = aux_layer_ids(6)
    with torch.no_grad():
        final, taps = target_forward_with_aux(target, paged_batch([(ids, 0, 0)], 4, 8), layers)
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.cat([ref[i][0] for i in layers], -1)
    torch.testing.assert_close(taps, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, ref[-1][0], atol=1e-4, rtol=1e-4)
