"""MTP speculation on DeepSeek-V4 in the engine (tokenfab/speculative/dsv4_mtp.py through feature_draft.py): a
tiny random V4 (window 6, CSA ratio 4, HCA ratio 8, indexer top-2) whose checkpoint carries ``mtp.0.*`` in
DeepSeek's layout. Greedy outputs with speculation equal plain greedy decoding, each prompt alone and all
batched, prompts longer than the window (and both ratios) beside short ones, for k = 1 and 2; drafts are
accepted (the MTP layer's first draft is checked against the re-statement of test_dsv4_mtp.py, fed
transformers' streams, so the draft is the MTP layer's prediction and not noise); a checkpoint without
``mtp.*`` tensors is refused with an error naming it."""

from __future__ import annotations

import pytest

from tests.models.dsv4_tiny import DSV4_TINY, one_torch_thread, save_tiny_dsv4, save_tiny_dsv4_mtp
from tests.speculative.spec_cases import outputs, plain_llm, record_drafts
from tests.speculative.test_dsv4_mtp import mtp_reference, target_streams
from tokenfab import LLM
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.layers.dsv4_attention import DeepseekV4Attention

WINDOW = DSV4_TINY["sliding_window"]
# longer than the window (6), both ratios (4, 8) and the indexer's top-2, beside short ones
PROMPTS = [list(range(30, 53)), [5, 17, 42], [7, 250, 3, 9, 77, 12, 5, 6, 1, 4, 100, 101, 102], [250]]
KW = dict(block_size=4, num_kv_blocks=96, cpu_threads=1)


@pytest.fixture(autouse=True)
def _one_thread():
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4-mtp-engine")
    hf = save_tiny_dsv4(path)
    block_model, extras = save_tiny_dsv4_mtp(path)
    plain = plain_llm(str(path), **KW)
    return str(path), hf, block_model, extras, outputs(plain, PROMPTS, 10)


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_identical_with_mtp_speculation(tiny, k):
    path, hf, block_model, extras, ref = tiny
    spec = LLM(model=path, speculative_config={"method": "mtp", "num_speculative_tokens": k}, **KW)
    seen = record_drafts(spec)
    assert outputs(spec, PROMPTS, 10) == ref  # batched, long and short mixed
    for p, r in zip(PROMPTS, ref):  # alone
        assert outputs(spec, [p], 10) == [r]
    stats = spec.engine.spec
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepted drafts, and rejected ones rolled back
    rings = [m.ring.shape[1] for m in spec.engine.model.modules() if isinstance(m, DeepseekV4Attention)]
    assert rings[0] == WINDOW + k  # the sliding layer's ring: its window and k rows for the drafts
    assert spec.engine.spec.proposer.layer.block.attn.ring.shape[1] == WINDOW + k
    assert any(len(t) > WINDOW + 2 for t, _ in seen)  # drafted past the window
    checked = 0
    for tokens, drafts in seen[:: max(len(seen) // 6, 1)]:  # draft 1 is the MTP layer's argmax
        logits = mtp_reference(hf, block_model, extras, tokens[1:], target_streams(hf, tokens[:-1]))[-1]
        top = logits.topk(2).values
        if top[0] - top[1] > 1e-3:
            assert drafts[0] == int(logits.argmax()), tokens
            checked += 1
    assert checked >= 2


def test_chunked_prefill_and_preemption_with_mtp(tiny):
    """A small token budget (prompts in chunks of 5, windows closing in later chunks) and a cache for about two
    sequences (preemption, recompute from position 0): the same greedy tokens."""
    path, *_, ref = tiny
    tight = LLM(
        model=path,
        block_size=4,
        num_kv_blocks=10,
        max_num_batched_tokens=5,
        cpu_threads=1,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
    )
    assert outputs(tight, PROMPTS, 10) == ref
    assert tight.engine.scheduler.num_preemptions_total > 0
    assert tight.engine.spec.num_accepted_tokens > 0


def test_mtp_without_mtp_weights_is_refused(tmp_path):
    save_tiny_dsv4(tmp_path)
    with pytest.raises(ValueError, match=f"{tmp_path}.*no DeepSeek-V4 MTP layer"):
        LLMEngine(
            model=str(tmp_path), num_kv_blocks=32, speculative_config={"method": "mtp", "num_speculative_tokens": 1}
        )
