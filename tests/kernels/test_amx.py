"""The AMX kernel of the int8-activation mode (``act="q8"``, ``kernels/cpu/ggml_amx.c``).

Its contract: bit for bit the VNNI path's result. Where AMX is usable the real tiles are compared
with the VNNI path over edge shapes (else that test is skipped with the probe's reason). Everywhere:
the library holds the AMX functions; a build whose four tile instructions are emulated in C
(``-DTF_AMX_EMULATE``) runs the very kernel code -- tile layout, panel packing, partial tiles,
float32 order -- against the VNNI path bit for bit, and through the selection (self-test included);
the selection falls back, with its reason, at each condition that fails.
"""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
import types
from pathlib import Path

import pytest
import torch

from tokenfab.kernels.cpu import ggml_matmul as gm
from tokenfab.kernels.cpu import native_library

QTYPES = ("Q8_0", "Q4_0", "Q4_1")
# M: one row, a partial tile, one past a tile, whole tiles; K: multiples of 32 (also not of the
# 64-byte tile depth); N: partial and whole 16-row weight tiles
EDGE_SHAPES = [(m, n, k) for m in (1, 15, 17, 64) for n, k in ((1, 32), (20, 96), (16, 64), (33, 320))]
CPU = Path(gm.__file__).parent

needs_native = pytest.mark.skipif(native_library() is None, reason="no C compiler / native kernels disabled")


