"""DeepSeek-V4 (sliding / CSA / HCA attention over compressed paged caches, mHC, hash and sqrtsoftplus MoE):
a tiny random checkpoint in the official layout; prefill logits and every decode step equal transformers'
(fp32) for prompts longer than the window (6), both ratios (4, 8) and the indexer's top-2; batches of long
and short prompts with chunked prefill (chunks not aligned to the windows), mixed prefill + decode steps, two
block sizes (a compressed entry per block and one every other block), and prefix-cache hits, per request
equal to transformers."""

from __future__ import annotations

import pytest
import torch

from tests.models.dsv4_tiny import DSV4_TINY, dsv4_engine, one_torch_thread, save_tiny_dsv4
from tests.tiny_models import (
    assert_batch_matches_hf,
    greedy_tokens,
    hf_logits,
    paths_reached,
    run_batch,
    run_capturing_logits,
)
from tokenfab.layers.dsv4_attention import DeepseekV4Attention
from tokenfab.models.deepseek_v4 import DeepseekV4MoE

PROMPTS = [list(range(30, 60)), [5, 17, 42], [7, 250, 3, 9, 77, 12, 5, 6, 1, 4, 100, 101, 102]]
WINDOW = DSV4_TINY["sliding_window"]


_engine = dsv4_engine


@pytest.fixture(autouse=True)
def _one_thread():
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4")
    hf = save_tiny_dsv4(path)
    return hf, path, _engine(path)


def test_structure_and_cache_shapes(tiny):
    """Every attention type and both routings are built; each layer keeps a ring of token rows per sequence (its
    state slot: kv, then the compressors' C and Z rows, as many as a later step reads) and, for CSA and HCA, the
    compressed entries in the paged cache: one a block at ratio 4 and block size 4, one every other block at
    ratio 8 (the entry sits in the block of its window's last token)."""
    hf, _, engine = tiny
    cfg = hf.config
    attn = [m for m in engine.runner.model.modules() if isinstance(m, DeepseekV4Attention)]
    moe = [m for m in engine.runner.model.modules() if isinstance(m, DeepseekV4MoE)]
    assert [a.layer_type for a in attn] == cfg.layer_types
    assert [m.hashed for m in moe] == [t == "hash_moe" for t in cfg.mlp_layer_types]
    d, di = cfg.head_dim, cfg.index_head_dim
    csa_row = d + 2 * (2 * d) + 2 * (2 * di)  # kv; C, Z at 2d (two series); the indexer's at 2 d_I
    rows = engine.runner.num_state_slots + 1  # a scratch row for padded decode rows
    # ring lengths: the window (6) for the sliding layer; 2 x 4 (CSA) and 8 (HCA) past it
    assert [tuple(a.ring.shape) for a in attn] == [(rows, 6, d), (rows, 8, csa_row), (rows, 8, 3 * d),
                                                   (rows, 8, csa_row)]
    assert tuple(attn[1].comp_cache.shape) == (64, 1, d + di)
    assert tuple(attn[2].comp_cache.shape) == (64, 1, d)
    assert attn[0].comp_cache is None
    engine.runner.capture_decode_graphs(4, 64)  # the PyTorch paths sync with the host: decode stays eager
    assert engine.runner.graphs is None


def test_prefill_and_decode_logits_match(tiny):
    """Per prompt alone: the logits of the prefill's last row and of each of 7 decode steps equal transformers'
    (fp32), the engine's tokens are transformers' argmax, every block is freed (prefill chunks that end on a
    block boundary, as the state slots' snapshots want, sample nothing)."""
    hf, _, engine = tiny
    for prompt in PROMPTS:
        generated, step_logits = run_capturing_logits(engine, list(prompt), 8)
        step_logits = [row for row in step_logits if row.shape[0]]
        full = list(prompt) + generated
        ref = hf_logits(hf, full)
        assert len(generated) == len(step_logits) == 8
        for s, logits in enumerate(step_logits):
            pos = len(prompt) - 1 + s
            torch.testing.assert_close(logits[0], ref[pos], atol=1e-3, rtol=0)
            assert int(ref[pos].argmax()) == full[pos + 1]
        assert engine.block_manager.num_used_blocks == 0


