"""Every Triton kernel compiles for Hopper (sm_90) at the dispatcher's configs, without a GPU.

ARCHITECTURE.md kernel rule 5: all compile, none spills to local memory, and the attention
kernels that multiply tiles of at least 64 rows with 16-bit operands use Hopper's warp-group
MMA (HGMMA in the SASS). The compile runs in a subprocess because this process imported
triton for the interpreter (one for every compile test: the ``hopper_batch`` fixture). The fast tier
compiles the script's --quick subset (every kernel, at the configs the checks below need); its slow
twin (``[full]``) every workload, with the same checks. The table in tokenfab/kernels/README.md comes from the same
script: ``python tests/kernels/hopper_compile.py --markdown``.
"""

from __future__ import annotations

import pytest

from tests.kernels.hopper_harness import H100_MAX_SHARED


@pytest.fixture(scope="module", params=[pytest.param([("hopper_compile.py", ("--quick",))], id="quick"),
                                        pytest.param([("hopper_compile.py", ())], id="full", marks=pytest.mark.slow)])
def hopper_runs(request) -> list:
    return request.param


@pytest.fixture(scope="module")
def records(hopper_batch, hopper_runs) -> list[dict]:
    return hopper_batch(hopper_runs)


def test_every_kernel_compiles(records):
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from tests.kernels.hopper_compile import kernel_modules

    defined = {
        name
        for mod in kernel_modules()
        for name, obj in vars(mod).items()
        if isinstance(obj, (JITFunction, InterpretedFunction)) and name.endswith("_kernel")
    }
    compiled = {r["kernel"] for r in records}
    assert defined <= compiled, f"never compiled: {sorted(defined - compiled)}"


def test_no_spills(records):
    bad = [(r["workload"], r["kernel"], r["local"], r["stack"]) for r in records if r["local"] or r["stack"]]
    assert not bad, f"local memory / stack in use (register spills): {bad}"


def test_shared_memory_fits(records):
    bad = [(r["workload"], r["kernel"], r["shared"]) for r in records if r["shared"] > H100_MAX_SHARED]
    assert not bad, bad


def test_prefill_attention_uses_hgmma(records):
    prefill = [r for r in records if r["kernel"] == "_prefill_kernel"]
    assert prefill
    for r in prefill:
        big_16bit = r["config"]["BLOCK_M"] >= 64 and r["config"]["DOT_PREC"] != "ieee"
        if big_16bit:
            assert r["hgmma"] > 0, f"{r['workload']}: no HGMMA in the SASS"


def test_decode_attention_uses_tensor_cores(records):
    """Decode tiles have 16 rows (a kv group's query heads): mma.sync (HMMA) for 16-bit caches."""
    for r in records:
        if r["kernel"] == "_decode_split_kernel" and r["config"]["DOT_PREC"] != "ieee":
            assert r["hmma"] + r["hgmma"] > 0, r["workload"]


def test_registers_within_budget(records):
    for r in records:
        assert r["registers"] <= 255, r
        # a program of num_warps warps must fit one multiprocessor's 64K registers
        assert r["registers"] * 32 * r["num_warps"] <= 65536, r


def test_moe_train_grouped_gemms_use_hgmma(records):
    """The MoE training GEMMs (forward, d input, d weight) with 16-bit operands: Hopper's warp-group MMA."""
    grouped = [r for r in records if r["kernel"] in ("_grouped_mm_kernel", "_grouped_wgrad_kernel")]
    assert {r["kernel"] for r in grouped} == {"_grouped_mm_kernel", "_grouped_wgrad_kernel"}
    for r in grouped:
        if r["config"]["DOT_PREC"] != "ieee":
            assert r["hgmma"] > 0, f"{r['workload']} {r['kernel']}: no HGMMA in the SASS"


def test_training_elementwise_kernels_compile(records):
    """Issue 18's RMSNorm / RoPE / gated-activation training kernels: forward and backward compiled,
    up to the largest row the Triton RMSNorm takes (16384: the backward holds a row in 32 warps)."""
    from tokenfab.kernels.norm_train import MAX_HIDDEN

    kernels = {r["kernel"] for r in records if "_train" in r["workload"]}
    assert {"_rms_norm_train_fwd_kernel", "_rms_norm_train_bwd_kernel", "_rope_train_kernel",
            "_act_and_mul_train_fwd_kernel", "_act_and_mul_train_bwd_kernel"} <= kernels
    assert any(r["kernel"] == "_rms_norm_train_bwd_kernel" and r["config"]["BLOCK_H"] == MAX_HIDDEN for r in records)
