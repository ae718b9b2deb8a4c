"""What batch invariance costs on CPU (issue 15): thread CPU time of the native paged attention for
decode rows and for 5-row verifies (decode-structured), and of float32 linears through MKL's packed
GEMM vs the row-invariant kernel, at the bundled model's shapes.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/batch_invariance_cost.py [--json out.json]

CPU time of this thread (one OpenMP thread runs on it) is used, not wall time: on a shared 2-core
machine wall time mostly measures the neighbours. To compare with an older tree, run the same
script with that tree first on PYTHONPATH (and another TOKENFAB_CACHE_DIR).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _cpu_us(fn, reps: int) -> float:
    """Best of 5 rounds of ``reps`` calls, thread CPU microseconds a call."""
    fn()
    best = float("inf")
    for _ in range(5):
        t = time.thread_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.thread_time() - t) / reps)
    return round(best * 1e6, 1)


def attention_costs() -> dict[str, float]:
    from tokenfab.kernels import attention

    hq, hkv, d, bs = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(0)
    out = {}

    def case(q_lens, ctx_lens, reps):
        nblk = [(c + bs - 1) // bs for c in ctx_lens]
        kc = torch.randn(sum(nblk) + 1, bs, hkv, d, generator=gen)
        vc = torch.randn(sum(nblk) + 1, bs, hkv, d, generator=gen)
        bt = torch.zeros(len(ctx_lens), max(nblk), dtype=torch.int32)
        i = 0
        for s, n in enumerate(nblk):
            bt[s, :n] = torch.arange(i, i + n)
            i += n
        q = torch.randn(sum(q_lens), hq, d, generator=gen)
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(q_lens).cumsum(0)
        ctx = torch.tensor(ctx_lens, dtype=torch.int32)
        def call():
            return attention.paged_attention_native(q, kc, vc, bt, cu, ctx, max(q_lens), max(ctx_lens), d**-0.5)

        return _cpu_us(call, reps)

    for b, n in ((1, 512), (1, 2048), (16, 512)):
        out[f"attention decode B={b} ctx={n} us"] = case([1] * b, [n] * b, 100 if b == 1 else 20)
        out[f"attention verify 5 rows B={b} ctx={n} us"] = case([5] * b, [n] * b, 50 if b == 1 else 10)
    return out


def linear_costs() -> dict[str, float]:
    from tokenfab.layers.linear import batch_invariant_mode, linear, pack_weight

    gen = torch.Generator().manual_seed(0)
    out = {}
    for k, n, name in ((576, 960, "qkv"), (576, 3072, "gate_up"), (1536, 576, "down"), (576, 49152, "lm_head")):
        w = torch.randn(n, k, generator=gen) * 0.05
        packed = pack_weight(w)
        for m in (1, 5, 16, 64):
            x = torch.randn(m, k, generator=gen)
            reps = max(2, int(2e7 / (n * k * max(m, 4) ** 0.5)))
            def call(x=x, w=w, packed=packed):
                return linear(x, w, None, packed)

            out[f"linear {name} M={m} mkl us"] = _cpu_us(call, reps)
            with batch_invariant_mode(True):
                out[f"linear {name} M={m} rowinv us"] = _cpu_us(call, reps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    figures = {"threads": torch.get_num_threads(), **attention_costs(), **linear_costs()}
    for key, value in figures.items():
        print(f"{key:45s} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
