"""Our LoRA against PEFT, the reference: the same base model, the same initial A (copied from PEFT), the same
packed data and AdamW give the same per-step losses; our saved adapter loads in ``PeftModel.from_pretrained`` and
gives the same logits; the merged model equals the adapter-applied one and saves as a transformers folder.

Tolerance: fp32, relative 1e-5 on losses and absolute 1e-5 on logits. Both compute ``base(x) + B(A(x)) * scale``
in the same order, so they agree to rounding; a wrong scale (alpha/r vs alpha/sqrt(r)), a wrong init or a missed
module shows as 1e-3 or more after the first update.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

from tokenfab.train.data import IGNORE_INDEX, pack
from tokenfab.train.lora import LoRALinear, inject_lora, lora_modules, merge_lora
from tokenfab.train.peft_io import load_adapter, save_adapter, save_merged

peft = pytest.importorskip("peft")  # dev dependency: always installed by `make test`

LOSS_RTOL = 1e-5
LOGIT_ATOL = 1e-5
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tiny_llama(vocab: int = 96, tie: bool = True):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-6, tie_word_embeddings=tie, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def _batches(vocab: int = 96, n: int = 24, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(n):
        length = int(torch.randint(4, 20, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        examples.append((ids, [IGNORE_INDEX] * (length // 3) + ids[length // 3:]))
    return pack(examples, max_tokens=64)


def _loss(model, batch) -> torch.Tensor:
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits[0, :-1]
    return F.cross_entropy(logits, batch.labels[0, 1:], ignore_index=IGNORE_INDEX, reduction="sum") / \
        batch.num_loss_tokens


def _train(model, batches, steps: int) -> list[float]:
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    losses = []
    for step in range(steps):
        loss = _loss(model, batches[step % len(batches)])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _peft_twin(base, r: int, alpha: float, use_rslora: bool):
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=TARGETS, use_rslora=use_rslora,
                          bias="none", task_type="CAUSAL_LM")
    return peft.get_peft_model(copy.deepcopy(base), cfg)


def _copy_peft_init(peft_model, ours) -> int:
    """Copy PEFT's initial A (and B, zeros) into our layers; returns how many layers were matched."""
    theirs = {n.removeprefix("base_model.model."): p for n, p in peft_model.named_parameters() if "lora_" in n}
    n = 0
    with torch.no_grad():
        for name, m in lora_modules(ours):
            m.lora_A.weight.copy_(theirs[f"{name}.lora_A.default.weight"])
            m.lora_B.weight.copy_(theirs[f"{name}.lora_B.default.weight"])
            n += 1
    return n


@torch.no_grad()
def _logits(model, batch) -> torch.Tensor:
    model.eval()
    return model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits


@pytest.mark.parametrize("r, alpha, use_rslora", [(4, 8.0, False), (8, 16.0, True)])
def test_lora_equals_peft(tmp_path, r, alpha, use_rslora):
    base = _tiny_llama()
    batches = _batches()
    theirs = _peft_twin(base, r, alpha, use_rslora)
    ours = inject_lora(copy.deepcopy(base), r=r, alpha=alpha, target_modules=TARGETS, use_rslora=use_rslora)
    assert _copy_peft_init(theirs, ours) == 7 * 2
    trainable = sum(p.numel() for p in ours.parameters() if p.requires_grad)
    assert trainable == sum(p.numel() for p in theirs.parameters() if p.requires_grad)
    expected_scale = alpha / math.sqrt(r) if use_rslora else alpha / r
    assert all(m.scale == expected_scale for _, m in lora_modules(ours))

    ref = _train(theirs, batches, 6)
    got = _train(ours, batches, 6)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=LOSS_RTOL, atol=0)
    assert ref[-1] < ref[0]  # it did train

    # our adapter, saved in PEFT's format, loads in PEFT and gives the same logits
    save_adapter(ours, tmp_path / "adapter", base_model_name="tiny-llama")
    theirs_dir = tmp_path / "peft_adapter"
    theirs.save_pretrained(str(theirs_dir))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as f:
        our_keys = set(f.keys())
    with safe_open(str(theirs_dir / "adapter_model.safetensors"), "pt") as f:
        assert our_keys == set(f.keys())
    assert all(k.startswith("base_model.model.model.layers.") and k.endswith((".lora_A.weight", ".lora_B.weight"))
               for k in our_keys)
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    ref_cfg = json.loads((theirs_dir / "adapter_config.json").read_text())
    for key in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "use_rslora", "bias"):
        assert cfg[key] == ref_cfg[key], key
    assert sorted(cfg["target_modules"]) == sorted(ref_cfg["target_modules"])

    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "adapter"))
    probe = batches[0]
    torch.testing.assert_close(_logits(loaded, probe), _logits(ours, probe), atol=LOGIT_ATOL, rtol=0)
    assert (_logits(ours, probe) - _logits(base, probe)).abs().max() > 1e-2  # the adapter changed something

    # our loader gives the same model again, into a fresh base
    again = load_adapter(copy.deepcopy(base), tmp_path / "adapter")
    torch.testing.assert_close(_logits(again, probe), _logits(ours, probe), atol=0, rtol=0)

    # merged == adapter-applied, and the merged model is the plain architecture again
    adapted = _logits(ours, probe)
    merged = merge_lora(copy.deepcopy(ours))
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    assert set(merged.state_dict()) == set(base.state_dict())
    torch.testing.assert_close(_logits(merged, probe), adapted, atol=LOGIT_ATOL, rtol=0)
    peft_merged = loaded.merge_and_unload()
    torch.testing.assert_close(_logits(merged, probe), _logits(peft_merged, probe), atol=LOGIT_ATOL, rtol=0)


