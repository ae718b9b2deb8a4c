"""DeepSeek-V4's MTP layer (tokenfab/speculative/dsv4_mtp.py): a tiny random DeepSeek-V4 whose checkpoint carries
``mtp.0.*`` in DeepSeek's layout (tests/models/dsv4_tiny.py); loaded from the target's ``mtp_weights``, run
through its ring and compressed caches (a prefill chunk, then a decode row) and compared with a re-statement of
DeepSeek's ``MTPBlock.forward`` written here (enorm/hnorm, e_proj + h_proj over the hc streams, the MTP's own
hyper-connection head and norm, the target's head) around transformers' own DeepseekV4DecoderLayer, fed
transformers' residual streams of the target. transformers does not implement the MTP layer itself."""

from __future__ import annotations

import pytest
import torch

from tests.models.dsv4_tiny import DSV4_TINY, save_tiny_dsv4, save_tiny_dsv4_mtp
from tests.speculative.paged_batch import paged_batch
from tokenfab.engine.runner.model_runner import ModelRunner
from tokenfab.loader.errors import ModelLoadError
from tokenfab.loader.model_loader import load_model
from tokenfab.speculative.dsv4_mtp import DeepseekV4MTPLayer, load_dsv4_mtp


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def target_streams(hf, tokens: list[int]) -> torch.Tensor:
    """transformers' residual streams [S, n, D] after the target's last layer (before its hc head)."""
    captured = {}
    hook = hf.model.layers[-1].register_forward_hook(lambda mod, args, out: captured.setdefault("out", out))
    try:
        with torch.no_grad():
            hf(torch.tensor([tokens]))
    finally:
        hook.remove()
    out = captured["out"][0]
    assert out.shape == (len(tokens), DSV4_TINY["hc_mult"], DSV4_TINY["hidden_size"])
    return out


def mtp_reference(hf, block_model, extras: dict, next_ids: list[int], streams: torch.Tensor) -> torch.Tensor:
    """MTP logits [S, V] for positions 0..S-1 of one sequence: ``next_ids`` the token after each position,
    ``streams`` [S, n, D] the target's streams there. DeepSeek's MTPBlock, written out; the block itself is
    transformers' decoder layer (``block_model.model.layers[0]``), run by its own model's forward with a
    pre-hook putting our fused streams in place of the embedded ones."""
    cfg = hf.config
    eps, ids = cfg.rms_norm_eps, torch.tensor(next_ids)
    e = _rms(hf.model.embed_tokens.weight[ids], extras["enorm.weight"], eps) @ extras["e_proj.weight"].T
    h = _rms(streams, extras["hnorm.weight"], eps) @ extras["h_proj.weight"].T
    fused = (h + e.unsqueeze(1)).unsqueeze(0)  # [1, S, n, D]
    inner = block_model.model
    captured = {}
    pre = inner.layers[0].register_forward_pre_hook(lambda mod, args, kw: ((fused,) + args[1:], kw), with_kwargs=True)
    post = inner.layers[0].register_forward_hook(lambda mod, args, out: captured.setdefault("out", out))
    try:
        with torch.no_grad():
            inner(inputs_embeds=torch.zeros(1, len(next_ids), cfg.hidden_size), use_cache=False)
    finally:
        pre.remove()
        post.remove()
    out = captured["out"][0]  # [S, n, D]
    flat = _rms(out.flatten(1), None, eps)  # the hc head: sigmoid(a * s + b) + eps weights over the streams
    pre_w = torch.sigmoid(flat @ extras["hc_head_fn"].T * extras["hc_head_scale"] + extras["hc_head_base"])
    collapsed = ((pre_w + cfg.hc_eps).unsqueeze(-1) * out).sum(dim=1)
    return _rms(collapsed, extras["norm.weight"], eps) @ hf.lm_head.weight.T


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["sliding_attention", "compressed_sparse_attention"])
def case(request, tmp_path_factory):
    """A tiny V4 checkpoint with an MTP layer of the given attention kind (V4-Flash's is sliding)."""
    path = tmp_path_factory.mktemp("dsv4-mtp")
    hf = save_tiny_dsv4(path)
    block_model, extras = save_tiny_dsv4_mtp(path, request.param)
    return request.param, path, hf, block_model, extras


