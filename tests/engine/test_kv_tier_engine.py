"""The KV tier end to end (--kv-offload-bytes, --kv-offload-dir): a device cache of about three sequences,
20 conversations revisited (the second turn is the first turn's prompt and answer plus a new message), chunked
prefill, several sequences at once (so preemptions too): greedy output identical with and without the tier,
in host memory alone and spilling to a small disk level, with an FP8 cache too; the tier's hits counted in the
engine stats. (Salts and adapters: test_kv_tier_blocks.py.)"""

from __future__ import annotations

import os
import random

import pytest
import torch

from tests.models.test_deepseek import save_tiny_deepseek
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.sampling_params import SamplingParams

N_CONV, FIRST, NEW, ANSWER, SECOND_ANSWER = 20, 32, 8, 4, 16  # long second answers: decodes need blocks


def _conversations(engine: LLMEngine, n_conv: int = N_CONV):
    """Both turns of every conversation: (first-turn outputs, second-turn outputs)."""
    rng = random.Random(0)
    def run(prompts, tag, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"{tag}{i}", p, params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        return [done[f"{tag}{i}"] for i in range(len(prompts))]

    firsts = [[rng.randrange(1, 320) for _ in range(FIRST)] for _ in range(n_conv)]
    answers = run(firsts, "t1-", ANSWER)
    seconds = [f + a + [rng.randrange(1, 320) for _ in range(NEW)] for f, a in zip(firsts, answers)]
    return answers, run(seconds, "t2-", SECOND_ANSWER)


def _engine(path: str, **kw) -> LLMEngine:
    # a second turn is 44 tokens = 11 blocks: 36 blocks hold about three; 32-token steps chunk the second turns
    # and the running second turns' decodes preempt one another
    return LLMEngine(model=path, block_size=4, num_kv_blocks=36, max_num_batched_tokens=32, max_num_seqs=8, **kw)


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    out = _conversations(engine)
    stats = engine.get_stats()
    engine.shutdown()
    return out, stats


def test_host_tier_output_identical_and_hits_counted(tiny_llama_dir, baseline):
    (want, base) = baseline
    engine = _engine(tiny_llama_dir, kv_offload_bytes=64 * 2**20)
    got = _conversations(engine)
    s = engine.get_stats()
    engine.block_manager.check_invariants()
    engine.shutdown()
    assert got == want
    assert s.kv_offload_hits_total > 0 and s.kv_offload_loaded_blocks_total * 4 == s.kv_offload_hits_total
    assert s.kv_offload_saved_blocks_total > 0 and s.kv_offload_failed_blocks_total == 0
    assert s.kv_offload_misses_total == s.kv_offload_queries_total - s.kv_offload_hits_total
    assert s.kv_offload_host_bytes > 0 and s.kv_offload_disk_bytes == 0
    assert s.computed_prompt_tokens_total < base.computed_prompt_tokens_total  # loaded, not recomputed
    assert s.num_preemptions_total > 0 and base.num_preemptions_total > 0  # re-admissions went through the tier
    assert base.kv_offload_hits_total == 0 and base.kv_offload_queries_total == 0


def test_disk_tier_spills_reloads_and_stays_bounded(tiny_llama_dir, baseline, tmp_path):
    (want, _) = baseline
    engine = _engine(tiny_llama_dir)
    block = engine.kv_connector.io.block_nbytes if engine.kv_connector is not None else None
    engine.shutdown()
    assert block is None  # the tier is off unless asked for
    engine = _engine(tiny_llama_dir, kv_offload_bytes=1, kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=400_000)
    block = engine.kv_connector.io.block_nbytes
    tier_dir = engine.kv_connector.store.dir
    got = _conversations(engine)
    s = engine.get_stats()
    files = [f for f in os.listdir(tier_dir) if f.endswith(".kv")]
    engine.shutdown()
    assert got == want
    assert s.kv_offload_host_bytes == 0 and s.kv_offload_spilled_blocks_total > 0  # every block on disk
    assert s.kv_offload_hits_total > 0
    assert s.kv_offload_dropped_blocks_total > 0 and s.kv_offload_disk_bytes <= 400_000  # bounded: LRU removed
    assert len(files) == s.kv_offload_disk_blocks == s.kv_offload_disk_bytes // block
    assert not os.path.exists(tier_dir)  # shutdown removes the tier's files


def test_fp8_cache_output_identical_with_the_tier(tiny_llama_dir):
    outs, stats = [], []
    for kw in ({}, {"kv_offload_bytes": 64 * 2**20}):
        engine = _engine(tiny_llama_dir, kv_cache_dtype="fp8", **kw)
        assert torch.float8_e4m3fn in engine.runner.kv_caches
        outs.append(_conversations(engine))
        stats.append(engine.get_stats())
        engine.shutdown()
    assert outs[0] == outs[1]
    assert stats[1].kv_offload_hits_total > 0


def test_mla_latent_cache_output_identical_with_the_tier(tmp_path):
    """DeepSeek-V3's latent cache ([layers, blocks, block_size, latent + rope], block axis 1), over disk."""
    save_tiny_deepseek(tmp_path / "model")
    outs, stats = [], []
    for kw in ({}, {"kv_offload_bytes": 0, "kv_offload_dir": str(tmp_path / "tier")}):
        engine = _engine(str(tmp_path / "model"), **kw)
        assert not engine.runner.kv_cache.shape[1] == 2  # the latent layout, not [L, 2, NB, ...]
        outs.append(_conversations(engine, n_conv=8))
        stats.append(engine.get_stats())
        engine.shutdown()
    assert outs[0] == outs[1]
    assert stats[1].kv_offload_hits_total > 0 and stats[1].kv_offload_disk_bytes > 0


def test_what_the_tier_cannot_serve_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="speculative"):
        _engine(tiny_llama_dir, kv_offload_bytes=2**20,
                speculative_config={"method": "ngram", "num_speculative_tokens": 2})
