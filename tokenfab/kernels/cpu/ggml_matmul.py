"""Matmuls against packed GGUF weights on CPU: Q8_0, Q4_0 and Q4_1 blocks stay as the file stores
them, and ``ggml_matmul.c`` dequantizes them in registers.

A packed weight is the GGUF tensor's raw bytes seen as a uint8 tensor ``[N, K/32 * block_bytes]``
(row-major, one row = K/32 blocks of 32 weights; block layouts in ``ggml_matmul.c``).

- ``ggml_matmul(x, w, qtype, k, act="f32")`` = ``x @ dequant(w).T`` with float32 activations
  (W4A32 / W8A32): only the float32 summation order differs from the reference, so greedy output
  stays that of float32 ``transformers`` on the dequantized weights.
- ``act="q8"`` (opt-in, faster): the activations are quantized per 32-block to int8, as llama.cpp
  does, with ``d = amax / 127`` (kept in float32, not rounded to float16), ``q = round-half-even(x *
  (1 / d))``; the blocks are then integer dot products (VNNI where the CPU has it), and the block
  terms ``dot * (d_w * d_x)`` (Q4_1: ``+ m_w * (d_x * sum(q_x))``) are added in float32 in block
  order, each step one IEEE rounding: every kernel path and ``ggml_matmul_reference`` agree bit for
  bit (int8 rounding is chaotic: summation-order differences made greedy paths part).
- ``ggml_matmul_reference`` (same signature): plain torch, the fallback (no compiler,
  ``TOKENFAB_CPU_NATIVE=0``, non-CPU tensors) and the test oracle.

AMX (``ggml_amx.c``): ``act="q8"`` runs on AMX-INT8 tiles where they work, bit for bit the VNNI
path's result (same int32 block sums, same float32 order). Chosen once per process
(``q8_path()``): the library holds the kernel (GCC >= 11, x86-64), ``amx_status()`` says usable
(cpuid, XCR0, ``arch_prctl(ARCH_REQ_XCOMP_PERM)`` and one tile instruction, in a child process,
because some VMs report AMX and then fault), ``TOKENFAB_AMX`` is not 0, this process is granted
the tile state, and a known-answer self-test (small matrices, every format, AMX vs VNNI) agrees
bit for bit; otherwise the VNNI path runs and the reason is logged and reported by
``ggml_kernel_info()`` (``q8_path``, ``q8_reason``). Products of fewer than ``AMX_MIN_ROWS``
activation rows (decode) stay on the VNNI path either way (the same bits).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

from tokenfab.kernels.cpu import native_library
from tokenfab.kernels.cpu.checks import check_status

log = logging.getLogger(__name__)

BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
_QTYPE_ID = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}
ACT_MODES = ("f32", "q8")


def _check_format(qtype: str, k: int) -> int:
    """The block size in bytes of ``qtype``; ValueError for an unknown type or K not a multiple of 32."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"unsupported GGML type {qtype!r}; packed kernels take {sorted(BLOCK_BYTES)}")
    if not isinstance(k, int) or k <= 0 or k % 32:
        raise ValueError(f"K must be a positive multiple of 32 (the GGML block size), got {k!r}")
    return BLOCK_BYTES[qtype]


def _check_weight(w: torch.Tensor, qtype: str, k: int) -> None:
    bb = _check_format(qtype, k)
    if w.dtype != torch.uint8 or w.dim() != 2:
        raise ValueError(f"packed weight must be a 2-D uint8 tensor, got {w.dtype} of shape {tuple(w.shape)}")
    if w.shape[1] != k // 32 * bb:
        raise ValueError(f"a {qtype} row of K={k} holds {k // 32 * bb} bytes, the weight has {w.shape[1]}")


def _check_matmul(x: torch.Tensor, w: torch.Tensor, qtype: str, k: int, act: str) -> None:
    _check_weight(w, qtype, k)
    if act not in ACT_MODES:
        raise ValueError(f"act must be one of {ACT_MODES}, got {act!r}")
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"x must be a 2-D float32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, the packed weight has K={k}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device}, the packed weight on {w.device}")


