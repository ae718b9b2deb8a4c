"""Native CPU kernels: small C files compiled on first use with the system C compiler.

They are the CPU fast path where the PyTorch reference is far from the machine's limit:
paged attention, decode and prefill (the reference must first gather every sequence's pages
into one padded block), and the row-wise ops of every layer (RMSNorm with the residual add, SiLU-and-
mul, RoPE, the greedy argmax, the KV store), which the reference runs as several passes with
temporaries.
Each is tested against its reference in ``tests/kernels/test_cpu_native.py``.

The wrappers check their index tensors and shapes before a kernel runs (``checks.py``: a block
id, slot or position outside its cache is a ValueError, not a stray read or write), and the
kernels that allocate return a status (``common.h``: TF_OK / TF_ENOMEM) that the wrapper raises
as MemoryError (``tests/kernels/test_cpu_native_checks.py``).

The library is built once per (source, compiler, CPU) into ``$TOKENFAB_CACHE_DIR`` (default
``~/.cache/tokenfab``) and loaded with ctypes; it links the same ``libgomp.so.1`` that torch
loaded, so its OpenMP threads are torch's threads; every parallel region runs ``tf_set_num_threads``'s
count (``threads.c``; ``engine/runner/cpu_threads.py`` sets it with torch's). Without a compiler, or with
``TOKENFAB_CPU_NATIVE=0``, ``native_library()`` returns None and callers use the reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCES = ("paged_attention.c", "elementwise.c", "ggml_matmul.c", "ggml_q8.c", "ggml_amx.c", "w4a16.c",
            "fp8_matmul.c", "threads.c", "llama_step.c", "ggml_q8_decode.c")
_HEADERS = ("common.h", "ggml_common.h", "ggml_f32_vec.h", "ggml_f32_gemv.h", "ggml_f32_panel.h", "ggml_q8_tile.h",
            "ggml_q8_dot.h", "paged_attention.h", "paged_attention_vec.h", "paged_attention_prefill.h")
# -ffast-math lets gcc vectorize expf (glibc's libmvec) and reorder the dot-product sums; the
# object is linked without it, so crtfastmath.o (which would flush denormals process-wide)
# is not pulled into the library.
_COMPILE_FLAGS = ["-O3", "-march=native", "-fPIC", "-fopenmp", "-ffast-math", "-std=c11"]
# x86: the loops the compiler vectorizes (softmax, expf, norms, the w4a16/fp8 dot products) run 8 lanes
# wide on AVX-512 targets too (GCC's tuning for Sapphire Rapids and Ice Lake does so already; generic
# x86-64-v4 tuning would take 16 and call other libmvec variants), so the AVX-512 and AVX2 builds give
# the same bits (tests/kernels/test_cpu_native_isa.py); the hot loops are intrinsics, 16 lanes wide.
# -mtune=generic: -march=native also tunes for the CPU, and GCC's AMD Zen tuning splits FMA chains (a
# multiply and an add where the AVX2 build contracts one FMA), so the same loop rounded differently there.
if platform.machine().lower() in ("x86_64", "amd64"):
    _COMPILE_FLAGS += ["-mprefer-vector-width=256", "-mtune=generic"]
_LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


# CPython's dict behind os.environ (bytes keys on POSIX): a lookup there costs ~30 ns where
# os.environ.get costs ~500 (key encoding, value decoding); the kernel choice reads the environment
# ~700 times a decoded token. It is the same dict os.environ / monkeypatch.setenv write, so a change
# of the environment is still seen at once: nothing to refresh.
_ENV_DATA = getattr(os.environ, "_data", None)
_FAST_ENV = os.name == "posix" and isinstance(_ENV_DATA, dict)


def getenv(name: str, default: str) -> str:
    """``os.environ.get(name, default)``, through the backing dict where it can (see above)."""
    if _FAST_ENV:
        raw = _ENV_DATA.get(name.encode())  # type: ignore[union-attr]
        return default if raw is None else os.fsdecode(raw)
    return os.environ.get(name, default)


_NATIVE_KEY = b"TOKENFAB_CPU_NATIVE"
_OFF = (b"0", b"false", b"no")


def enabled() -> bool:
    """``TOKENFAB_CPU_NATIVE`` is not 0/false/no (read on every call: tests change it)."""
    if _FAST_ENV:
        return _ENV_DATA.get(_NATIVE_KEY, b"1") not in _OFF  # type: ignore[union-attr]
    return os.environ.get("TOKENFAB_CPU_NATIVE", "1") not in ("0", "false", "no")


def cache_dir() -> Path:
    root = os.environ.get("TOKENFAB_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tokenfab")
    return Path(root) / "cpu_kernels"


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(lines)


def _compile_flags() -> list[str]:
    """The flags, plus ``TOKENFAB_CPU_CFLAGS`` (e.g. ``-march=x86-64-v2`` to build the portable
    code paths that machines without AVX-512 run; tests use it)."""
    return _COMPILE_FLAGS + os.environ.get("TOKENFAB_CPU_CFLAGS", "").split()


def _build(cc: str) -> Path:
    here = Path(__file__).parent
    flags = _compile_flags()
    sources = [here / s for s in _SOURCES]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256()
    inputs = [*sources, *(here / h for h in _HEADERS)]
    for part in [*(f.read_bytes() for f in inputs), version.encode(), _cpu_signature().encode(),
                 " ".join(flags + _LINK_FLAGS).encode()]:
        key.update(part)
    out = cache_dir() / f"tokenfab_cpu_{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = []
        for src in sources:
            obj = Path(tmp) / (src.stem + ".o")
            subprocess.run([cc, *flags, f"-I{here}", "-c", str(src), "-o", str(obj)], check=True,
                           capture_output=True, text=True)
            objects.append(str(obj))
        lib = Path(tmp) / out.name
        subprocess.run([cc, *objects, "-o", str(lib), *_LINK_FLAGS], check=True, capture_output=True, text=True)
        os.replace(lib, out)  # atomic: concurrent builders each install a complete file
    return out


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    signatures = {
        "paged_attention_f32": [p] * 7 + [i64] * 15 + [f32, i64, f32, p],
        "paged_attention_bf16": [p] * 7 + [i64] * 15 + [f32, i64, f32, p],
        "rms_norm": [p, i64, i64, i64, p, i64, p, p, i64, i64, i64, f32, i32],
        "silu_and_mul": [p, i64, p, i64, i64, i64, i32],
        "rotary_qk": [p, p, i64, i64, i64, p, p, i64, i64, i64, p, p, i64, i64, i64, i32, i32],
        "argmax_rows": [p, i64, i64, p],
        "store_kv": [p, i64, i64, p, i64, i64, p, p, p, i64, i64, i64, i64, i32],
        "ggml_matmul_f32": [p, p, i64, i64, i64, i32, p],
        "ggml_matmul_q8": [p, p, i64, i64, i64, i32, p],
        "matmul_f32_rowinv": [p, p, i64, i64, i64, p],
        "ggml_dequant_rows": [p, i64, i32, p, i64, p],
        "ggml_isa": [],
        "tf_cpu_isa": [],
        "ggml_amx_probe": [],
        "ggml_amx_built": [],
        "ggml_amx_enable": [],
        "ggml_matmul_q8_amx": [p, p, i64, i64, i64, i32, p],
        "w4a16_matmul": [p, i32, i64, p, i64, p, i32, i64, p, p, i32, i64, i64, i64, i64, p, i32, i64],
        "w4a16_dequant": [p, i64, p, i32, i64, i32, i64, i64, i64, p, i32],
        "fp8_matmul_f32": [p, i64, i64, i64, p, i64, i64, p, i64, i64, i64, p, i64],
        "fp8_dequant_rows": [p, i64, i64, i64, p, i64, i64, i64, p],
        "tf_set_num_threads": [i32],
        "tf_get_num_threads": [],
        "tf_parallel_width": [],
        "llama_step_f32": [p, p, f32, f32, p, p, p, i64, p, i64, p, p, i64, p],
        "ggml_set_panel_min_rows": [i32],
        "ggml_panel_min_rows": [],
        "ggml_q8_set_tile_min_rows": [i32],
        "ggml_q8_tile_min_rows": [],
        "ggml_q8_row16_bytes": [i64, i64, i32],
        "ggml_q8_row16_pack": [p, i64, i64, i32, p],
        "ggml_q8_row16_built": [],
        "ggml_matmul_q8_row16": [p, p, i64, i64, i64, i32, p],
    }
    returns_status = {"paged_attention_f32", "paged_attention_bf16", "rms_norm", "silu_and_mul", "rotary_qk",
                      "ggml_matmul_f32", "ggml_matmul_q8", "matmul_f32_rowinv", "ggml_isa", "ggml_amx_probe",
                      "tf_cpu_isa", "ggml_amx_built", "ggml_amx_enable", "ggml_matmul_q8_amx",
                      "w4a16_matmul", "w4a16_dequant", "fp8_matmul_f32", "fp8_dequant_rows",
                      "tf_get_num_threads", "tf_parallel_width", "llama_step_f32",
                      "ggml_panel_min_rows", "ggml_q8_tile_min_rows", "ggml_q8_row16_built", "ggml_matmul_q8_row16"}
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int if name in returns_status else None  # common.h: TF_OK / TF_ENOMEM
        fn.argtypes = args
    lib.ggml_q8_row16_bytes.restype = ctypes.c_int64


def native_library() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None when disabled or unbuildable."""
    global _library, _tried
    if not enabled():
        return None
    if _tried:
        return _library
    with _lock:
        if _tried:
            return _library
        import torch  # noqa: F401  (libgomp.so.1 must be torch's before the library loads)

        cc = _compiler()
        if cc is None:
            log.warning("no C compiler found: CPU decode attention uses the PyTorch reference (slower)")
        else:
            try:
                _library = ctypes.CDLL(str(_build(cc)))
                _declare(_library)
            except (OSError, subprocess.CalledProcessError) as e:
                detail = getattr(e, "stderr", "") or str(e)
                log.warning("building the CPU kernels failed, using the PyTorch reference: %s", detail[-2000:])
                _library = None
        _tried = True
    return _library