def test_selection_and_compression_matter(tiny):
    """Guard against a vacuous comparison: transformers' logits for the long prompt change when the indexer
    keeps every entry, and when the HCA entries are dropped; ours follow the configured model."""
    hf, _, _ = tiny
    ids = PROMPTS[0]
    base = hf_logits(hf, ids)
    indexers = [m for m in hf.modules() if type(m).__name__ == "DeepseekV4Indexer"]
    assert indexers
    for m in indexers:
        m.index_topk = 64
    try:
        assert (hf_logits(hf, ids) - base).abs().max() > 1e-2
    finally:
        for m in indexers:
            m.index_topk = DSV4_TINY["index_topk"]
    hca = [m for m in hf.modules() if type(m).__name__ == "DeepseekV4HCACompressor"]
    saved = [m.kv_norm.weight.detach().clone() for m in hca]
    try:
        for m in hca:
            m.kv_norm.weight.data.zero_()
        assert (hf_logits(hf, ids) - base).abs().max() > 1e-2
    finally:
        for m, w in zip(hca, saved):
            m.kv_norm.weight.data.copy_(w)


# Prompts longer than the window and the ratios beside short ones, arriving while others decode; chunks of
# 7 tokens (windows of 4 and 8 close in later chunks and in decode steps).
BATCH_PROMPTS = [list(range(30, 53)), [5, 17, 42], list(range(100, 111)), [250]]
BATCH_ARRIVALS = [0, 0, 2, 5]
ALL_PATHS = {"mixed", "chunked", "decodes", "long+short", "long+short decodes"}


