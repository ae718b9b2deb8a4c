"""Fine-tuning works: LoRA on the bundled model with the shipped task dataset (``task_dataset.py``) lowers the
eval loss and turns the greedy answers into the taught ``ANSWER: <WORD>`` format on held-out words and unseen
phrasings; the merged folder is then loaded by ``tokenfab.LLM`` and answers in that format too (slow tier).

The fast test checks the path from a LoRA model to our engine on a tiny model: ``save_merged`` writes a folder
that ``tokenfab.LLM`` serves with the same greedy tokens as transformers running the adapter-applied model.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.train.task_dataset import eval_prompts, eval_records, follows_format, train_records
from tokenfab.train.lora import inject_lora, lora_modules
from tokenfab.train.peft_io import save_adapter, save_merged

MAX_NEW = 10


def _hf_greedy(model, tok, chats: list[list[dict]]) -> list[list[int]]:
    model.eval()
    outs = []
    for msgs in chats:
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            o = model.generate(ids["input_ids"], attention_mask=ids["attention_mask"], max_new_tokens=MAX_NEW,
                               do_sample=False, pad_token_id=tok.eos_token_id)
        new = o[0, ids["input_ids"].shape[1]:].tolist()
        outs.append(new[: new.index(tok.eos_token_id) + 1] if tok.eos_token_id in new else new)
    return outs


def _engine_greedy(folder, chats: list[list[dict]]) -> list[list[int]]:
    from tokenfab import LLM, SamplingParams

    llm = LLM(model=str(folder), num_kv_blocks=64, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    return [llm.chat(msgs, params)[0].outputs[0].token_ids for msgs in chats]


def _strip_eos(ids: list[int], eos: int) -> list[int]:
    return ids[:-1] if ids and ids[-1] == eos else ids


def test_merged_tiny_model_is_served_like_the_adapter(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tokenfab.loader.bundled import bundled_model_path
    from tokenfab.loader.gguf import load_gguf_tokenizer

    tok = load_gguf_tokenizer(bundled_model_path())
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in base.parameters():
            p.normal_(0, 0.2)
    model = inject_lora(copy.deepcopy(base), r=4, alpha=8.0)
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_B.weight.normal_(0, 0.2)
    chats = [msgs for msgs, _ in eval_prompts()[:4]]
    expected = _hf_greedy(model, tok, chats)
    assert expected != _hf_greedy(base, tok, chats)  # the adapter matters
    save_merged(model, tok, tmp_path / "merged")
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    got = _engine_greedy(tmp_path / "merged", chats)
    assert [_strip_eos(g, tok.eos_token_id) for g in got] == [_strip_eos(e, tok.eos_token_id) for e in expected]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # ~1 min on a quiet 2-core CPU; 50 min at load 12
def test_lora_finetune_teaches_the_format(tmp_path):
    """12 optimizer steps of batch 8 (lr 2e-3, r 8, alpha 16) on the bundled model."""
    from tokenfab.train.model import load_training_model
    from tokenfab.train.trainer import TrainConfig, Trainer

    model, tok = load_training_model(None, torch.float32, "cpu")
    prompts = eval_prompts()[::5]  # 8 held-out words, both unseen phrasings
    chats = [msgs for msgs, _ in prompts]
    before = [tok.decode(ids, skip_special_tokens=True) for ids in _hf_greedy(model, tok, chats)]
    assert sum(map(follows_format, before)) <= 1, before

    cfg = TrainConfig(lr=2e-3, max_steps=12, batch_size=8, lora_r=8, lora_alpha=16.0, warmup_steps=0,
                      max_seq_len=256, output_dir=str(tmp_path / "run"), progress=False, plot=False, seed=0)
    trainer = Trainer(model, tok, train_records(), eval_records()[::2], cfg)
    eval_before = trainer.evaluate()
    result = trainer.train()
    eval_after = trainer.evaluate()
    print(f"eval loss {eval_before:.4f} -> {eval_after:.4f}; train losses {[round(x, 3) for x in result.losses]}")
    assert eval_after < 0.25 * eval_before

    after_ids = _hf_greedy(trainer.model, tok, chats)
    after = [tok.decode(ids, skip_special_tokens=True) for ids in after_ids]
    print("before:", before, "\nafter:", after)
    assert sum(map(follows_format, after)) >= 7, after

    out = tmp_path / "out"
    save_adapter(trainer.model, out, "SmolLM2-135M-Instruct")
    save_merged(trainer.model, tok, out / "merged")
    served_ids = _engine_greedy(out / "merged", chats)
    served = [tok.decode(ids, skip_special_tokens=True) for ids in served_ids]
    print("served:", served)
    assert sum(map(follows_format, served)) >= 7, served
    correct = sum(s.strip() == f"ANSWER: {w}" for s, (_, w) in zip(served, prompts))
    print(f"served answers in the format: {sum(map(follows_format, served))}/8, exactly right: {correct}/8")