def dequantize(w: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """Packed uint8 ``[N, row_bytes]`` -> float32 ``[N, K]`` (``gguf.quants.dequantize``'s arithmetic)."""
    _check_weight(w, qtype, k)
    blocks = w.reshape(w.shape[0], k // 32, BLOCK_BYTES[qtype])
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    if qtype == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(-1, k)
    qs = blocks[..., 4:] if qtype == "Q4_1" else blocks[..., 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
    if qtype == "Q4_0":
        return (d * (q - 8)).reshape(-1, k)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(-1, k)


def quantize_act_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (int8 ``q [M, K]``, float32 ``d [M, K/32]``): per 32-block ``d = amax / 127``,
    ``q = round-half-even(x * (1 / d))`` (0 where the block is all zero) -- the C kernel's exact steps."""
    b = x.reshape(x.shape[0], -1, 32)
    d = b.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(b * inv[..., None]).clamp(-127, 127)
    return q.to(torch.int8).reshape(x.shape), d


def _unpack(w: torch.Tensor, qtype: str, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Packed weight -> (integer quants as float64 ``[K/32, 32, N]``, float32 ``d [K/32, N]``, Q4_1's
    float32 ``m [K/32, N]`` or None); Q4_0's quants are ``q - 8``, Q4_1's the bare nibbles."""
    blocks = w.reshape(w.shape[0], k // 32, BLOCK_BYTES[qtype])
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float().T
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float().T if qtype == "Q4_1" else None
    if qtype == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).double()
    else:
        qs = blocks[..., 4:] if qtype == "Q4_1" else blocks[..., 2:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).double() - (8 if qtype == "Q4_0" else 0)
    return q.permute(1, 2, 0), d, m


_Q8_CHUNK = 1 << 22  # activation rows x weight rows of float32 terms held at once by the q8 reference


def _q8_reference(x: torch.Tensor, w: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """The C kernels' q8 arithmetic step for step (ggml_q8.c, top): per block the exact integer dot
    product, the float32 term ``dot * (d_w * d_x)`` (Q4_1: ``+ m_w * (d_x * sum(q_x))``), added
    into a float32 accumulator in block order."""
    qx, dx = quantize_act_q8(x)
    qw, dw, mw = _unpack(w, qtype, k)
    mrows, n, nb = x.shape[0], w.shape[0], k // 32
    out = torch.empty(mrows, n, dtype=torch.float32, device=x.device)
    step = max(1, _Q8_CHUNK // max(1, n))
    for r0 in range(0, mrows, step):
        qb = qx[r0:r0 + step].double().reshape(-1, nb, 32).transpose(0, 1)  # [nb, m, 32]
        dots = torch.bmm(qb, qw).float()  # integers < 2^24: exact in float64 and in float32
        dxb = dx[r0:r0 + step].T  # [nb, m] float32
        mdx = dxb * qb.sum(-1).float()  # d_x * sum(q_x), one float32 rounding
        acc = torch.zeros(dxb.shape[1], n, dtype=torch.float32, device=x.device)
        for b in range(nb):
            t = dots[b] * (dw[b][None, :] * dxb[b][:, None])
            if mw is not None:
                t = t + mw[b][None, :] * mdx[b][:, None]
            acc = acc + t
        out[r0:r0 + step] = acc
    return out


def ggml_matmul_reference(x: torch.Tensor, w: torch.Tensor, qtype: str, k: int, *, act: str = "f32") -> torch.Tensor:
    """``x @ dequant(w).T``; with ``act="q8"`` the activations go through ``quantize_act_q8`` and the
    product is the C kernels' float32 block sum in block order (``_q8_reference``)."""
    _check_matmul(x, w, qtype, k, act)
    if act == "q8" and x.shape[0]:
        return _q8_reference(x, w, qtype, k)
    return x @ dequantize(w, qtype, k).T


def ggml_matmul(x: torch.Tensor, w: torch.Tensor, qtype: str, k: int, *, act: str = "f32") -> torch.Tensor:
    """``x [M, K]`` float32 @ ``dequant(w [N, row_bytes]).T`` -> ``[M, N]`` float32, in the C kernel
    when it is built (else the reference)."""
    lib = native_library()
    bb = BLOCK_BYTES.get(qtype, 0)
    # the decode hot path: a few attribute reads, then the call (about 200 of these a token)
    if not (lib is not None and bb and x.dtype == torch.float32 and w.dtype == torch.uint8 and x.dim() == 2
            and w.dim() == 2 and x.is_cpu and w.is_cpu and k > 0 and k % 32 == 0 and x.shape[1] == k
            and w.shape[1] == k // 32 * bb and act in ACT_MODES):
        _check_matmul(x, w, qtype, k, act)
        if lib is None or not x.is_cpu:
            return ggml_matmul_reference(x, w, qtype, k, act=act)
    m, n = x.shape[0], w.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    if m == 0 or n == 0:
        return out
    if not x.is_contiguous():
        x = x.contiguous()
    if not w.is_contiguous():
        w = w.contiguous()
    if act == "f32":
        fn = lib.ggml_matmul_f32
    elif m < AMX_MIN_ROWS:  # (same bits on either path)
        fn = lib.ggml_matmul_q8
    else:
        choice = _q8_choice
        fn = choice[1] if choice is not None and choice[0] is lib else _choose_q8(lib)[1]
    rc = fn(x.data_ptr(), w.data_ptr(), m, n, k, _QTYPE_ID[qtype], out.data_ptr())
    if rc:
        check_status(rc, f"ggml_matmul_{act}")
    return out


def ggml_dequantize_rows_reference(w: torch.Tensor, qtype: str, k: int, rows: torch.Tensor) -> torch.Tensor:
    _check_rows(w, qtype, k, rows)
    return dequantize(w.index_select(0, rows.long()), qtype, k)


def _check_rows(w: torch.Tensor, qtype: str, k: int, rows: torch.Tensor) -> None:
    _check_weight(w, qtype, k)
    if rows.dim() != 1 or rows.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"rows must be a 1-D int64/int32 tensor, got {rows.dtype} of shape {tuple(rows.shape)}")
    if rows.numel():
        lo, hi = int(rows.min()), int(rows.max())
        if lo < 0 or hi >= w.shape[0]:
            raise ValueError(f"row {lo if lo < 0 else hi} is outside the packed weight's {w.shape[0]} rows")


def ggml_dequantize_rows(w: torch.Tensor, qtype: str, k: int, rows: torch.Tensor) -> torch.Tensor:
    """``[len(rows), K]`` float32: the dequantized rows ``rows`` of ``w`` (an embedding lookup)."""
    _check_rows(w, qtype, k, rows)
    lib = native_library()
    if lib is None or w.device.type != "cpu" or rows.device.type != "cpu":
        return ggml_dequantize_rows_reference(w, qtype, k, rows)
    idx = rows.to(torch.int64).contiguous()
    out = torch.empty(idx.numel(), k, dtype=torch.float32)
    if idx.numel():
        w = w.contiguous()
        lib.ggml_dequant_rows(w.data_ptr(), k, _QTYPE_ID[qtype], idx.data_ptr(), idx.numel(), out.data_ptr())
    return out


_AMX_REASONS = {
    1: "the CPU does not report AMX-TILE and AMX-INT8",
    2: "the OS has not enabled the AMX tile state (XCR0)",
    3: "arch_prctl(ARCH_REQ_XCOMP_PERM) refused the tile data permission",
}

_PROBE = "from tokenfab.kernels.cpu import native_library; import sys; sys.exit(native_library().ggml_amx_probe())"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())


@functools.lru_cache(maxsize=1)
def amx_status() -> tuple[bool, str]:
    """(usable, why): the probe runs in a child process, so a VM that reports AMX and then faults
    on the first tile instruction kills the child, not us."""
    if "amx_int8" not in _cpu_flags():
        return False, _AMX_REASONS[1] + " (/proc/cpuinfo)"
    root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"the AMX probe could not run: {e}"
    if proc.returncode < 0:
        return False, f"the probe faulted (signal {-proc.returncode}) on a tile instruction (the CPU reports AMX)"
    if proc.returncode:
        return False, _AMX_REASONS.get(proc.returncode, f"the AMX probe failed (exit {proc.returncode})")
    return True, "AMX tiles work"


# ---------------------------------------------------------------- the q8 path: AMX or VNNI
_q8_choice: tuple | None = None  # (library, kernel, path, reason), chosen on the first q8 matmul
# fewer activation rows than one 16-row tile stay on the VNNI path: a tile would be mostly padding
# (a decode step's M = 1 uses 1/16 of it). Unmeasured: no AMX machine was at hand; tune there.
AMX_MIN_ROWS = 16
_SELF_TEST_SHAPES = ((1, 20, 96), (17, 33, 64), (3, 16, 320))  # (M, N, K): partial tiles, K % 64 != 0


def _int8_path(lib: ctypes.CDLL) -> str:
    """The name of the non-AMX q8 path this build runs (ggml_q8.c)."""
    bits = int(lib.ggml_isa())
    return "vnni" if bits & 4 else ("avx2" if bits & 3 else "scalar")


def random_q8_case(m: int, n: int, k: int, qtype: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [M, K], packed weight [N, row_bytes]) with realistic scales, an all-zero activation block
    and extreme quants: the self-test's (and the tests') inputs."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (n, k // 32, BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=g)
    w[..., 0:2] = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-4).half().view(torch.uint8)
    if qtype == "Q4_1":
        w[..., 2:4] = (-torch.rand(n, k // 32, 1, generator=g) * 0.05).half().view(torch.uint8)
    if qtype == "Q8_0":
        w[0, 0, 2:] = 128  # int8 -128 everywhere in one block
    x = torch.randn(m, k, generator=g) * 3
    x[0, :32] = 0  # a block of zeros: d = 0
    return x, w.reshape(n, -1)


def amx_self_test(lib: ctypes.CDLL) -> str | None:
    """None when the AMX kernel equals the VNNI path bit for bit on small known cases (every
    format, partial tiles, K not a multiple of the 64-byte tile depth), else what differed."""
    for i, qtype in enumerate(BLOCK_BYTES):
        for j, (m, n, k) in enumerate(_SELF_TEST_SHAPES):
            x, w = random_q8_case(m, n, k, qtype, 100 * i + j)
            want, got = torch.empty(m, n), torch.full((m, n), float("nan"))
            args = (x.data_ptr(), w.data_ptr(), m, n, k, _QTYPE_ID[qtype])
            if lib.ggml_matmul_q8(*args, want.data_ptr()) or lib.ggml_matmul_q8_amx(*args, got.data_ptr()):
                return f"{qtype} M={m} N={n} K={k}: a kernel returned an error"
            if not torch.equal(want.view(torch.int32), got.view(torch.int32)):
                bad = int((want.view(torch.int32) != got.view(torch.int32)).sum())
                return f"{qtype} M={m} N={n} K={k}: {bad} of {m * n} results differ from the VNNI path"
    return None


def select_q8_path(lib: ctypes.CDLL) -> tuple[str, str]:
    """(path, why) for ``act="q8"``: "amx" only when every condition of the module docstring holds
    ("amx-emulated" for a test build whose tile instructions are C, ``-DTF_AMX_EMULATE``)."""
    base = _int8_path(lib)
    built = int(lib.ggml_amx_built())
    if not built:
        return base, "this build has no AMX kernel (needs GCC >= 11 on x86-64)"
    if os.environ.get("TOKENFAB_AMX", "1").lower() in ("0", "false", "no"):
        return base, "AMX turned off (TOKENFAB_AMX=0)"
    usable, why = amx_status()
    if not usable:
        return base, why
    rc = int(lib.ggml_amx_enable())
    if rc:
        return base, _AMX_REASONS.get(rc, f"enabling AMX failed ({rc})") + " in this process"
    failed = amx_self_test(lib)
    if failed is not None:
        return base, f"the AMX self-test failed ({failed})"
    return "amx" if built == 1 else "amx-emulated", "AMX tiles work and the self-test equals the VNNI path bit for bit"


def _choose_q8(lib: ctypes.CDLL) -> tuple:
    global _q8_choice
    path, why = select_q8_path(lib)
    if path == "amx":
        log.info("int8-activation matmuls run on AMX tiles")
    elif int(lib.ggml_amx_built()) and "amx_int8" in _cpu_flags():
        log.warning("int8-activation matmuls do not use AMX: %s; the %s path runs", why, path)
    fn = lib.ggml_matmul_q8_amx if path.startswith("amx") else lib.ggml_matmul_q8
    _q8_choice = (lib, fn, path, why)
    return _q8_choice


def q8_path() -> tuple[str, str]:
    """(path, why) of ``act="q8"`` in this process: "amx", "vnni", "avx2", "scalar" (or "amx-emulated"
    in a test build), or "torch reference" (no native library); chosen once (``reset_q8_path``
    chooses again)."""
    lib = native_library()
    if lib is None:
        return "torch reference", "no native library"
    choice = _q8_choice if _q8_choice is not None and _q8_choice[0] is lib else _choose_q8(lib)
    return choice[2], choice[3]


def reset_q8_path() -> None:
    global _q8_choice
    _q8_choice = None


def ggml_kernel_info() -> dict:
    """Which code path runs: the ISA the library was built for, VNNI, AMX (usable or why not), the
    q8 path (amx or not, and why), threads."""
    lib = native_library()
    amx, why = amx_status() if lib is not None else (False, "no native library")
    path, path_why = q8_path()
    if lib is None:
        return {"native": False, "isa": "torch reference", "vnni": False, "f16c": False, "amx": False,
                "amx_reason": why, "q8_path": path, "q8_reason": path_why, "threads": torch.get_num_threads()}
    bits = int(lib.ggml_isa())
    isa = "avx512" if bits & 1 else ("avx2" if bits & 2 else "scalar")
    return {"native": True, "isa": isa, "vnni": bool(bits & 4), "f16c": bool(bits & 8), "amx": amx, "amx_reason": why,
            "q8_path": path, "q8_reason": path_why, "threads": torch.get_num_threads(),
            # f32 products of at least this many rows take the panel kernel (kernels/cpu/crossover.py)
            "f32_panel_min_rows": int(lib.ggml_panel_min_rows()),
            # q8 products of at least this many rows take the many-row tiles (0: not in this build)
            "q8_tile_min_rows": int(lib.ggml_q8_tile_min_rows())}
