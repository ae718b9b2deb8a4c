"""`tokenfab finetune` end to end on a tiny model folder (random Llama weights, the bundled
tokenizer and its chat template): adapter files in PEFT's layout, loss.png, checkpoints, a merged
folder that tokenfab's engine loads; bad input refused with a clear message and exit 2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.tiny_models import tiny_llama_with_bundled_tokenizer
from tokenfab.cli import main

TRAIN = [{"messages": [{"role": "user", "content": f"Say {w}"}, {"role": "assistant", "content": f"ANSWER: {w}"}]}
         for w in ("apple", "river", "stone", "cloud", "tiger", "garden")]
EVAL = [{"prompt": "Say window", "completion": "ANSWER: window"}]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny random Llama as a Hugging Face folder with the bundled model's tokenizer."""
    model, tokenizer = tiny_llama_with_bundled_tokenizer()
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_finetune_lora_merge_end_to_end(tmp_path, tiny_folder):
    from safetensors.torch import load_file

    from tokenfab import LLM, SamplingParams

    out = tmp_path / "out"
    rc = main(["finetune", str(tiny_folder), "--data", str(_write(tmp_path / "t.jsonl", TRAIN)),
               "--eval", str(_write(tmp_path / "e.jsonl", EVAL)), "--output-dir", str(out), "--max-steps", "3",
               "--batch-size", "2", "--lr", "1e-2", "--save-every", "2", "--merge", "--no-progress"])
    assert rc == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 8
    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert any(float(t.abs().max()) > 0 for k, t in tensors.items() if "lora_B" in k)  # it trained
    assert (out / "loss.png").stat().st_size > 1000
    assert (out / "checkpoint-2" / "trainable.safetensors").exists()
    result = json.loads((out / "train_result.json").read_text())
    assert len(result["losses"]) == 3 and result["eval_losses"][-1][0] == 3
    assert "fused_linear_cross_entropy" in result["patched_ops"]
    merged = out / "merged"
    assert (merged / "config.json").exists() and (merged / "model.safetensors").exists()
    llm = LLM(str(merged), num_kv_blocks=64, max_model_len=64, block_size=8)
    text = llm.generate(["Say window"], SamplingParams(max_tokens=4, temperature=0.0))[0].outputs[0]
    assert len(text.token_ids) == 4


def test_finetune_full_writes_safetensors_and_resumes(tmp_path, tiny_folder):
    data = str(_write(tmp_path / "t.jsonl", TRAIN))
    common = ["finetune", str(tiny_folder), "--data", data, "--full", "--batch-size", "2", "--lr", "1e-3",
              "--max-steps", "4", "--no-progress", "--no-kernels"]
    assert main([*common, "--output-dir", str(tmp_path / "a"), "--save-every", "2"]) == 0
    assert (tmp_path / "a" / "model.safetensors").exists() and (tmp_path / "a" / "tokenizer.json").exists()
    assert main([*common, "--output-dir", str(tmp_path / "b"),
                 "--resume-from", str(tmp_path / "a" / "checkpoint-2")]) == 0
    straight = json.loads((tmp_path / "a" / "train_result.json").read_text())["losses"]
    resumed = json.loads((tmp_path / "b" / "train_result.json").read_text())["losses"]
    assert resumed == straight


def test_fp8_refused_on_cpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    rc = main(["finetune", "--data", str(_write(tmp_path / "t.jsonl", TRAIN)), "--output-dir", str(tmp_path / "o"),
               "--fp8"])
    assert rc == 2
    assert "--fp8 needs a CUDA GPU" in capsys.readouterr().err


def test_bad_data_file_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(TRAIN[0]) + "\n{not json\n")
    assert main(["finetune", "--data", str(bad), "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl" in err and "2" in err
    assert main(["finetune", "--data", str(tmp_path / "missing.jsonl"), "--output-dir", str(tmp_path / "o")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_merge_with_full_is_refused(tmp_path, capsys):
    rc = main(["finetune", "--data", str(_write(tmp_path / "t.jsonl", TRAIN)), "--output-dir", str(tmp_path / "o"),
               "--full", "--merge"])
    assert rc == 2 and "--merge" in capsys.readouterr().err


@pytest.mark.slow
def test_torchrun_two_processes_write_the_one_process_adapter(tmp_path, tiny_folder):
    """`torchrun --nproc-per-node 2 -m tokenfab finetune` (FSDP2 over gloo): the outputs are gathered
    onto rank 0 and equal a one-process run's."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    data = str(_write(tmp_path / "t.jsonl", TRAIN))
    args = ["finetune", str(tiny_folder), "--data", data, "--max-steps", "2", "--batch-size", "4", "--lr", "1e-2",
            "--no-progress"]
    assert main([*args, "--output-dir", str(tmp_path / "one")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "tokenfab",
                           *args, "--output-dir", str(tmp_path / "two"), "--merge"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = load_file(str(tmp_path / "one" / "adapter_model.safetensors"))
    two = load_file(str(tmp_path / "two" / "adapter_model.safetensors"))
    assert one.keys() == two.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-6, msg=key)
    assert (tmp_path / "two" / "merged" / "model.safetensors").exists()


def test_lora_targets_matching_nothing_are_refused(tmp_path, tiny_folder, capsys):
    rc = main(["finetune", str(tiny_folder), "--data", str(_write(tmp_path / "t.jsonl", TRAIN)),
               "--output-dir", str(tmp_path / "o"), "--lora-target-modules", "no_such_proj", "--no-progress"])
    assert rc == 2 and "no_such_proj" in capsys.readouterr().err
