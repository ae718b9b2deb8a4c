"""The W4A16 kernels compile for Hopper (sm_90) at the dispatcher's configs, without a GPU
(kernel rule 5): no spills, shared memory fits, and the prefill-sized tiles (>= 64 rows, 16-bit
activations) use Hopper's warp-group MMA (HGMMA). Decode tiles (16 rows) use mma.sync (HMMA).
The fast tier compiles the script's --quick subset (every codec at decode and at the largest tile, the
MoE at both ends); the slow twin (``[full]``) every workload, with the same checks.
The table in tokenfab/kernels/README.md comes from ``tests/kernels/w4a16_hopper_compile.py --markdown``."""

from __future__ import annotations

import pytest

GEMMS = ("_w4a16_kernel", "_moe_w4_gate_up_kernel", "_moe_w4_down_kernel")
OURS = (*GEMMS, "_w4a16_reduce_kernel")


@pytest.fixture(scope="module", params=[
    pytest.param([("w4a16_hopper_compile.py", ("--quick",))], id="quick"),
    pytest.param([("w4a16_hopper_compile.py", ())], id="full", marks=pytest.mark.slow)])
def hopper_runs(request) -> list:
    return request.param


@pytest.fixture(scope="module")
def records(hopper_batch, hopper_runs) -> list[dict]:
    return [r for r in hopper_batch(hopper_runs) if r["kernel"] in OURS]


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
