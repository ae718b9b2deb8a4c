"""MTP speculation (tokenfab/speculative/feature_draft.py + speculative/mtp.py) in the engine, on a tiny random
DeepSeek-V3 and a tiny GLM-MoE-DSA (sparse attention whose top-k is shorter than the longer
contexts in the batch), each with an MTP layer at index num_hidden_layers written in DeepSeek's
published layout (transformers' own decoder layer + enorm/hnorm/eh_proj/shared_head).

Greedy outputs equal plain decoding alone, batched, with prefix caching, chunked prefill and
preemption (tests/speculative/spec_cases.py), with k = 3 > num_nextn_predict_layers = 1 (the MTP layer is
reused recursively). The first draft is checked against the plain re-statement of test_mtp.py
(transformers' layer fed transformers' final hidden states); a target without an MTP layer is a
clear error.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.models.test_deepseek import DEEPSEEK_COMMON, save_tiny_deepseek
from tests.models.test_deepseek_dsa import save_tiny_dsa
from tests.speculative.spec_cases import check_greedy_identity, outputs, plain_llm, random_prompts, record_drafts
from tests.speculative.test_mtp import _reference, write_mtp_layer
from tokenfab import LLM
from tokenfab.engine.llm_engine import LLMEngine

CFG = {"method": "mtp", "num_speculative_tokens": 3}


def deepseek_case(path):
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    hf = save_tiny_deepseek(path, num_hidden_layers=2, num_nextn_predict_layers=1)
    config = transformers.DeepseekV3Config(**{**DEEPSEEK_COMMON, "num_hidden_layers": 2})
    layer, extras = write_mtp_layer(path, DeepseekV3DecoderLayer, config, 2)
    return hf, layer, extras


def glm_dsa_case(path):
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer

    hf = save_tiny_dsa("glm_moe_dsa", path, num_nextn_predict_layers=1)
    config = copy.deepcopy(hf.config)
    n = config.num_hidden_layers
    for name in ("indexer_types", "mlp_layer_types"):  # one more layer: the MTP layer (a full indexer, MoE)
        types = getattr(config, name, None)
        if types:
            setattr(config, name, list(types) + ["full" if name == "indexer_types" else "sparse"])
    layer, extras = write_mtp_layer(path, GlmMoeDsaDecoderLayer, config, n)
    return hf, layer, extras


CASES = {"deepseek_v3": deepseek_case, "glm_moe_dsa": glm_dsa_case}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"mtp-{request.param}")
    hf, layer, extras = CASES[request.param](path)
    return request.param, str(path), hf, layer, extras


def test_first_draft_follows_the_restatement_and_outputs_are_unchanged(tmp_path):
    """The single fast-tier case: DeepSeek-V3, batched mixed lengths."""
    hf, layer, extras = deepseek_case(tmp_path)
    kw = dict(block_size=4, num_kv_blocks=128)
    spec = LLM(model=str(tmp_path), speculative_config=CFG, **kw)
    seen = record_drafts(spec)
    prompts = random_prompts(320, (3, 21))
    assert outputs(spec, prompts, 10) == outputs(plain_llm(str(tmp_path), **kw), prompts, 10)
    checked = 0
    for tokens, drafts in seen[:: max(len(seen) // 4, 1)]:
        with torch.no_grad():
            prev = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
            logits = _reference(hf, layer, extras, tokens[1:], prev[:-1])[-1]
        top = logits.topk(2).values
        if top[0] - top[1] > 1e-3:
            assert drafts[0] == int(logits.argmax()), tokens
            checked += 1
    assert checked >= 2


@pytest.mark.slow
def test_greedy_identity_everywhere(case):
    name, path, *_ = case
    kw = dict(block_size=4)
    plain = plain_llm(path, num_kv_blocks=128, **kw)
    spec = LLM(model=path, num_kv_blocks=128, speculative_config=CFG, **kw)
    tight = LLM(model=path, num_kv_blocks=20, max_num_batched_tokens=16, speculative_config=CFG, **kw)
    check_greedy_identity(plain, spec, tight, random_prompts(320), 24)


def test_target_without_mtp_layer_is_refused(tmp_path):
    save_tiny_deepseek(tmp_path, num_hidden_layers=2)
    with pytest.raises(ValueError, match="has no MTP layer"):
        LLMEngine(model=str(tmp_path), num_kv_blocks=32, speculative_config=CFG)
