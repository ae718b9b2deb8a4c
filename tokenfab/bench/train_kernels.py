"""Training kernels (RMSNorm + residual, RoPE, SiLU-and-mul): forward + backward time, bandwidth and
what the backward keeps, ours vs the Hugging Face modules' operations under autograd.

For each op one forward and one backward (upstream gradients given) per repetition; the median of
``--repeats`` after ``--warmup`` runs. "ours" is ``kernels/*_train.py`` as dispatched (Triton on
CUDA; the torch twins on CPU unless ``TOKENFAB_KERNELS`` says otherwise); "hf" is the ``*_ref``
function, HF's operations (``LlamaRMSNorm``, ``apply_rotary_pos_emb``, ``act_fn(gate) * up``).
GB/s counts the bytes the op must move at least (each input and output once in the forward, the
saved inputs, upstream gradients and input gradients once in the backward) and is set against a
device copy measured in the same run (fraction of the copy bandwidth, ARCHITECTURE.md rule 6).
"saved MiB" is what autograd keeps for the backward (saved-tensor hooks): the memory saving.

    tokenfab bench train-kernels [--tokens 8192 --hidden 4096 --intermediate 14336 --heads 32/8 --head-dim 128]
        [--dtype bfloat16] [--json out.json --markdown out.md]

Defaults: Llama-3-8B's shapes at 8192 tokens, bf16, on CUDA when present; on CPU a small shape
(the bundled model's: 576 / 1536, 9/3 heads of 64, 2048 tokens, fp32).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tokenfab.bench.common import git_commit, git_dirty, load_average, machine, markdown_table, script_main, write_json

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, help="tokens (rows) per call; default 8192 on CUDA, 2048 on CPU")
    p.add_argument("--hidden", type=int, help="RMSNorm width; default 4096 (CUDA) / 576 (CPU)")
    p.add_argument("--intermediate", type=int, help="MLP width; default 14336 (CUDA) / 1536 (CPU)")
    p.add_argument("--heads", help="query/kv heads, e.g. 32/8; default 32/8 (CUDA) / 9/3 (CPU)")
    p.add_argument("--head-dim", type=int, help="default 128 (CUDA) / 64 (CPU)")
    p.add_argument("--dtype", choices=list(DTYPES), help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default cuda when present")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--markdown", help="write the table here")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _copy_gbps(device: torch.device, repeats: int) -> float:
    n = (256 if device.type == "cuda" else 32) * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), device, repeats, 2)
    return 2 * n / ms / 1e6


def _saved_mib(fn: Callable[[], Any]) -> float:
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0] / 2**20


def _cases(t: int, h: int, inter: int, hq: int, hk: int, d: int, dtype: torch.dtype, device: torch.device):
    """(name, ours, ref, make_inputs, bytes moved) per op; make_inputs -> (args, upstream grads)."""
    from tokenfab.kernels.activation_train import silu_and_mul_train, silu_and_mul_train_ref
    from tokenfab.kernels.norm_train import rms_norm_train, rms_norm_train_ref
    from tokenfab.kernels.rope_train import rope_train, rope_train_ref

    e = torch.tensor([], dtype=dtype).element_size()

    def leaf(*shape):
        return torch.randn(*shape, dtype=dtype, device=device).requires_grad_()

    def norm_inputs():
        x, r, w = leaf(t, h), leaf(t, h), leaf(h)
        return (x, w, 1e-6, r), [torch.randn(t, h, dtype=dtype, device=device) for _ in range(2)]

    def rope_inputs():
        q = torch.randn(1, t, hq, d, dtype=dtype, device=device).transpose(1, 2).requires_grad_()
        k = torch.randn(1, t, hk, d, dtype=dtype, device=device).transpose(1, 2).requires_grad_()
        f = torch.randn(1, t, d // 2, device=device)
        emb = torch.cat((f, f), -1)
        return (q, k, emb.cos().to(dtype), emb.sin().to(dtype)), [torch.randn_like(q), torch.randn_like(k)]

    def act_inputs():
        return (leaf(t, inter), leaf(t, inter)), [torch.randn(t, inter, dtype=dtype, device=device)]

    qk = t * (hq + hk) * d * e
    return [
        (f"rms_norm+residual [{t}, {h}]", rms_norm_train, rms_norm_train_ref, norm_inputs, 9 * t * h * e),
        (f"rope {hq}/{hk} heads d{d} x {t}", rope_train, rope_train_ref, rope_inputs, 4 * qk + 4 * t * d * e),
        (f"silu_and_mul [{t}, {inter}]", silu_and_mul_train, silu_and_mul_train_ref, act_inputs, 8 * t * inter * e),
    ]


def run(args: argparse.Namespace) -> int:
    cuda = torch.cuda.is_available() if args.device is None else args.device == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    big = device.type == "cuda"
    t = args.tokens or (8192 if big else 2048)
    h = args.hidden or (4096 if big else 576)
    inter = args.intermediate or (14336 if big else 1536)
    hq, hk = (int(x) for x in (args.heads or ("32/8" if big else "9/3")).split("/"))
    d = args.head_dim or (128 if big else 64)
    dtype = DTYPES[args.dtype or ("bfloat16" if big else "float32")]
    copy = _copy_gbps(device, args.repeats)
    rows, records = [], []
    for name, ours, ref, make, nbytes in _cases(t, h, inter, hq, hk, d, dtype, device):
        rec: dict[str, Any] = dict(op=name, bytes=nbytes)
        fargs, grads = make()
        leaves = [a for a in fargs if isinstance(a, torch.Tensor) and a.requires_grad]
        for label, fn in (("ours", ours), ("hf", ref)):
            def step(fn=fn, fargs=fargs, leaves=leaves, grads=grads):
                out = fn(*fargs)
                torch.autograd.grad(list(out) if isinstance(out, tuple) else [out], leaves, grads)

            ms = _time_ms(step, device, args.repeats, args.warmup)
            rec[label] = dict(ms=round(ms, 4), gbps=round(nbytes / ms / 1e6, 1),
                              saved_mib=round(_saved_mib(lambda fn=fn, fargs=fargs: fn(*fargs)), 4))
        records.append(rec)
        rows.append([name, rec["ours"]["ms"], rec["hf"]["ms"], round(rec["hf"]["ms"] / rec["ours"]["ms"], 2),
                     rec["ours"]["gbps"], round(rec["ours"]["gbps"] / copy, 3), rec["ours"]["saved_mib"],
                     rec["hf"]["saved_mib"]])
    table = markdown_table(["op (fwd+bwd)", "ours ms", "hf ms", "speedup", "ours GB/s", "of copy",
                            "ours saved MiB", "hf saved MiB"], rows)
    head = f"{device.type} {str(dtype)[6:]}, copy {copy:.0f} GB/s, load {load_average()}"
    print(head)
    print(table)
    write_json(args.json, dict(machine=machine(), commit=git_commit(), dirty=git_dirty(), load=load_average(),
                               device=device.type, dtype=str(dtype), copy_gbps=round(copy, 1), results=records))
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(head + "\n\n" + table + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    return script_main(__doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