@pytest.mark.parametrize("block_size", [4, pytest.param(8, marks=pytest.mark.slow)])  # 8: the slow twin
def test_batched_chunked_long_and_short_match_transformers(tiny, block_size, monkeypatch):
    """Also with the queries attending in slices of a few tokens (a tiny ``gather_budget``), as long chunks do."""
    hf, path, _ = tiny
    monkeypatch.setattr(DeepseekV4Attention, "gather_budget", 1000)
    engine = _engine(path, block_size=block_size, num_kv_blocks=64 // (block_size // 4), max_num_batched_tokens=7)
    tokens, logprobs, batches = run_batch(engine, BATCH_PROMPTS, 8, BATCH_ARRIVALS)
    assert paths_reached(batches, WINDOW) == ALL_PATHS
    assert_batch_matches_hf(hf, BATCH_PROMPTS, tokens, logprobs)


def test_llm_alone_and_batched_greedy_equal_transformers(tiny):
    """Through the public ``LLM`` class: each prompt alone and all in one call (chunks of 5 tokens), 8 greedy
    tokens equal to transformers' argmax at every step."""
    from tokenfab import LLM, SamplingParams

    hf, path, _ = tiny
    llm = LLM(model=str(path), block_size=4, num_kv_blocks=64, max_num_batched_tokens=5, cpu_threads=1)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = [list(llm.generate(p, params)[0].outputs[0].token_ids) for p in PROMPTS]
    batched = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    assert batched == alone
    for prompt, gen in zip(PROMPTS, alone):
        ref = hf_logits(hf, prompt + gen)[len(prompt) - 1 : -1].argmax(dim=-1)
        assert gen == ref.tolist()


def test_prefix_cache_hits_match_transformers(tiny):
    """Prefix caching through the state slots' snapshots (the ring after every block boundary a chunk ends on):
    a request parting from a finished one after 16 tokens leaves a snapshot there, and a third request sharing
    those 16 tokens starts from it and the cached blocks (their compressed entries sit in the block of their
    window's last token); all three equal transformers."""
    hf, path, _ = tiny
    cached = _engine(path, enable_prefix_caching=True)
    long = list(range(40, 63))
    shared = long[:16] + [7, 8, 9, 10, 11]
    third = long[:16] + [12, 13, 250]
    tokens, logprobs, _ = run_batch(cached, [long], 5)
    tokens2, logprobs2, _ = run_batch(cached, [shared], 5)
    before = cached.computed_prompt_tokens_total
    tokens3, logprobs3, _ = run_batch(cached, [third], 5)
    assert cached.computed_prompt_tokens_total - before <= len(third) - 16
    assert_batch_matches_hf(hf, [long, shared, third], tokens + tokens2 + tokens3, logprobs + logprobs2 + logprobs3)


def test_compressed_entries_are_written_once_per_window(tiny):
    """After a 23-token prompt, the compressed entries of the 5 closed CSA windows (ratio 4) and the 2 HCA
    windows (ratio 8) are non-zero and the entries of windows not yet closed are still zero."""
    _, path, _ = tiny
    engine = _engine(path, num_kv_blocks=16)
    greedy_tokens(engine, [list(range(30, 53))], 1, "w")
    attn = [m for m in engine.runner.model.modules() if isinstance(m, DeepseekV4Attention)]
    written = [int((a.comp_cache.abs().sum(dim=-1) > 0).sum()) for a in attn[1:3]]
    assert written == [23 // 4, 23 // 8]
    assert torch.isfinite(attn[1].comp_cache).all()


def test_through_triton_kernels(tiny, monkeypatch):
    """The engine with every op on its Triton kernel (the interpreter here; mHC's fused kernels among them): a
    prompt longer than the window and both ratios beside a short one arriving mid-decode equals transformers."""
    from tokenfab.kernels._launch import interpreting

    if not (torch.cuda.is_available() or interpreting()):
        pytest.skip("triton was imported without the interpreter")
    hf, path, _ = tiny
    engine = _engine(path, max_num_batched_tokens=16)
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    prompts = [list(range(30, 50)), [5, 17, 42]]
    tokens, logprobs, batches = run_batch(engine, prompts, 4, [0, 2])
    assert "mixed" in paths_reached(batches, WINDOW)
    assert_batch_matches_hf(hf, prompts, tokens, logprobs)


def test_long_context_past_the_original_yarn_context(tiny):
    """A 300-token prompt (YaRN's original context is 128; 75 CSA entries of which the indexer keeps 2, 37 HCA
    entries) in 64-token chunks, then 3 decode steps: every step's top log-probabilities equal transformers'."""
    hf, path, _ = tiny
    prompt = [(i * 37 + 11) % 320 for i in range(300)]
    engine = _engine(path, num_kv_blocks=96, max_num_batched_tokens=64)
    tokens, logprobs, batches = run_batch(engine, [prompt], 3)
    assert "chunked" in paths_reached(batches, WINDOW)
    assert_batch_matches_hf(hf, [prompt], tokens, logprobs)


def test_request_flood_with_preemption_and_reused_blocks(tiny):
    """Twelve requests (3 to 30 prompt tokens) into 96 tokens of cache (about three sequences): requests are
    preempted and recomputed, blocks pass from one request to the next with stale rows and entries in them
    (nothing reads an entry its own request has not written), and every request equals transformers alone."""
    hf, path, _ = tiny
    prompts = [[(i * 31 + j * 7 + 3) % 320 for j in range(3 + (i * 5) % 28)] for i in range(12)]
    engine = _engine(path, num_kv_blocks=24, max_num_batched_tokens=16)
    tokens, logprobs, _ = run_batch(engine, prompts, 6, [i // 3 for i in range(12)])
    assert engine.get_stats().num_preemptions_total > 0
    assert_batch_matches_hf(hf, prompts, tokens, logprobs)
    assert engine.block_manager.num_used_blocks == 0


def test_decode_through_the_graph_batch(tiny):
    """The CUDA-graph decode path, as far as a CPU runs it: decode steps go through ``DecodeGraphs`` (the batch
    padded to a captured size with rows of slot -1, context 1 and block 0, max_context_len the model's length;
    on CPU the static batch runs eagerly), whose windows close without a host sync (every token pooled, the
    closing ones stored). The class keeps ``supports_cuda_graphs = False`` until a GPU has run it."""
    hf, path, _ = tiny
    engine = _engine(path)
    engine.runner.model.supports_cuda_graphs = True
    engine.runner.capture_decode_graphs(4, engine.max_model_len)
    graphs = engine.runner.graphs
    assert graphs is not None
    replays = []
    orig = graphs.replay

    def spy(batch, n):
        replays.append((batch.num_seqs, n))
        return orig(batch, n)

    graphs.replay = spy
    prompts = BATCH_PROMPTS[:3]
    tokens, logprobs, _ = run_batch(engine, prompts, 6)
    assert (3, 4) in replays  # three sequences decoding, padded to the captured size 4
    assert_batch_matches_hf(hf, prompts, tokens, logprobs)