def test_save_merged_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    base = _tiny_llama(tie=True)
    ours = inject_lora(copy.deepcopy(base), r=4, alpha=4.0, init_seed=1)
    with torch.no_grad():
        for _, m in lora_modules(ours):
            m.lora_B.weight.normal_(0, 0.1)
    probe = _batches()[0]
    adapted = _logits(ours, probe)
    save_merged(ours, None, tmp_path / "merged")
    cfg = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(_logits(back, probe), adapted, atol=LOGIT_ATOL, rtol=0)


def test_init_is_peft_like_and_seeded():
    base = _tiny_llama()
    a = inject_lora(copy.deepcopy(base), r=4, init_seed=7)
    b = inject_lora(copy.deepcopy(base), r=4, init_seed=7)
    c = inject_lora(copy.deepcopy(base), r=4, init_seed=8)
    for (_, ma), (_, mb), (_, mc) in zip(lora_modules(a), lora_modules(b), lora_modules(c)):
        assert torch.equal(ma.lora_A.weight, mb.lora_A.weight)
        assert not torch.equal(ma.lora_A.weight, mc.lora_A.weight)
        assert float(ma.lora_B.weight.abs().max()) == 0.0
        bound = 1 / math.sqrt(ma.in_features)  # kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in))
        assert float(ma.lora_A.weight.abs().max()) <= bound and float(ma.lora_A.weight.abs().max()) > 0.5 * bound
    # B = 0: the wrapped model starts exactly at the base model
    probe = _batches()[0]
    torch.testing.assert_close(_logits(a, probe), _logits(base, probe), atol=0, rtol=0)
    # only LoRA parameters train
    assert {n.rsplit(".", 2)[-2] for n, p in a.named_parameters() if p.requires_grad} == {"lora_A", "lora_B"}


def test_targets_dropout_and_errors(tmp_path):
    base = _tiny_llama()
    m = inject_lora(copy.deepcopy(base), r=2, target_modules=["q_proj", "v_proj"], dropout=0.5)
    assert sorted(m.lora_config.target_modules) == ["q_proj", "v_proj"]
    assert len(list(lora_modules(m))) == 4
    everything = inject_lora(copy.deepcopy(base), r=2, target_modules="all-linear")
    assert len(list(lora_modules(everything))) == 14  # the head is never wrapped
    regex = inject_lora(copy.deepcopy(base), r=2, target_modules=r".*layers\.1\.mlp\..*_proj")
    assert len(list(lora_modules(regex))) == 3
    with torch.no_grad():  # dropout acts in train mode only
        for _, layer in lora_modules(m):
            layer.lora_B.weight.normal_()
    probe = _batches()[0]
    evals = _logits(m, probe), _logits(m, probe)
    torch.testing.assert_close(*evals, atol=0, rtol=0)
    m.train()
    torch.manual_seed(0)
    assert not torch.equal(m(input_ids=probe.input_ids, use_cache=False).logits.detach(), evals[0])
    with pytest.raises(ValueError, match="no nn.Linear module matches"):
        inject_lora(copy.deepcopy(base), target_modules=["nope"])
    with pytest.raises(ValueError, match="already has LoRA"):
        inject_lora(m)
    with pytest.raises(ValueError, match="no LoRA layers"):
        save_adapter(copy.deepcopy(base), tmp_path / "x", "b")
    save_adapter(m, tmp_path / "a", "tiny")
    wrong = inject_lora(copy.deepcopy(base), r=3, target_modules=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="has shape"):
        load_adapter(wrong, tmp_path / "a")
    more = inject_lora(copy.deepcopy(base), r=2, target_modules=["q_proj", "v_proj", "o_proj"])
    with pytest.raises(ValueError, match="no tensor for"):
        load_adapter(more, tmp_path / "a")


@pytest.mark.slow
def test_lora_equals_peft_on_the_bundled_model():
    """The bundled SmolLM2 (GGUF dequantized by transformers), 3 AdamW steps on the task dataset's records."""
    from tests.train.task_dataset import train_records
    from tokenfab.train.data import tokenize_record
    from tokenfab.train.model import load_training_model

    base, tok = load_training_model(None, torch.float32, "cpu")
    examples = [tokenize_record(tok, r, 256) for r in train_records()[:24]]
    batches = pack(examples, max_tokens=512, max_samples=8)
    theirs = _peft_twin(base, 8, 8.0, False)
    ours = inject_lora(base, r=8, alpha=8.0, target_modules=TARGETS)  # in place: `theirs` holds a copy
    assert _copy_peft_init(theirs, ours) == 30 * 7
    ref = _train(theirs, batches, 3)
    got = _train(ours, batches, 3)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=LOSS_RTOL, atol=0)
