"""Every code path of the native CPU kernels, each against its reference and against the others.

The library picks AVX-512, AVX2 + FMA (+ F16C, + AVX-VNNI for the int8 dots) or portable C at build
time from its target (``-march=native``: the CPU's CPUID flags). This machine's own build runs in this
process; the other paths are built into fresh caches (``TOKENFAB_CPU_CFLAGS``, ``TOKENFAB_CACHE_DIR``),
once per test session each and shared with the other modules that need them (``native_builds.py``),
and run ``tests/kernels/cpu_isa_cases.py`` in a subprocess. A build the
CPU cannot run is skipped with the missing CPUID flags named, after checking that it compiles.
The AVX2 build runs in the fast tests; the rest of the matrix (~30 s a build) is marked slow.

Which cases must agree bit for bit across two builds is ``must_equal``; where they need not, the
reason and the tolerance are ``TOLERANCE`` (per kernel family).
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import pytest
import torch

import tokenfab.kernels.cpu as native_lib
from tests.kernels.native_builds import AVX2, PORTABLE, run_python
from tests.kernels.tolerances import assert_close
from tokenfab.kernels.cpu.ggml_matmul import ggml_kernel_info
from tokenfab.kernels.cpu.info import cpu_kernel_info

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("paged_attention", "elementwise", "w4a16", "fp8", "ggml_f32", "ggml_q8")

# name: (TOKENFAB_CPU_CFLAGS, the /proc/cpuinfo flags it needs, the path every family must report)
VARIANTS = {
    "avx2": (AVX2, ("avx2", "fma", "f16c", "bmi2", "movbe"), "avx2"),
    "avx2-vnni": ("-march=x86-64-v3 -mavxvnni", ("avx2", "fma", "f16c", "bmi2", "movbe", "avx_vnni"), "avx2"),
    # AVX-512 without AVX512-BF16 (the native build here adds it): bfloat16 caches then match AVX2 too
    "avx512": ("-march=x86-64-v4", ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"), "avx512"),
    "scalar": (PORTABLE, (), "scalar"),  # no AVX (x86-64-v2; the C has no SSE-level code paths)
}

# What the paths may differ by, per family (the reference comparison always uses assert_close).
TOLERANCE = {
    "paged_attention": "AVX2 == AVX-512 bit for bit (16-lane accumulators as two halves, reduced in the AVX-512 "
                       "tree's order; masked tails; same per-column FMAs), except bfloat16 caches on AVX512-BF16, "
                       "whose vdpbf16ps pairs the products differently: bfloat16 tolerance there. Scalar C: "
                       "float32 tolerance (another summation order, no FMA)",
    "elementwise": "AVX2 == AVX-512 bit for bit (both vectorized 8 lanes wide, -mprefer-vector-width=256); "
                   "scalar: float32 tolerance",
    "w4a16": "AVX2 == AVX-512 bit for bit (exact table decode, one compiled dot loop); scalar: float32 tolerance",
    "fp8": "AVX2 == AVX-512 bit for bit; the dequantized rows on every path (exact decode, one rounding)",
    "ggml_f32": "float32 tolerance between AVX2 and AVX-512: one accumulator per output, 16 lanes wide on AVX-512, "
                "8 on AVX2 (ggml_f32_vec.h); AVX2 == AVX2+VNNI bit for bit",
    "ggml_q8": "bit for bit on every path (integer block dots, float32 sum in block order)",
}
# cases equal on every path, scalar C included
_EXACT_EVERYWHERE = ("ggml_q8_", "ggml_rows_", "fp8_dequant_", "argmax")


def must_equal(case: str, a: dict, b: dict) -> bool:
    """Whether builds with infos ``a`` and ``b`` (cpu_kernel_info()) must agree bit for bit on ``case``."""
    if case.startswith(_EXACT_EVERYWHERE):
        return True
    kinds = {a["elementwise"], b["elementwise"]}
    if "scalar" in kinds:
        return False
    if case.startswith("ggml_f32_") and len(kinds) > 1:
        return False
    bf16_dot = {a["paged_attention"].endswith("+bf16"), b["paged_attention"].endswith("+bf16")}
    return not (case.startswith("attn_") and "fp8kv" not in case and case.endswith("_bf16") and len(bf16_dot) > 1)


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(ln.split(":", 1)[1].split()) for ln in text.splitlines() if ln.startswith("flags")), set())


def why_not_runnable(variant: str, flags: set[str]) -> str | None:
    """None when this CPU can run ``variant``'s build, else why not (the CPUID flags it lacks)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 machine ({platform.machine()}): the {variant} build targets x86-64"
    missing = [f for f in VARIANTS[variant][1] if f not in flags]
    if missing:
        return f"this CPU's CPUID lacks {', '.join(missing)}: the {variant} build compiles but cannot run here"
    return None


