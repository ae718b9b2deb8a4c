"""DeepSeek-V3.2 and GLM-MoE-DSA (DeepSeek Sparse Attention over MLA): logits equal transformers' (fp32)
at prefill and over 5 decode steps with a top-k smaller than the context (so the selection matters);
greedy generations equal alone, batched, with chunked prefill and prefix-cache hits; batches of contexts
longer than index_topk beside short ones, with mixed prefill + decode steps, equal transformers per request
(reference and Triton paths); the cache holds latent + rope key + index key per token."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_deepseek import YARN, _engine, _hf_greedy
from tests.tiny_models import (
    assert_batch_matches_hf,
    assert_step_logits_match_hf,
    greedy_tokens,
    hf_logits,
    paths_reached,
    run_batch,
    run_capturing_logits,
    save_tiny_model,
)
from tokenfab.layers.dsa import SparseLatentAttention

DSA_COMMON = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3, routed_scaling_factor=2.5,
    norm_topk_prob=True, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16,
    v_head_dim=24, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
    index_topk=6, index_head_dim=32, index_n_heads=16, rope_parameters=YARN,
)
CASES = {
    "deepseek_v32": {},
    # layer 1 reuses layer 0's selection; layer 2 runs its own indexer
    "glm_moe_dsa": dict(indexer_types=["full", "shared", "full"]),
}
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], [1, 2, 3], list(range(30, 60))]


def save_tiny_dsa(model_type: str, path, seed: int = 0, **overrides):
    import transformers

    cls = {"deepseek_v32": transformers.DeepseekV32Config, "glm_moe_dsa": transformers.GlmMoeDsaConfig}[model_type]
    return save_tiny_model(cls(**{**DSA_COMMON, **CASES[model_type], **overrides}), path, seed)


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_dsa(request.param, path)
    return request.param, hf, path, _engine(path)


def test_structure_and_cache(tiny):
    case, hf, _, engine = tiny
    cfg = hf.config
    attn = [m for m in engine.runner.model.modules() if isinstance(m, SparseLatentAttention)]
    assert [a.indexer is not None for a in attn] == ([True, False, True] if case == "glm_moe_dsa" else [True] * 3)
    per_token = cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim
    assert engine.runner.kv_cache.shape == (3, 64, 4, 1, per_token)


def test_prefill_and_decode_logits_match(tiny):
    _, hf, _, engine = tiny
    assert_step_logits_match_hf(engine, hf, PROMPTS)


def test_batched_chunked_and_prefix_cached_generations(tiny):
    _, hf, path, engine = tiny
    prompts = [[5, 17, 42, 99], [1, 2, 3, 4, 5, 6, 7, 8, 9], [200] * 13, [7]]
    alone = [greedy_tokens(engine, [p], 6, f"a{i}-")[0] for i, p in enumerate(prompts)]
    assert greedy_tokens(engine, prompts, 6, "b") == alone
    assert alone[2] == _hf_greedy(hf, prompts[2], 6)
    chunked = _engine(path, max_num_batched_tokens=8, enable_prefix_caching=True)
    long = list(range(40, 63))
    shared = long[:16] + [7, 8, 9]
    expect = [_hf_greedy(hf, p, 5) for p in (long, shared)]
    assert greedy_tokens(chunked, [long], 5, "c") == [expect[0]]
    computed = chunked.computed_prompt_tokens_total
    assert greedy_tokens(chunked, [long, shared], 5, "d") == expect
    assert chunked.computed_prompt_tokens_total - computed <= len(long) + len(shared) - 2 * 16


# Issue 12 part 5: contexts past index_topk (6) batched with short ones, prompts arriving while others
# decode (mixed prefill + decode steps), chunked prefills (8-token budget), 4-token pages (contexts
# cross many page boundaries). Per request, every step's token and top log-probs equal transformers'.
BATCH_PROMPTS = [[5, 17, 42], list(range(30, 43)), [1, 2, 3, 4, 5, 6, 7], [250]]
BATCH_ARRIVALS = [0, 0, 2, 5]
ALL_PATHS = {"mixed", "chunked", "decodes", "long+short", "long+short decodes"}


def test_batched_long_and_short_contexts_match_transformers(tiny):
    _, hf, path, _ = tiny
    engine = _engine(path, max_num_batched_tokens=8)
    tokens, logprobs, batches = run_batch(engine, BATCH_PROMPTS, 10, BATCH_ARRIVALS)
    assert paths_reached(batches, hf.config.index_topk) == ALL_PATHS
    assert_batch_matches_hf(hf, BATCH_PROMPTS, tokens, logprobs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_indexer_ties_do_not_depend_on_the_batch(case, tmp_path):
    """Two indexer heads: a key scores exactly 0 whenever both ReLUs are 0 (about a quarter of the keys),
    so the k-th score is often a tie. The top-k broke ties by ``torch.topk``'s own order, which depends
    on the row's width: a short sequence padded to a long neighbour's width selected other keys than
    alone, and its tokens changed when batched. Ties now go to the lowest positions, in any batch."""
    save_tiny_dsa(case, tmp_path, index_n_heads=2)
    engine = _engine(tmp_path)
    prompts = [[5, 17, 42], [1, 2, 3, 4, 5, 6, 7, 8], list(range(30, 43)), [250, 3, 9, 77, 12, 5, 6, 1, 4]]
    alone = [run_batch(engine, [p], 12) for p in prompts]
    tokens, logprobs, _ = run_batch(engine, prompts, 12)
    for i, (one_tokens, one_logprobs, _) in enumerate(alone):
        assert tokens[i] == one_tokens[0], f"request {i}: batched {tokens[i]} != alone {one_tokens[0]}"
        for s, (got, ref) in enumerate(zip(logprobs[i], one_logprobs[0])):
            assert got.keys() == ref.keys(), (i, s)
            torch.testing.assert_close(torch.tensor(list(got.values())), torch.tensor(list(ref.values())),
                                       atol=1e-4, rtol=0)


def _through_triton(tmp_path, monkeypatch, prompts, arrivals, max_tokens: int, **overrides) -> None:
    from tokenfab.kernels._launch import interpreting

    if not (torch.cuda.is_available() or interpreting()):
        pytest.skip("triton was imported without the interpreter")
    hf = save_tiny_dsa("glm_moe_dsa", tmp_path, **overrides)
    engine = _engine(tmp_path, max_num_batched_tokens=8)
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    tokens, logprobs, batches = run_batch(engine, prompts, max_tokens, arrivals)
    assert {"mixed", "long+short decodes"} <= paths_reached(batches, hf.config.index_topk)
    assert_batch_matches_hf(hf, prompts, tokens, logprobs)


def test_through_triton_kernels(tmp_path, monkeypatch):
    """The engine on the Triton kernels (interpreter): indexer scores, top-k, sparse MLA, MoE; a context
    longer than index_topk (8 prompt tokens) beside a short prompt arriving mid-decode (a mixed step, then
    long and short decodes) equals transformers per request. Two layers: a dense one with its own indexer,
    a MoE one reusing its selection (the slow twin: the three-layer model, three prompts)."""
    _through_triton(tmp_path, monkeypatch, [list(range(30, 38)), [5, 17, 42]], [0, 1], 4,
                    num_hidden_layers=2, indexer_types=["full", "shared"])


@pytest.mark.slow
def test_through_triton_kernels_three_prompts(tmp_path, monkeypatch):
    _through_triton(tmp_path, monkeypatch, BATCH_PROMPTS[:3], BATCH_ARRIVALS[:3], 6)


def test_selection_matters(tiny):
    """Guard against a vacuous comparison: with top-6 of up to 35 keys, transformers' own logits differ
    from dense MLA (every key selected), and ours follow the sparse ones."""
    _, hf, _, engine = tiny
    ids = list(range(30, 60))
    sparse = hf_logits(hf, ids)
    indexers = [m for m in hf.modules() if hasattr(m, "index_topk")]
    for m in indexers:
        m.index_topk = 1000
    try:
        dense = hf_logits(hf, ids)
    finally:
        for m in indexers:
            m.index_topk = 6
    assert (sparse[-1] - dense[-1]).abs().max() > 1e-2
    _, step_logits = run_capturing_logits(engine, ids, 1)
    torch.testing.assert_close(step_logits[0][0], sparse[-1], atol=1e-3, rtol=0)
