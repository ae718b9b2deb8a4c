"""The FP8 kernels compile for Hopper (sm_90) at the dispatcher's configs, without a GPU (kernel rule 5):
no spills, within the register and shared-memory budgets, and the W8A8 GEMM's 64+-row tiles multiply
on FP8 tensor cores (QGMMA: warp-group MMA with e4m3 operands in the SASS). Decode-sized tiles (16
rows) use mma.sync (HMMA); they are bound by reading the float8 weights, not by the MMA. The same
for the FP8 fused MoE's two grouped GEMMs at DeepSeek-V3's layer shape. The fast tier compiles the
script's --quick subset (decode and the largest tile of each); the slow twin (``[full]``) every workload."""

from __future__ import annotations

import pytest

from tests.kernels.hopper_harness import assert_fits_hopper


@pytest.fixture(scope="module", params=[
    pytest.param([("quant_hopper_compile.py", ("--quick",))], id="quick"),
    pytest.param([("quant_hopper_compile.py", ())], id="full", marks=pytest.mark.slow)])
def hopper_runs(request) -> list:
    return request.param


@pytest.fixture(scope="module")
def records(hopper_batch, hopper_runs) -> list[dict]:
    return hopper_batch(hopper_runs)


FP8_KERNELS = {"_per_token_group_quant_kernel", "_w8a8_scaled_mm_kernel", "_moe_fp8_gate_up_kernel",
               "_moe_fp8_down_kernel"}


def test_every_fp8_kernel_compiles(records):
    assert FP8_KERNELS <= {r["kernel"] for r in records}


def test_no_spills_and_budgets(records):
    assert_fits_hopper(records)


def test_gemm_uses_fp8_tensor_cores(records):
    gemms = [r for r in records if r["kernel"] in ("_w8a8_scaled_mm_kernel", "_moe_fp8_gate_up_kernel",
                                                   "_moe_fp8_down_kernel")]
    assert any(r["config"]["BLOCK_M"] >= 64 for r in gemms)
    for r in gemms:
        if r["config"]["BLOCK_M"] >= 64:
            assert r["qgmma"] > 0, f"{r['workload']}: no FP8 warp-group MMA (QGMMA) in the SASS"
        else:
            assert r["hmma"] + r["qgmma"] > 0, f"{r['workload']}: no tensor-core MMA in the SASS"
