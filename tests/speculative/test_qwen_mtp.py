"""The Qwen3-Next / Qwen3.5 MTP layer (tokenfab/speculative/qwen_mtp.py) against the plain re-statement of its
formula (tests/models/hybrid_mtp.py: transformers' decoder layer + fc / pre-fc norms / final norm; transformers
itself has no MTP layer for these models), in each released layout: Qwen3-Next (MoE, one tensor per expert),
Qwen3.5 dense and Qwen3.5-MoE (stacked experts), both as the vision-language wrappers. Then the draft made to
agree with the target (a copying target and an MTP layer that passes the target's feature through): drafts
are accepted. Loading errors are clear.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.hybrid_models import save_tiny_hybrid
from tests.models.hybrid_mtp import save_tiny_hybrid_mtp
from tests.speculative.spec_cases import outputs, plain_llm
from tokenfab import LLM
from tokenfab.forward_batch import ForwardBatch

KW = dict(block_size=4, num_kv_blocks=64, dtype="float32", cpu_threads=1)
MTP1 = {"method": "mtp", "num_speculative_tokens": 1}


def _batch(ids: list[int]) -> ForwardBatch:
    n = len(ids)
    return ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=torch.arange(n),
        slot_mapping=torch.arange(n),
        block_tables=torch.arange(16, dtype=torch.int32)[None],
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        context_lens=torch.tensor([n], dtype=torch.int32),
        logits_indices=torch.tensor([n - 1]),
        max_query_len=n,
        max_context_len=n,
    )


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_mtp_layer_matches_the_restatement(tmp_path, family):
    hf, ref = save_tiny_hybrid_mtp(family, tmp_path)
    llm = LLM(model=str(tmp_path), speculative_config=MTP1, **KW)
    layer = llm.engine.spec.proposer.layer
    assert type(layer).__name__ == "QwenMTPLayer"
    assert type(layer.layers[0].mlp).__name__ == ("LlamaMLP" if family == "qwen3_5" else "FusedMoE")
    ids = list(range(7, 37))
    with torch.no_grad():
        prev = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        want = ref.hidden(ids[1:], prev[:-1])
        got = layer.forward(torch.tensor(ids[1:]), prev[:-1], _batch(ids[1:]))
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(layer.compute_logits(got), ref.logits(want), atol=5e-4, rtol=5e-4)
        # a second draft step reads the layer's own output as its feature (vLLM's recursion)
        again = layer.forward(torch.tensor(ids[2:]), got[:-1], _batch(ids[2:]))
        torch.testing.assert_close(again, ref.hidden(ids[2:], want[:-1]), atol=5e-4, rtol=5e-4)
    # the shared embedding and head are the target's tensors, not copies
    target = llm.engine.model
    assert not any(p is target.lm_head.weight for p in layer.parameters())


def _copying(llm: LLM) -> None:
    """Make the target emit its input token (every layer's weights zeroed: hidden = norm(embed(x)); the head
    = the embedding) and the MTP layer pass its feature through (fc = [0 | I], its decoder layer zeroed), so
    a draft is the target's token at the feature's position: right once the output repeats."""
    model = llm.engine.model
    with torch.no_grad():
        for p in model.model.layers.parameters():
            p.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
        spec = llm.engine.spec
        if spec is not None:
            layer = spec.proposer.layer
            for p in layer.layers.parameters():
                p.zero_()
            h = layer.fc.weight.shape[0]
            layer.fc.weight.zero_()
            layer.fc.weight[:, h:] = torch.eye(h)
            layer.pre_fc_norm_hidden.weight.fill_(1.0)
            layer.norm.weight.fill_(1.0)


@pytest.mark.parametrize("k", [1, 2])
def test_drafts_are_accepted_when_the_mtp_layer_agrees(tmp_path, k):
    save_tiny_hybrid_mtp("qwen3_5_text", tmp_path)
    spec = LLM(model=str(tmp_path), speculative_config={"method": "mtp", "num_speculative_tokens": k}, **KW)
    plain = plain_llm(str(tmp_path), **KW)
    _copying(spec)
    _copying(plain)
    prompts = [[11, 12, 13, 14, 15], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    got = outputs(spec, prompts, 10)
    assert got == outputs(plain, prompts, 10)
    assert got == [[15] * 10, [48] * 10]  # the copying target
    stats = spec.engine.spec.stats()
    assert stats["spec_accepted_tokens_total"] > 0
    assert stats["spec_mean_accepted_length"] > 1.5


def test_a_target_without_mtp_weights_is_a_clear_error(tmp_path):
    save_tiny_hybrid("qwen3_5_text", tmp_path)
    with pytest.raises(ValueError, match="no MTP layer"):
        LLM(model=str(tmp_path), speculative_config=MTP1, **KW)


def test_more_than_one_mtp_layer_is_refused(tmp_path):
    save_tiny_hybrid_mtp("qwen3_5_text", tmp_path, mtp_num_hidden_layers=2)
    with pytest.raises(ValueError, match="only checkpoints with one MTP layer"):
        LLM(model=str(tmp_path), speculative_config=MTP1, **KW)