def compile_only(cflags: str, out: Path) -> None:
    """Compile every kernel source for ``cflags`` (no link, no run): the path at least builds."""
    cc = native_lib._compiler()
    assert cc is not None
    here = Path(native_lib.__file__).parent
    flags = native_lib._COMPILE_FLAGS + cflags.split()
    for src in native_lib._SOURCES:
        subprocess.run([cc, *flags, f"-I{here}", "-c", str(here / src), "-o", str(out / (src + ".o"))], check=True,
                       capture_output=True, text=True)


def _run_variant(variant: str, root: Path) -> dict:
    out = root / f"{variant}.pt"
    run_python(VARIANTS[variant][0], ["-m", "tests.kernels.cpu_isa_cases", str(out)], timeout=600)
    return torch.load(out)


@pytest.fixture(scope="session")
def builds(tmp_path_factory):
    """variant -> its results ({"info", "cases"}), built and run once per session; "native" is this
    process's library. Skips (naming the missing CPUID flags) what the CPU cannot run."""
    if native_lib.native_library() is None or os.environ.get("TOKENFAB_CPU_CFLAGS"):
        pytest.skip("no native library, or TOKENFAB_CPU_CFLAGS set: this process's build is not the native one")
    root = tmp_path_factory.mktemp("cpu_isa")
    done: dict = {}

    def get(variant: str) -> dict:
        if variant not in done:
            if variant == "native":
                from tests.kernels.cpu_isa_cases import run_cases

                done[variant] = run_cases()
            else:
                why = why_not_runnable(variant, cpu_flags())
                if why is not None:
                    if platform.machine().lower() in ("x86_64", "amd64"):
                        (root / f"{variant}_objs").mkdir(exist_ok=True)
                        compile_only(VARIANTS[variant][0], root / f"{variant}_objs")
                    pytest.skip(why)
                done[variant] = _run_variant(variant, root)
        return done[variant]

    return get


def _check_variant(builds, variant: str) -> None:
    got, native = builds(variant), builds("native")
    info = got["info"]
    path = VARIANTS[variant][2]
    for family in ("paged_attention", "elementwise", "w4a16", "fp8", "ggml_f32"):
        assert info[family].split("+")[0] == path, (family, info)
    assert set(got["cases"]) == set(native["cases"])
    for case, (out, ref) in got["cases"].items():
        if out.is_floating_point():
            assert_close(out, ref)
        else:
            assert torch.equal(out, ref), case
        other = native["cases"][case][0]
        if must_equal(case, info, native["info"]):
            assert torch.equal(out.view(-1), other.view(-1)), (variant, case, "must equal the native build bit for bit")
        elif out.is_floating_point():
            assert_close(out, other)


def test_avx2_build_every_family(builds):
    """The AVX2 + FMA + F16C build (x86-64-v3): every kernel family reports the AVX2 path, matches its
    reference, and equals this machine's build bit for bit where ``TOLERANCE`` says so."""
    _check_variant(builds, "avx2")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["avx2-vnni", "avx512", "scalar"])
def test_other_builds(builds, variant):
    """AVX2 + AVX-VNNI (the int8 dots on vpdpbusd), AVX-512 without AVX512-BF16, and the portable C."""
    _check_variant(builds, variant)
    if variant == "avx2-vnni":
        assert builds(variant)["info"]["ggml_q8"] == "vnni"
    if variant == "avx512" and "avx2" in cpu_flags():  # the AVX-512 build equals AVX2's, bfloat16 caches too
        avx2 = builds("avx2")
        for case, (out, _) in builds(variant)["cases"].items():
            if not case.startswith("ggml_f32_"):
                assert torch.equal(out.view(-1), avx2["cases"][case][0].view(-1)), case


def test_cpu_kernel_info_reports_this_build():
    info = cpu_kernel_info()
    if native_lib.native_library() is None:
        assert info["native"] is False
        return
    assert set(FAMILIES) <= set(info) and info["ggml_f32"] == ggml_kernel_info()["isa"]
    if not os.environ.get("TOKENFAB_CPU_CFLAGS"):  # -march=native: the CPUID flags decide
        flags = cpu_flags()
        want = "avx512" if "avx512f" in flags else ("avx2" if {"avx2", "fma"} <= flags else "scalar")
        for family in ("paged_attention", "elementwise", "w4a16", "fp8"):
            assert info[family].split("+")[0] == want, (family, info)
        assert info["paged_attention"].endswith("+bf16") == ("avx512_bf16" in flags)


def test_skip_reasons_name_the_missing_flags():
    if platform.machine().lower() not in ("x86_64", "amd64"):
        assert "not an x86-64 machine" in why_not_runnable("avx2", set())
        return
    assert why_not_runnable("scalar", set()) is None
    assert "avx_vnni" in why_not_runnable("avx2-vnni", {"avx2", "fma", "f16c", "bmi2", "movbe"})
    assert why_not_runnable("avx512", {"avx512f"}).startswith("this CPU's CPUID lacks avx512bw")


def test_tolerance_table_covers_every_family():
    assert set(TOLERANCE) == set(FAMILIES)
