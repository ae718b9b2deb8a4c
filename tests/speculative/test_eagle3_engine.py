"""EAGLE-3 speculation (tokenfab/speculative/feature_draft.py) in the engine, on tiny random Llama and Qwen3
targets with random heads written in the published layout (tests/speculative/test_eagle3.py's writer).

Greedy outputs equal plain decoding alone, batched, with prefix caching, chunked prefill and
preemption (tests/speculative/spec_cases.py). The drafts themselves are checked against an independent
restatement: the target's hidden states from transformers (``output_hidden_states``) feed the
plain-torch head of test_eagle3.py, shifted by one token as EAGLE reads them; its argmax (mapped
through d2t) must be the engine's first draft, and, fed its own pre-norm output, its second.
"""

from __future__ import annotations

import pytest
import torch

from tests.speculative.spec_cases import check_greedy_identity, outputs, plain_llm, random_prompts, record_drafts
from tests.speculative.test_eagle3 import reference_head, write_tiny_eagle3
from tests.tiny_models import save_tiny_model, tiny_config
from tokenfab import LLM, SamplingParams
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.speculative.eagle3 import aux_layer_ids

LAYERS = 4  # aux layers (2, L//2, L-3) = (2, 2, 1)


def make(tmp_path_factory, model_type: str):
    path = tmp_path_factory.mktemp(f"eagle3-{model_type}")
    hf = save_tiny_model(tiny_config(model_type, num_hidden_layers=LAYERS), path / "target")
    w = write_tiny_eagle3(path / "head", seed=4, vocab_size=320, target_hidden_size=64, draft_vocab_size=200)
    cfg = {"method": "eagle3", "model": str(path / "head"), "num_speculative_tokens": 3}
    return hf, w, str(path / "target"), cfg


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def case(request, tmp_path_factory):
    return make(tmp_path_factory, request.param)


def reference_drafts(hf, w, tokens: list[int], n: int) -> list[int] | None:
    """The first n drafts after ``tokens`` by the restated head (None near a tie)."""
    with torch.no_grad():
        hs = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i][0] for i in aux_layer_ids(LAYERS)], -1)[:-1]
    g = feats.double() @ w["fc.weight"].double().T
    ids, out = list(tokens[1:]), []
    kept = torch.arange(200) + w["d2t"]
    for _ in range(n):
        normed, pre = reference_head(w, ids, g, w["embed_tokens.weight"])
        logits = normed[-1] @ w["lm_head.weight"].double().T
        top = logits.topk(2).values
        if top[0] - top[1] < 1e-4:
            return None
        d = int(kept[logits.argmax()])
        out.append(d)
        ids.append(d)
        g = torch.cat([g, pre[-1:]])
    return out


def test_drafts_follow_the_restated_head_and_outputs_are_unchanged(tmp_path_factory):
    """The single fast-tier case: Llama target, batched mixed lengths."""
    hf, w, target, cfg = make(tmp_path_factory, "llama")
    kw = dict(block_size=4, num_kv_blocks=128)
    spec = LLM(model=target, speculative_config=cfg, **kw)
    seen = record_drafts(spec)
    prompts = random_prompts(320, (3, 11, 30))
    assert outputs(spec, prompts, 12) == outputs(plain_llm(target, **kw), prompts, 12)
    assert len(seen) > 4
    checked = 0
    for tokens, drafts in seen[:: max(len(seen) // 4, 1)]:
        ref = reference_drafts(hf, w, tokens, min(2, len(drafts)))
        if ref is not None:
            assert drafts[: len(ref)] == ref, tokens
            checked += 1
    assert checked >= 3


@pytest.mark.slow
def test_greedy_identity_everywhere(case):
    _, _, target, cfg = case
    plain = plain_llm(target, block_size=4, num_kv_blocks=128)
    spec = LLM(model=target, block_size=4, num_kv_blocks=128, speculative_config=cfg)
    tight = LLM(model=target, block_size=4, num_kv_blocks=20, max_num_batched_tokens=16, speculative_config=cfg)
    check_greedy_identity(plain, spec, tight, random_prompts(320), 24)


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(case):
    """Drafts sampled from the head's q (draft vocabulary, mapped into the target's): same seed,
    same tokens, alone (run twice) and batched (run twice; copies in one batch agree). See
    test_draft_model.py's seeded test for why alone and batched runs may differ from each other."""
    _, _, target, cfg = case
    spec = LLM(model=target, block_size=4, num_kv_blocks=128, speculative_config=cfg)
    prompts = random_prompts(320, (6, 25))
    params = SamplingParams(temperature=0.9, seed=77, max_tokens=16, ignore_eos=True)
    alone = [spec.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert alone == [spec.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    batch = prompts + prompts[:1]
    first = [o.outputs[0].token_ids for o in spec.generate(batch, params)]
    assert first == [o.outputs[0].token_ids for o in spec.generate(batch, params)] and first[0] == first[-1]
    assert spec.engine.spec.num_verified > 0


def test_head_for_another_target_is_refused(tmp_path):
    save_tiny_model(tiny_config("llama", num_hidden_layers=LAYERS), tmp_path / "target")
    write_tiny_eagle3(tmp_path / "head", vocab_size=320, target_hidden_size=48)
    cfg = {"method": "eagle3", "model": str(tmp_path / "head")}
    with pytest.raises(ValueError, match="target hidden size 48"):
        LLMEngine(model=str(tmp_path / "target"), num_kv_blocks=32, speculative_config=cfg)
    cfg["model"] = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="not a usable EAGLE-3 head"):
        LLMEngine(model=str(tmp_path / "target"), num_kv_blocks=32, speculative_config=cfg)