def _both(lib, fn_a: str, fn_b: str, qtype: str, m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    x, w = gm.random_q8_case(m, n, k, qtype, seed)
    a, b = torch.full((m, n), float("nan")), torch.full((m, n), float("nan"))
    for name, out in ((fn_a, a), (fn_b, b)):
        rc = getattr(lib, name)(x.data_ptr(), w.data_ptr(), m, n, k, gm._QTYPE_ID[qtype], out.data_ptr())
        assert rc == 0, (name, rc)
    return x, w, a, b


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


# ---------------------------------------------------------------- always: the build
@needs_native
def test_library_holds_the_amx_functions():
    lib = native_library()
    for name in ("ggml_matmul_q8_amx", "ggml_amx_built", "ggml_amx_enable", "ggml_amx_probe"):
        assert getattr(lib, name) is not None
    if shutil.which("nm"):
        symbols = subprocess.run(["nm", "-D", "--defined-only", lib._name], capture_output=True, text=True).stdout
        for name in ("ggml_matmul_q8_amx", "ggml_amx_built", "ggml_amx_enable", "ggml_amx_probe"):
            assert f" T {name}\n" in symbols, name
    version = subprocess.run(["cc", "-dumpfullversion", "-dumpversion"], capture_output=True, text=True).stdout
    gcc = subprocess.run(["cc", "--version"], capture_output=True, text=True).stdout
    if platform.machine() == "x86_64" and "clang" not in gcc and int(version.split(".")[0] or 0) >= 11:
        assert lib.ggml_amx_built() == 1  # real tile instructions (target attribute), whatever -march says


def _emulated_library(tmp_path: Path) -> ctypes.CDLL:
    """ggml_q8.c + ggml_amx.c (+ threads.c, the kernels' thread count) built with the tile instructions
    emulated in C."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    so = tmp_path / "amx_emulated.so"
    flags = ["-O1", "-march=native", "-fPIC", "-fopenmp", "-ffast-math", "-std=c11", "-DTF_AMX_EMULATE", f"-I{CPU}"]
    # compiled with -ffast-math like the real build, but linked without it (as kernels/cpu/__init__.py does): a
    # -ffast-math link pulls in crtfastmath.o, which flushes denormals to zero in the whole test process
    objs = []
    for f in ("ggml_q8.c", "ggml_amx.c", "threads.c"):
        obj = tmp_path / f.replace(".c", ".o")
        subprocess.run([cc, *flags, "-c", str(CPU / f), "-o", str(obj)], check=True, capture_output=True, text=True)
        objs.append(str(obj))
    subprocess.run([cc, "-shared", "-fopenmp", *objs, "-o", str(so), "-lm"], check=True, capture_output=True,
                   text=True)
    lib = ctypes.CDLL(str(so))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name in ("ggml_matmul_q8", "ggml_matmul_q8_amx"):
        getattr(lib, name).argtypes = [p, p, i64, i64, i64, i32, p]
        getattr(lib, name).restype = i32
    for name in ("ggml_amx_built", "ggml_amx_enable"):
        getattr(lib, name).argtypes = []
        getattr(lib, name).restype = i32
    return lib


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return _emulated_library(tmp_path_factory.mktemp("amx_emu"))


@pytest.mark.parametrize("qtype", QTYPES)
def test_emulated_amx_kernel_equals_vnni_bit_for_bit(emulated, qtype):
    assert emulated.ggml_amx_built() == 2
    for i, (m, n, k) in enumerate(EDGE_SHAPES):
        x, w, vnni, amx = _both(emulated, "ggml_matmul_q8", "ggml_matmul_q8_amx", qtype, m, n, k, i)
        assert _bits_equal(vnni, amx), (qtype, m, n, k)
        if m == 17:  # and the torch reference of the q8 mode
            assert _bits_equal(amx, gm.ggml_matmul_reference(x, w, qtype, k, act="q8")), (qtype, m, n, k)


def test_emulated_amx_selected_after_its_self_test(emulated, monkeypatch):
    monkeypatch.setattr(gm, "amx_status", lambda: (True, "AMX tiles work"))
    assert gm.amx_self_test(emulated) is None
    emulated.ggml_isa = lambda: 4  # (ggml_matmul.c is not in this small build)
    path, why = gm.select_q8_path(emulated)
    assert path == "amx-emulated" and "self-test" in why


# ---------------------------------------------------------------- always: the selection
def _fake_lib(built: int = 1, enable: int = 0, isa: int = 4 | 1) -> types.SimpleNamespace:
    return types.SimpleNamespace(ggml_amx_built=lambda: built, ggml_amx_enable=lambda: enable, ggml_isa=lambda: isa)


def test_selection_falls_back_at_each_condition(monkeypatch):
    monkeypatch.delenv("TOKENFAB_AMX", raising=False)
    monkeypatch.setattr(gm, "amx_status", lambda: (True, "AMX tiles work"))
    monkeypatch.setattr(gm, "amx_self_test", lambda lib: None)
    assert gm.select_q8_path(_fake_lib())[0] == "amx"
    assert gm.select_q8_path(_fake_lib(built=0)) == ("vnni", "this build has no AMX kernel (needs GCC >= 11 on x86-64)")
    assert gm.select_q8_path(_fake_lib(built=0, isa=2))[0] == "avx2"
    assert gm.select_q8_path(_fake_lib(built=0, isa=0))[0] == "scalar"
    path, why = gm.select_q8_path(_fake_lib(enable=3))
    assert path == "vnni" and "refused" in why and "this process" in why
    monkeypatch.setattr(gm, "amx_self_test", lambda lib: "Q4_1 M=1 N=20 K=96: 3 of 20 results differ")
    path, why = gm.select_q8_path(_fake_lib())
    assert path == "vnni" and "self-test failed" in why and "3 of 20" in why
    monkeypatch.setattr(gm, "amx_status", lambda: (False, "the probe faulted (signal 4)"))
    assert gm.select_q8_path(_fake_lib()) == ("vnni", "the probe faulted (signal 4)")
    monkeypatch.setattr(gm, "amx_status", lambda: (True, "AMX tiles work"))
    monkeypatch.setenv("TOKENFAB_AMX", "0")
    assert gm.select_q8_path(_fake_lib()) == ("vnni", "AMX turned off (TOKENFAB_AMX=0)")


@needs_native
def test_dispatch_without_amx_runs_the_vnni_path(monkeypatch):
    """amx_status() False: the q8 matmul runs ggml_matmul_q8 (the reference's bits), and
    ggml_kernel_info says which path and why."""
    lib = native_library()
    monkeypatch.setattr(gm, "amx_status", lambda: (False, "no AMX here (test)"))
    gm.reset_q8_path()
    try:
        calls = []
        amx = lib.ggml_matmul_q8_amx
        monkeypatch.setattr(lib, "ggml_matmul_q8_amx", lambda *a: calls.append(a) or amx(*a), raising=False)
        x, w = gm.random_q8_case(17, 20, 96, "Q4_0", 1)
        assert _bits_equal(gm.ggml_matmul(x, w, "Q4_0", 96, act="q8"),
                           gm.ggml_matmul_reference(x, w, "Q4_0", 96, act="q8"))
        assert not calls
        info = gm.ggml_kernel_info()
        assert info["q8_path"] == gm._int8_path(lib) and info["q8_reason"] in ("no AMX here (test)",
                                                                             "this build has no AMX kernel "
                                                                             "(needs GCC >= 11 on x86-64)")
    finally:
        gm.reset_q8_path()


@needs_native
def test_forced_amx_status_on_a_machine_without_amx_falls_back(monkeypatch):
    """A probe that (wrongly) says usable on a machine whose kernel refuses the tile state: the
    permission request or the self-test stops it; nothing faults."""
    if "amx_int8" in gm._cpu_flags():
        pytest.skip("this CPU reports AMX")
    monkeypatch.setattr(gm, "amx_status", lambda: (True, "AMX tiles work"))
    path, why = gm.select_q8_path(native_library())
    assert path == gm._int8_path(native_library()) and why


# ---------------------------------------------------------------- where AMX is usable: the real tiles
@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
def test_real_amx_equals_vnni_bit_for_bit(qtype):
    usable, why = gm.amx_status()
    if not usable:
        pytest.skip(f"AMX not usable here: {why}")
    lib = native_library()
    assert lib.ggml_amx_built() == 1 and lib.ggml_amx_enable() == 0
    assert gm.amx_self_test(lib) is None
    for i, (m, n, k) in enumerate(EDGE_SHAPES):
        _, _, vnni, amx = _both(lib, "ggml_matmul_q8", "ggml_matmul_q8_amx", qtype, m, n, k, i)
        assert _bits_equal(vnni, amx), (qtype, m, n, k)
    gm.reset_q8_path()
    try:
        assert gm.q8_path()[0] == "amx"
    finally:
        gm.reset_q8_path()


@needs_native
def test_dispatch_uses_the_chosen_kernel_from_one_tile_of_rows(monkeypatch):
    """With AMX chosen, products of >= AMX_MIN_ROWS activation rows call it, smaller ones (decode)
    the VNNI kernel; the bits are the reference's either way (here the chosen kernel is a spy that
    runs the VNNI kernel)."""
    lib = native_library()
    calls = []
    vnni = lib.ggml_matmul_q8
    monkeypatch.setattr(gm, "_q8_choice", (lib, lambda *a: calls.append(a[2]) or vnni(*a), "amx", "test"))
    for m in (1, gm.AMX_MIN_ROWS - 1, gm.AMX_MIN_ROWS, 40):
        x, w = gm.random_q8_case(m, 24, 64, "Q8_0", m)
        assert _bits_equal(gm.ggml_matmul(x, w, "Q8_0", 64, act="q8"),
                           gm.ggml_matmul_reference(x, w, "Q8_0", 64, act="q8"))
    assert calls == [gm.AMX_MIN_ROWS, 40]
