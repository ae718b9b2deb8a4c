"""Memory report of a quantized model: the FP8 layers' bytes as stored (float8 values + scale grids),
the engine's bytes/parameter figure (start-up log, /metrics gauge) counting them, halved against bf16."""

from __future__ import annotations

import logging

import pytest

from tests.quant.layouts_fp8 import write_fp8_block_checkpoint
from tests.tiny_models import save_tiny_model, tiny_config
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.quant.memory import weight_bytes_report


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mem")
    # MLP 256 wide: gate_up / down on whole 128x128 blocks; qkv shards off the grid (per-row scales)
    save_tiny_model(tiny_config("qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=128, intermediate_size=256,
                                head_dim=32), root / "src")
    write_fp8_block_checkpoint(root / "src", root / "fp8", root / "twin")
    return root


def test_fp8_bytes_per_parameter(folders, caplog):
    with caplog.at_level(logging.INFO, logger="tokenfab"):
        fp8 = LLMEngine(model=str(folders / "fp8"), dtype="bfloat16", num_kv_blocks=16, block_size=4,
                         cpu_weight_packing=False)
    twin = LLMEngine(model=str(folders / "twin"), dtype="bfloat16", num_kv_blocks=16, block_size=4,
                         cpu_weight_packing=False)
    report = weight_bytes_report(fp8.runner.model)
    q = report["quantized"]
    # 2 layers x (qkv 128+64+64, o 128, gate_up 512, down 128 rows) x K
    linear_params = 2 * ((128 + 64 + 64) * 128 + 128 * 128 + 512 * 128 + 128 * 256)
    assert q["num_params"] == linear_params
    scale_bytes = q["weight_bytes"] - linear_params  # one byte a weight; the rest are float32 scales
    # per-row grid for qkv (256 rows x 1 K block), 128x128 blocks elsewhere: o 1, gate_up 4, down 2
    assert scale_bytes == 2 * 4 * (256 * 1 + 1 + 4 + 2)
    assert 1.0 < q["bytes_per_param"] < 1.01  # half of bf16's 2
    # the engine's figure (start-up log, /metrics) counts them: the twin holds 2 bytes a weight
    assert fp8.memory["num_params"] == twin.memory["num_params"]
    assert twin.memory["weight_bytes"] - fp8.memory["weight_bytes"] == linear_params - scale_bytes
    assert any("quantized layers: block FP8" in r.getMessage() and "bytes/parameter" in r.getMessage()
               for r in caplog.records)


def test_metrics_gauge(folders):
    from tokenfab.server.metrics import ServerMetrics

    engine = LLMEngine(model=str(folders / "fp8"), dtype="bfloat16", num_kv_blocks=16, block_size=4,
                         cpu_weight_packing=False)
    text = ServerMetrics("m", stats=engine.get_stats).render().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("tokenfab:weight_bytes_per_param")
                or "weight_bytes_per_param{" in ln)
    assert float(line.rsplit(" ", 1)[1]) == pytest.approx(engine.memory["weight_bytes_per_param"])
    assert engine.memory["weight_bytes_per_param"] < 2.0
    q = next(ln for ln in text.splitlines() if "quantized_weight_bytes_per_param{" in ln)
    assert 1.0 < float(q.rsplit(" ", 1)[1]) < 1.01  # FP8: one byte a weight, plus the scale grids

