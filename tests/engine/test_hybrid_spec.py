"""Speculative decoding over the hybrid cache (issue 29): rejected drafts taken back out of the Gated DeltaNet
states (tokenfab/speculative/state_rollback.py), on tiny random Qwen3.5 / Qwen3-Next checkpoints with their MTP
layer in the official layout (tests/models/hybrid_mtp.py).

- An oracle proposer that drafts the plain engine's own continuation with planted mistakes: every verify mixes
  all-accepted, partly accepted and fully rejected runs (random MTP weights are almost never accepted), so the
  restore-and-replay path runs with 0 < m < k. Greedy tokens equal plain decoding, alone and batched, and a
  negative control (no rollback) changes them.
- MTP speculation, k = 1 and 2: greedy equal to plain decoding alone, batched (mixed lengths, prompts across
  the 64-token chunk of the gated-delta prefill and across blocks), with prefix hits through state snapshots,
  and with chunked prefill and preemption (tests/speculative/spec_cases.py).
- A model whose recurrent layers cannot be replayed (the toy hybrid) is refused with a clear error.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.hybrid_mtp import save_tiny_hybrid_mtp
from tests.speculative.spec_cases import check_greedy_identity, outputs, plain_llm, random_prompts
from tokenfab import LLM
from tokenfab.engine.requests.sequence import Sequence
from tokenfab.speculative.state_rollback import RecurrentStateRollback

VOCAB = 320
N = 12
PROMPTS = random_prompts(VOCAB, (3, 11, 30, 70), seed=7)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_mtp")
    save_tiny_hybrid_mtp("qwen3_5_text", path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield str(path)
    torch.set_num_threads(threads)


class PlantedOracle:
    """Drafts the known greedy continuation, with draft j wrong wherever (output index + j) % 4 == 2."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]]) -> None:
        self.expected = expected

    def propose(self, seq: Sequence, k: int) -> list[int]:
        cont = self.expected[tuple(seq.token_ids[: seq.num_prompt_tokens])]
        n = seq.num_output_tokens
        drafts = cont[n : n + k]
        return [(t + 1) % VOCAB if (n + j) % 4 == 2 else t for j, t in enumerate(drafts)]

    def release(self, request_id: str) -> None:
        pass


def _oracle_llm(path: str, expected, **kw) -> LLM:
    llm = LLM(model=path, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **kw)
    llm.engine.spec.proposer = PlantedOracle(expected)
    return llm


KW = dict(block_size=4, num_kv_blocks=200, dtype="float32", cpu_threads=1)


def test_partly_accepted_drafts_leave_the_state_of_the_accepted_tokens(qwen35, monkeypatch):
    ref = outputs(plain_llm(qwen35, **KW), PROMPTS, N)
    expected = {tuple(p): r for p, r in zip(PROMPTS, ref)}
    llm = _oracle_llm(qwen35, expected, **KW)
    for p, r in zip(PROMPTS[:2], ref[:2]):  # alone
        assert outputs(llm, [p], N) == [r]
    assert outputs(llm, PROMPTS, N) == ref  # batched
    spec = llm.engine.spec
    assert spec.num_accepted_tokens > 0 and spec.num_accepted_tokens < spec.num_draft_tokens
    assert spec.rollback is not None and spec.rollback.replayed > 0
    # negative control: without the rollback the rejected drafts stay folded into the states
    monkeypatch.setattr(RecurrentStateRollback, "after_accept", lambda self, seqs, emitted: None)
    bad = _oracle_llm(qwen35, expected, **KW)
    assert outputs(bad, PROMPTS, N) != ref


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_greedy_equals_plain_batched_chunked_preempted(qwen35, k):
    cfg = {"method": "mtp", "num_speculative_tokens": k}
    plain = plain_llm(qwen35, **KW)
    spec = LLM(model=qwen35, speculative_config=cfg, **KW)
    tight = LLM(
        model=qwen35,
        speculative_config=cfg,
        block_size=4,
        num_kv_blocks=28,
        max_num_batched_tokens=16,
        dtype="float32",
        cpu_threads=1,
    )
    check_greedy_identity(plain, spec, tight, PROMPTS, N)
    assert spec.engine.spec.rollback.replayed > 0
    for llm in (spec, tight):
        bm = llm.engine.block_manager
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks
        assert bm.state_slots.num_free == bm.state_slots.num_slots


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_mtp_greedy_identity_moe_families(tmp_path, family):
    save_tiny_hybrid_mtp(family, tmp_path)
    cfg = {"method": "mtp", "num_speculative_tokens": 2}
    plain = plain_llm(str(tmp_path), **KW)
    spec = LLM(model=str(tmp_path), speculative_config=cfg, **KW)
    tight = LLM(
        model=str(tmp_path),
        speculative_config=cfg,
        block_size=4,
        num_kv_blocks=28,
        max_num_batched_tokens=16,
        dtype="float32",
        cpu_threads=1,
    )
    check_greedy_identity(plain, spec, tight, PROMPTS, N)


def test_recurrent_layers_without_replay_are_refused(tmp_path):
    from tests.engine.hybrid_toy import save_toy_hybrid

    save_toy_hybrid(tmp_path)
    with pytest.raises(ValueError, match="rejected draft token cannot be taken back out"):
        LLM(model=str(tmp_path), speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **KW)


@pytest.mark.slow
def test_partial_acceptance_through_the_triton_kernels(qwen35, monkeypatch):
    """The verify, the restore and the replay through the Triton gated-delta / conv kernels (the interpreter on
    a CPU): planted mistakes, greedy equal to plain decoding on the same kernels (about 5 minutes on a CPU)."""
    from tokenfab.kernels._launch import interpreting

    if not (torch.cuda.is_available() or interpreting()):
        pytest.skip("triton was imported without the interpreter")
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    prompts = [[5, 9, 13, 200, 17, 3, 8], [40, 41, 42]]
    ref = outputs(plain_llm(qwen35, **KW), prompts, 8)
    llm = _oracle_llm(qwen35, {tuple(p): r for p, r in zip(prompts, ref)}, **KW)
    assert outputs(llm, prompts, 8) == ref
    assert llm.engine.spec.rollback.replayed > 0 and llm.engine.spec.num_accepted_tokens > 0