def test_mtp_layer_matches_the_reference(case):
    """Prefill rows (a chunk longer than the window and the ratio) and a decode row through the MTP layer's
    ring and paged entries equal the re-statement, for a sliding-window MTP block (V4-Flash's) and a CSA one."""
    layer_type, path, hf, block_model, extras = case
    target = load_model(path, torch.float32, torch.device("cpu"), load_tokenizer=False).model
    mtp = load_dsv4_mtp(target, str(path))
    assert isinstance(mtp, DeepseekV4MTPLayer) and mtp.index == DSV4_TINY["num_hidden_layers"]
    assert mtp.block.attn.layer_type == layer_type and not mtp.block.ffn.hashed
    ModelRunner(mtp, torch.device("cpu"), torch.float32, block_size=4, num_blocks=16, num_state_slots=2)
    seqs = [[5, 17, 42, 99, 3, 250, 7, 8, 60, 61, 62, 9, 10, 11], [1, 2, 3, 300, 8]]
    refs, feats = [], []
    for s in seqs:
        streams = target_streams(hf, s[:-1])  # h_t for t = 0 .. S-2, next token s[t + 1]
        refs.append(mtp_reference(hf, block_model, extras, s[1:], streams))
        feats.append(streams.flatten(1))
    with torch.no_grad():
        pre = paged_batch([(s[1:-1], 0, i) for i, s in enumerate(seqs)], block_size=4, blocks_per_seq=8)
        pre.state_slots = torch.tensor([0, 1], dtype=torch.int32)
        out1 = mtp.compute_logits(mtp.forward(pre.input_ids, torch.cat([f[:-1] for f in feats]), pre))
        dec = paged_batch([(s[-1:], len(s) - 2, i) for i, s in enumerate(seqs)], block_size=4, blocks_per_seq=8)
        dec.state_slots = torch.tensor([0, 1], dtype=torch.int32)
        out2 = mtp.compute_logits(mtp.forward(dec.input_ids, torch.stack([f[-1] for f in feats]), dec))
    row = 0
    for i, (s, ref) in enumerate(zip(seqs, refs)):
        n = len(s) - 2
        torch.testing.assert_close(out1[row : row + n], ref[:-1], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(out2[i], ref[-1], atol=2e-4, rtol=1e-4)
        row += n
    assert (refs[0].std(dim=-1) > 0.1).all()  # not a flat distribution: the comparison means something


def test_mtp_inputs_matter(case):
    """Guard against a vacuous reference: the logits change with the target's streams and with the next token."""
    _, _, hf, block_model, extras = case
    tokens = [5, 17, 42, 99, 3, 250, 7]
    streams = target_streams(hf, tokens[:-1])
    base = mtp_reference(hf, block_model, extras, tokens[1:], streams)
    other = target_streams(hf, [200, 201, 202, 203, 204, 205])
    assert (mtp_reference(hf, block_model, extras, tokens[1:], other) - base).abs().max() > 1e-2
    assert (mtp_reference(hf, block_model, extras, [9] + tokens[2:], streams) - base)[0].abs().max() > 1e-2


def test_missing_mtp_weights_name_the_checkpoint(tmp_path):
    save_tiny_dsv4(tmp_path)
    target = load_model(tmp_path, torch.float32, torch.device("cpu"), load_tokenizer=False).model
    with pytest.raises(ModelLoadError, match=f"{tmp_path}.*no DeepSeek-V4 MTP layer 0"):
        load_dsv4_mtp(target, str(tmp_path))
