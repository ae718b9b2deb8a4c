"""FSDP2 over gloo: 2 CPU processes train the same as 1 (same global batch), and a sharded
checkpoint (torch.distributed.checkpoint) resumes exactly in 2 processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.train.tiny_train import tiny_model, toy_examples
from tokenfab.train.trainer import TrainConfig, Trainer

# Over 2 processes the gradient is reduce-scattered (summed in another order) and the loss of a
# step is summed over ranks: fp32 rounding only.
LOSS_RTOL = 1e-5


def _config(out: Path, mode: str, **kw) -> TrainConfig:
    return TrainConfig(full=mode == "full", lr=3e-3, epochs=2, batch_size=4, grad_accum=2,
                       output_dir=str(out), progress=False, plot=False, warmup_steps=1, eval_every=2,
                       seed=7, **kw)


def _data():
    # 13 samples: the last step has 5 (uneven over 2 ranks, one micro-batch with a single sample).
    return toy_examples(13, seed=11), toy_examples(5, seed=12)


def _worker(rank: int, world: int, store: str, out: str, mode: str, resume: bool) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        data, evals = _data()
        out_dir = Path(out)
        kw = {"save_every": 2}
        if resume:
            kw = {"resume_from": str(out_dir / "checkpoint-2")}
            out_dir = out_dir / "resumed"
        trainer = Trainer(tiny_model(), None, data, evals, _config(out_dir, mode, **kw))
        assert trainer.sharded and type(trainer.model).__name__.startswith("FSDP")
        result = trainer.train()
        if rank == 0:
            (out_dir / "losses.json").write_text(json.dumps({"losses": result.losses,
                                                             "eval": result.eval_losses}))
    finally:
        from tokenfab.train.distributed import shutdown

        shutdown()


def _spawn(tmp_path: Path, name: str, mode: str, resume: bool = False) -> dict:
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    store = tmp_path / f"store-{name}-{int(resume)}"
    mp.start_processes(_worker, args=(2, str(store), str(out), mode, resume), nprocs=2, join=True,
                       start_method="spawn")
    return json.loads(((out / "resumed") if resume else out).joinpath("losses.json").read_text())


def _two_vs_one(tmp_path: Path, mode: str) -> dict:
    data, evals = _data()
    single = Trainer(tiny_model(), None, data, evals, _config(tmp_path / "one", mode)).train()
    two = _spawn(tmp_path, "two", mode)
    assert len(two["losses"]) == len(single.losses) == 4
    assert two["losses"] == pytest.approx(single.losses, rel=LOSS_RTOL)
    assert [s for s, _ in two["eval"]] == [s for s, _ in single.eval_losses]
    assert [v for _, v in two["eval"]] == pytest.approx([v for _, v in single.eval_losses], rel=LOSS_RTOL)
    ck = tmp_path / "two" / "checkpoint-2"  # sharded checkpoint: one DCP folder, every rank's RNG state
    assert (ck / "dcp" / ".metadata").exists()
    assert (ck / "rng-rank0.json").exists() and (ck / "rng-rank1.safetensors").exists()
    return two


def test_two_gloo_processes_match_one_full(tmp_path):
    _two_vs_one(tmp_path, "full")


# LoRA under FSDP2 (frozen and trainable parameters in one shard group): 2 processes vs 1 is covered
# end to end by tests/train/test_finetune_cli.py::test_torchrun_two_processes_write_the_one_process_adapter.


@pytest.mark.slow
def test_sharded_checkpoint_resumes_exactly(tmp_path):
    two = _two_vs_one(tmp_path, "full")
    resumed = _spawn(tmp_path, "two", "full", resume=True)
    assert resumed["losses"] == two["losses"]
