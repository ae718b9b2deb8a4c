"""What `tokenfab bench kernels` reports beside its rows: the ceilings measured in the same run (copy
bandwidth, matrix rate), the machine, the compiled kernels' resources, and the Markdown table."""

from __future__ import annotations

import datetime
import platform
import subprocess
from pathlib import Path

H200_PEAK_GBPS = 4800.0  # datasheet HBM3e bandwidth
H200_COPY_GBPS = 4000.0  # achievable copy bandwidth (used when not measured)
H200_BF16_TFLOPS = 790.0  # dense bf16 matrix rate measured on random data (used when not measured)


def ceilings(cuda: bool, bench, rep_ms: float) -> dict:
    import torch

    if not cuda:  # the same ceilings on the CPU, in float32 (the dtype the CPU rows run in)
        n = 1 << 24  # 64 MiB each way: past the caches
        src = torch.empty(n, dtype=torch.float32).uniform_()
        dst = torch.empty_like(src)
        t = bench(lambda: dst.copy_(src), rep_ms)
        m = 1024
        a, b = torch.randn(m, m), torch.randn(m, m)
        tm = bench(lambda: a @ b, rep_ms)
        return dict(copy_GBps=round(2 * n * 4 / (t * 1e-3) / 1e9, 1),
                    matmul_TFLOPs=round(2 * m**3 / (tm * 1e-3) / 1e12, 3),
                    note="CPU (float32 matmul): our kernels run in Triton's interpreter, so their fractions "
                         "mean nothing; the peers' do")
    n = 1 << 30  # 1 GiB each way
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src), rep_ms)
    copy = 2 * n / (t * 1e-3) / 1e9
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    tm = bench(lambda: a @ b, rep_ms)
    mm = 2 * m**3 / (tm * 1e-3) / 1e12
    return dict(copy_GBps=round(copy, 1), matmul_TFLOPs=round(mm, 1))


def machine_info(cuda: bool) -> dict:
    import torch
    import triton

    info = dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
                host=platform.node(), date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    if cuda:
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, sms=p.multi_processor_count, memory_GiB=round(p.total_memory / 2**30, 1))
    else:
        info.update(device=f"CPU ({platform.processor() or platform.machine()}), Triton interpreter")
    try:
        root = Path(__file__).resolve().parents[2]
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                        text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def compiled_kernels() -> list[dict]:
    """Registers / spills / shared memory of every kernel compiled in this process (best effort:
    the JIT cache's layout differs between triton versions)."""
    from tokenfab.kernels import activation, attention_decode, attention_prefill, kv_cache, norm, paged, rope, sampling

    out = []
    for mod in (activation, attention_decode, attention_prefill, paged, kv_cache, norm, rope, sampling):
        for name, fn in vars(mod).items():
            caches = getattr(fn, "device_caches", None)
            if not name.endswith("_kernel") or not caches:
                continue
            try:
                for entry in caches.values():
                    for ck in entry[0].values():
                        md = ck.metadata
                        out.append(dict(kernel=name, registers=getattr(ck, "n_regs", None),
                                        spills=getattr(ck, "n_spills", None), shared=getattr(md, "shared", None),
                                        num_warps=getattr(md, "num_warps", None),
                                        num_stages=getattr(md, "num_stages", None)))
            except Exception as exc:
                out.append(dict(kernel=name, error=str(exc)[:200]))
    return out


def markdown(report: dict) -> str:
    m, c = report["machine"], report["ceilings"]
    lines = [
        f"Kernel microbenchmarks on {m.get('device')} (torch {m['torch']}, triton {m['triton']}, "
        f"commit {m.get('commit')}, {m['date']}), dtype {report['dtype']}, sizes {report['size']}.",
        "",
    ]
    on_cpu = bool(c.get("note"))
    if c.get("copy_GBps"):
        lines += [f"Roofline, measured in this run: copy {c['copy_GBps']:.1f} GB/s (bytes read + written"
                  + ("" if on_cpu else f"; datasheet peak {H200_PEAK_GBPS:.0f}") + f"), "
                  f"{'float32' if on_cpu else 'bf16'} matmul {c['matmul_TFLOPs']:.3g} TFLOP/s. Memory-bound rows: "
                  "the fewest bytes the op must move / time, over the copy rate; FLOP rows: over the matmul rate. "
                  "The peer is the fastest plain-PyTorch version tried (all of them in the JSON).", ""]
        if on_cpu:
            lines += [f"{c['note']}.", ""]
    lines += [
        "| op | shape | time (us) | achieved | of roofline | of H200 peak | best plain-PyTorch peer | peer (us) "
        "| peer of roofline | speedup | max err |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"| {r['op']} | | | error: {r['error']} | | | | | | | |")
            continue
        peak = H200_PEAK_GBPS if r["metric"] == "GB/s" else H200_BF16_TFLOPS
        frac = f"{100 * r['fraction_of_ceiling']:.0f}%" if r["fraction_of_ceiling"] else "-"
        pfrac = r.get("peer_fraction_of_ceiling")
        pfrac = f"{100 * pfrac:.0f}%" if pfrac else "-"
        pt = f"{r['peer_time_us']:.1f}" if r["peer_time_us"] else "-"
        sp = f"{r['speedup_vs_peer']:.2f}x" if r["speedup_vs_peer"] else "-"
        e = f"{r['max_abs_err']:.2g}" if r["max_abs_err"] is not None else "-"
        hpeak = "-" if on_cpu else f"{100 * r['value'] / peak:.0f}%"
        lines.append(
            f"| {r['op']} | {r['shape']} | {r['time_us']:.1f} | {r['value']:.3g} {r['metric']} | {frac} "
            f"| {hpeak} | {r['peer']} | {pt} | {pfrac} | {sp} | {e} |"
        )
    if report.get("sweep"):
        lines += ["", "Launch-configuration sweep (overrides of the dispatcher's pick):", "",
                  "| op | overrides | time (us) | vs default |", "| --- | --- | --- | --- |"]
        for e in report["sweep"]:
            if "error" in e:
                lines.append(f"| {e['op']} | {e['config']} | error: {e['error']} | |")
            else:
                lines.append(f"| {e['op']} | {e['config']} | {e['time_us']:.1f} | {e['speedup_vs_default']:.2f}x |")
    compiled = [c for c in report.get("compiled", []) if "error" not in c]
    if compiled:
        lines += ["", "Kernels compiled in this run:", "",
                  "| kernel | warps | stages | registers | spills | shared (B) |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for c in compiled:
            lines.append(f"| `{c['kernel']}` | {c['num_warps']} | {c['num_stages']} | {c['registers']} "
                         f"| {c['spills']} | {c['shared']} |")
    return "\n".join(lines) + "\n"
