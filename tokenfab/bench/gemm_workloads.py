"""``tokenfab bench kernels`` rows for the low-precision GEMMs (issue 13): our FP8 W8A8 GEMM (activation
quant + block-scaled GEMM, as the FP8 layers run it) against torch's bf16 ``F.linear`` (cuBLAS) at
1 / 16 / 256 / 4096 tokens, at Llama-3.1-8B's MLP down projection (4096 x 14336) and a DeepSeek-V3
expert's gate+up (4096 x 7168). ``speedup_vs_peer`` is FP8 over bf16; the roofline fraction is
against the measured bf16 matmul peak (FP8's tensor-core peak is twice that on Hopper).

On CPU (``--size tiny``) the same rows run at tiny shapes in Triton's interpreter: they check that
the rows work and agree with bf16, and measure nothing about the GPU.
"""

from __future__ import annotations

from collections.abc import Callable

TOKENS = (1, 16, 256, 4096)
SHAPES = {"llama8b_down": (4096, 14336), "deepseek_expert_gate_up": (4096, 7168)}  # (N, K)


def gemm_workloads(tiny: bool, dev, dtype, rnd: Callable, err: Callable) -> dict[str, Callable[[], tuple]]:
    """name -> make() returning (op, shape, FLOPs, our fn, [(peer name, peer fn)], max abs error)."""
    import torch.nn.functional as F

    from tokenfab.kernels import quant
    from tokenfab.quant.fp8_block import quantize_weight

    def make_fp8(label: str, n: int, k: int, m: int):
        def make():
            nn_, kk, mm = (256, 384, min(m, 16)) if tiny else (n, k, m)
            x = rnd(mm, kk)
            w = rnd(nn_, kk, scale=kk**-0.5)
            q, s = quantize_weight(w, "block")
            q, s = q.to(dev), s.to(dev)

            def fn():
                a, a_s = quant._per_token_group_quant_triton(x, 128, False)
                return quant._w8a8_scaled_mm_triton(a, a_s, q, s, 128, x.dtype)

            peer = lambda: F.linear(x, w)
            e = err(fn(), peer()) / max(float(peer().abs().max()), 1e-6)  # relative to the output's scale
            return (f"gemm fp8 M={mm}", f"{label} N={nn_} K={kk} (W8A8 block)", 2.0 * mm * nn_ * kk, fn,
                    [(f"torch {str(dtype).removeprefix('torch.')} F.linear", peer)], e)

        return make

    rows: dict[str, Callable[[], tuple]] = {}
    for label, (n, k) in SHAPES.items():
        for m in TOKENS if not tiny else (1, 16):
            rows[f"gemm_fp8_{label}_{m}"] = make_fp8(label, n, k, m)
    from tokenfab.bench.gemm_w4_workloads import w4a16_workloads

    rows.update(w4a16_workloads(tiny, dev, dtype, rnd, err))  # W4A16 rows (bench/gemm_w4_workloads.py)
    return rows
