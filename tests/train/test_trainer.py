"""The model side of packing, the training loop's arithmetic, checkpoints and exact resume
(tiny random models: fast, fp32)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.train.tiny_train import tiny_model, toy_examples
from tokenfab.train.data import pack
from tokenfab.train.model import apply_kernels, packed_loss, shift_labels_within_samples
from tokenfab.train.trainer import TrainConfig, Trainer, warmup_cosine


def _alone_sum(model, examples, kernels: bool) -> float:
    total = 0.0
    for ids, labels in examples:  # one sample at a time, no packing: HF's plain causal path
        batch = pack([(ids, labels)], len(ids))[0]
        total += float(packed_loss(model, batch, kernels)[0])
    return total


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("kernels", [False, True])
@torch.no_grad()
def test_packed_loss_equals_samples_run_alone(model_type, kernels):
    model = tiny_model(model_type)
    if kernels:
        apply_kernels(model)
    examples = toy_examples(7, seed=3)
    batches = pack(examples, 40)
    assert any(b.cu_seqlens.numel() > 2 for b in batches)  # several samples share a row
    packed = sum(float(packed_loss(model, b, kernels)[0]) for b in batches)
    n_tokens = sum(packed_loss(model, b, kernels)[1] for b in batches)
    assert n_tokens == sum(b.num_loss_tokens for b in batches)
    assert packed == pytest.approx(_alone_sum(model, examples, kernels), rel=1e-5)


@torch.no_grad()
def test_packed_attention_is_block_diagonal():
    """Changing the first sample of a row leaves the second sample's token losses unchanged; with a
    plain causal mask (no sample boundaries) it would not. HF builds the block-diagonal mask from the
    restarting position_ids only without a KV cache: ``use_cache=False`` (as packed_loss passes) is
    needed, since an eval-mode model otherwise makes a DynamicCache and silently skips it."""
    model = tiny_model()
    a, b = toy_examples(2, seed=5, min_len=8, max_len=8)
    a2 = ([(t + 1) % 96 for t in a[0]], a[1])
    losses = []
    for first in (a, a2):
        batch = pack([first, b], 64)[0]
        shifted = shift_labels_within_samples(batch.labels, batch.cu_seqlens)
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits[0]
        per_token = torch.nn.functional.cross_entropy(logits, shifted[0], reduction="none")
        losses.append(per_token[8:])
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    plain = model(input_ids=pack([a2, b], 64)[0].input_ids).logits[0, 8:]  # no position_ids: one causal row
    assert not torch.allclose(plain, model(input_ids=pack([a, b], 64)[0].input_ids).logits[0, 8:])


def test_shift_never_crosses_a_sample_boundary():
    labels = torch.tensor([[-100, 5, 6, -100, 8, 9]])
    shifted = shift_labels_within_samples(labels, torch.tensor([0, 3, 6], dtype=torch.int32))
    assert shifted.tolist() == [[5, 6, -100, 8, 9, -100]]


def test_warmup_cosine_schedule():
    f = warmup_cosine(4, 20)
    assert [f(i) for i in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert f(4) == pytest.approx(1.0)
    assert f(12) == pytest.approx(0.5 * (1 + math.cos(math.pi * 8 / 16)))
    assert f(20) == pytest.approx(0.0)


def _config(tmp_path, **kw) -> TrainConfig:
    base = dict(full=True, lr=2e-3, epochs=2, batch_size=4, output_dir=str(tmp_path), progress=False,
                plot=False, warmup_steps=1)
    base.update(kw)
    return TrainConfig(**base)


def test_grad_accumulation_matches_one_big_batch(tmp_path):
    data = toy_examples(16, seed=1)
    big = Trainer(tiny_model(), None, data, None, _config(tmp_path / "a", batch_size=8, grad_accum=1)).train()
    acc = Trainer(tiny_model(), None, data, None, _config(tmp_path / "b", batch_size=2, grad_accum=4)).train()
    assert len(big.losses) == len(acc.losses) == 4
    assert acc.losses == pytest.approx(big.losses, rel=1e-5)


def test_loss_decreases_and_eval_runs(tmp_path):
    data = toy_examples(6, seed=2) * 2  # memorisable
    result = Trainer(tiny_model(), None, data, data[:4], _config(tmp_path, epochs=4, eval_every=3,
                                                                  lr=2e-2, plot=True)).train()
    assert result.losses[-1] < 0.7 * result.losses[0]
    assert [s for s, _ in result.eval_losses] == [3, 6, 9, 12]
    assert result.eval_losses[-1][1] < result.eval_losses[0][1]
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert json.loads((tmp_path / "train_result.json").read_text())["steps"] == 12


def _lora_available() -> bool:
    try:
        from tokenfab.train.lora import inject_lora  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_resume_continues_exactly(tmp_path, mode):
    if mode == "lora" and not _lora_available():
        pytest.fail("tokenfab.train.lora has not landed")
    kw = dict(full=mode == "full", lora_dropout=0.2 if mode == "lora" else 0.0, lr=5e-3 if mode == "lora" else 2e-3,
              kernels=True, epochs=3, save_every=4, eval_every=5)
    data, evals = toy_examples(10, seed=4), toy_examples(3, seed=9)
    straight = Trainer(tiny_model(), None, data, evals, _config(tmp_path / "a", **kw)).train()
    assert len(straight.losses) == 9
    # A fresh process would rebuild the model the same way; the checkpoint restores the rest.
    resumed_trainer = Trainer(tiny_model(seed=1), None, data, evals,
                              _config(tmp_path / "b", resume_from=str(tmp_path / "a" / "checkpoint-4"), **kw))
    assert resumed_trainer.start_step == 4
    resumed = resumed_trainer.train()
    if mode == "full":  # the checkpoint holds every weight: a differently initialised model resumes the same
        assert resumed.losses == straight.losses
    else:  # LoRA saves the adapter only; the frozen base must be the same (seed 1 differs): rerun on seed 0
        resumed = Trainer(tiny_model(), None, data, evals,
                          _config(tmp_path / "c", resume_from=str(tmp_path / "a" / "checkpoint-4"), **kw)).train()
        assert resumed.losses == straight.losses
    assert resumed.eval_losses == straight.eval_losses


def test_resume_refuses_a_folder_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        Trainer(tiny_model(), None, toy_examples(4), None, _config(tmp_path, resume_from=str(tmp_path)))


def test_fp8_refused_on_cpu(tmp_path):
    with pytest.raises(ValueError, match="CUDA"):
        Trainer(tiny_model(), None, toy_examples(4), None, _config(tmp_path, fp8=True))


def test_lora_trains_only_the_adapter(tmp_path):
    if not _lora_available():
        pytest.fail("tokenfab.train.lora has not landed")
    model = tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model, None, toy_examples(8), None, _config(tmp_path, full=False, lr=1e-2, epochs=1))
    trainer.train()
    after = dict(model.named_parameters())
    trainable = {n for n, p in after.items() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    for name, value in before.items():
        key = name if name in after else name.replace(".weight", ".base.weight")
        if key in after:
            torch.testing.assert_close(after[key].detach(), value, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_gradient_checkpointing_changes_nothing(tmp_path, mode):
    if mode == "lora" and not _lora_available():
        pytest.fail("tokenfab.train.lora has not landed")
    data = toy_examples(8, seed=6)
    runs = []
    for ckpt in (False, True):
        model = tiny_model()
        trainer = Trainer(model, None, data, None, _config(tmp_path / f"g{int(ckpt)}", full=mode == "full",
                                                           gradient_checkpointing=ckpt, epochs=1))
        assert model.model.gradient_checkpointing == ckpt and model.model.layers[0].gradient_checkpointing == ckpt
        runs.append(trainer.train().losses)
    assert runs[1] == pytest.approx(runs[0], rel=1e-6)


def test_checkpoint_state_round_trips_without_pickle(tmp_path):
    from tokenfab.train.checkpoint import load_state, save_state

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3, 2))], lr=1e-3, betas=(0.9, 0.95))
    opt.param_groups[0]["params"][0].grad = torch.ones(3, 2)
    opt.step()
    save_state(tmp_path / "optimizer", opt.state_dict())
    assert not list(tmp_path.glob("*.pt"))
    back = load_state(tmp_path / "optimizer")
    ref = opt.state_dict()
    assert list(back["state"]) == [0]  # int keys survive JSON
    for k, v in ref["state"][0].items():
        assert torch.equal(back["state"][0][k], v)
    assert back["param_groups"][0]["betas"] == [0.9, 0.95]
    torch.optim.AdamW([torch.nn.Parameter(torch.randn(3, 2))]).load_state_dict(back)
    (tmp_path / "optimizer.json").write_text('{"dict": [[0, {"tensor": "missing"}]]}')
    with pytest.raises(ValueError, match="optimizer.json is malformed"):
        load_state(tmp_path / "optimizer")
