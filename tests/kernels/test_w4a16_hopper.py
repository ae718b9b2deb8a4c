"""The W4A16 kernels compile for Hopper (sm_90) at the dispatcher's configs, without a GPU
(kernel rule 5): no spills, shared memory fits, and the prefill-sized tiles (>= 64 rows, 16-bit
activations) use Hopper's warp-group MMA (HGMMA). Decode tiles (16 rows) use mma.sync (HMMA).
The table in tokenfab/kernels/README.md comes from ``tests/kernels/w4a16_hopper_compile.py --markdown``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.conftest import HAS_CUDA

HERE = Path(__file__).resolve().parent
GEMMS = ("_w4a16_kernel", "_moe_w4_gate_up_kernel", "_moe_w4_down_kernel")
OURS = (*GEMMS, "_w4a16_reduce_kernel")


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    if HAS_CUDA:
        pytest.skip("a GPU is present: the kernel tests compiled and ran the kernels for real")
    out = tmp_path_factory.mktemp("hopper") / "w4a16.json"
    env = {k: v for k, v in os.environ.items() if k != "TOKENFAB_KERNELS"}
    env["TRITON_INTERPRET"] = "0"
    recs: list[dict] = []
    # every MoE workload and the dense kernel's decode (M=1, M=16) and largest prefill buckets
    for i, only in enumerate(("M=1", "M=4096", "moe_w4a16")):
        path = out.with_name(f"w4a16_{i}.json")
        proc = subprocess.run(
            [sys.executable, str(HERE / "w4a16_hopper_compile.py"), "--json", str(path), "--only", only],
            env=env, capture_output=True, text=True, timeout=600, cwd=HERE.parents[1],
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        recs += json.loads(path.read_text())
    return [r for r in recs if r["kernel"] in OURS]


def test_all_w4a16_kernels_compile(records):
    assert {r["kernel"] for r in records} == set(OURS)
    decode = [r for r in records if r["kernel"] == "_w4a16_kernel" and "M=1 " in r["workload"] + " "]
    assert decode and all(r["config"]["SPLIT_K"] > 1 for r in decode)  # Llama-8B down: split K


def test_no_spills_and_shared_fits(records):
    assert not [(r["workload"], r["kernel"]) for r in records if r["local"] or r["stack"]]
    assert not [r["workload"] for r in records if r["shared"] > 227 * 1024]


def test_prefill_tiles_use_hgmma(records):
    big = [r for r in records if r["kernel"] in GEMMS and r["config"]["BLOCK_M"] >= 64
           and r["config"]["DOT_PREC"] != "ieee"]
    assert big
    for r in big:
        assert r["hgmma"] > 0, (r["workload"], r["kernel"])


def test_decode_tiles_use_tensor_cores(records):
    for r in records:
        if r["kernel"] in GEMMS and r["config"]["DOT_PREC"] != "ieee":
            assert r["hgmma"] + r["hmma"] > 0, (r["workload"], r["kernel"])
