"""``tokenfab bench kernels`` rows for the W4A16 GEMM (issue 13): ``kernels/w4a16.py`` against torch's
bf16 ``F.linear`` (cuBLAS) on the same (dequantized) weights, at 1 / 16 / 256 / 4096 tokens, at
Llama-3.1-8B's MLP down projection (4096 x 14336) and a DeepSeek-V3 / Kimi-K2 expert's gate+up
(4096 x 7168); INT4 (compressed-tensors) at every size, MXFP4 and NVFP4 at Llama's shape.

Decode rows (1 and 16 tokens, named ``w4a16_*``) are weight streams: their amount is the bytes moved
(packed weights + scales + activations + output) and their roofline the copy bandwidth. Prefill rows
(256 and 4096 tokens, ``gemm_w4a16_*``) count FLOPs against the measured bf16 matrix peak.
``speedup_vs_peer`` is W4A16 over bf16 (the GPU goal: >= 2.5x at <= 16 tokens).

On CPU (``--size tiny``) the same rows run at tiny shapes in Triton's interpreter: they check that the
rows work and agree with bf16, and measure nothing about the GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

TOKENS = (1, 16, 256, 4096)
SHAPES = {"llama8b_down": (4096, 14336), "deepseek_expert_gate_up": (4096, 7168)}  # (N, K)


def _packed(codec: str, n: int, k: int, g: torch.Generator):
    """Random codes with scales that keep the products O(1): (qweight, scales, global scale)."""
    from tokenfab.kernels.w4a16 import GROUP_SIZE

    q = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int64).to(torch.uint8)
    groups = k // GROUP_SIZE[codec]
    if codec == "int4":
        return q, torch.full((n, groups), 0.25 * k**-0.5, dtype=torch.bfloat16), None
    if codec == "mxfp4":
        e = round(torch.log2(torch.tensor(0.3 * k**-0.5)).item())
        return q, torch.full((n, groups), 127 + e, dtype=torch.uint8), None
    s = torch.rand(n, groups, generator=g).add(1.0).to(torch.float8_e4m3fn)
    return q, s, torch.tensor(0.2 * k**-0.5)


def w4a16_workloads(tiny: bool, dev, dtype, rnd: Callable, err: Callable) -> dict[str, Callable[[], tuple]]:
    """name -> make() returning (op, shape, bytes or FLOPs, our fn, [(peer name, peer fn)], relative error)."""
    import torch.nn.functional as F

    from tokenfab.kernels import w4a16

    def make_row(codec: str, label: str, n: int, k: int, m: int):
        def make():
            nn_, kk, mm = (256, 384, min(m, 16)) if tiny else (n, k, m)
            g = torch.Generator().manual_seed(0)
            q, s, gs = _packed(codec, nn_, kk, g)
            w = w4a16.dequantize_w4(q, s, codec, kk)
            if gs is not None:
                w = w * gs
            w = w.to(dtype).to(dev)
            q, s = q.to(dev), s.to(dev)
            gs = gs.to(dev) if gs is not None else None
            x = rnd(mm, kk)
            fn = lambda: w4a16._w4a16_gemm_triton(x, q, s, gs, None, codec, kk)
            peer = lambda: F.linear(x, w)
            e = err(fn(), peer()) / max(float(peer().abs().max()), 1e-6)
            shape = f"{label} N={nn_} K={kk} ({codec})"
            peers = [(f"torch {str(dtype).removeprefix('torch.')} F.linear (dequantized weights)", peer)]
            if m <= 16:  # a weight stream: bytes moved
                amount = q.numel() + s.numel() * s.element_size() + (x.numel() + mm * nn_) * x.element_size()
                return f"w4a16 M={mm}", shape, float(amount), fn, peers, e
            return f"gemm w4a16 M={mm}", shape, 2.0 * mm * nn_ * kk, fn, peers, e

        return make

    rows: dict[str, Callable[[], tuple]] = {}
    for label, (n, k) in SHAPES.items():
        for m in TOKENS if not tiny else (1, 16):
            prefix = "w4a16" if m <= 16 else "gemm_w4a16"
            rows[f"{prefix}_int4_{label}_{m}"] = make_row("int4", label, n, k, m)
    for codec in ("mxfp4", "nvfp4"):
        for m in (1, 4096) if not tiny else (1,):
            prefix = "w4a16" if m <= 16 else "gemm_w4a16"
            rows[f"{prefix}_{codec}_llama8b_down_{m}"] = make_row(codec, "llama8b_down", 4096, 14336, m)
    return rows
