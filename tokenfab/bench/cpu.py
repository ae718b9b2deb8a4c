"""`tokenfab bench cpu`: tokenfab against the strongest CPU peers on the same GGUF, in one run.

One process measures, in order: the machine (CPU model, ISA flags from /proc/cpuinfo, load
average), the roofline probes (copy bandwidth, float32/int8 matmul peaks, the GGUF's weight bytes;
``roofline.py``), tokenfab on llama.cpp's workloads through the LLM API (``cpu_workloads.py``: the
native kernels it chose are read back after loading), llama.cpp's own ``llama-bench`` (pp512,
tg128) and ``llama-batched-bench`` (B = 1/4/16/48) with the same thread count
(``llama_cpp_tools.py``; skipped, and said so, when the tools are not built:
``scripts/llama_cpp_server.sh build-tools``), and transformers ``generate`` at its best batch size
on the largest batch's prompts (``throughput.py``'s peer). The report gives every figure, the
ratios tokenfab / peer, and each figure as a fraction of its roofline bound.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from tokenfab.bench import cpu_report, cpu_workloads, llama_cpp_tools, roofline, throughput
from tokenfab.bench.common import git_commit, git_dirty, machine, write_json
from tokenfab.engine.llm import LLM
from tokenfab.kernels.cpu.ggml_matmul import ggml_kernel_info
from tokenfab.loader.bundled import bundled_model_path

try:  # the per-family report (helper H8's tokenfab/kernels/cpu/info.py), where this checkout has it
    from tokenfab.kernels.cpu.info import cpu_kernel_info
except ImportError:
    cpu_kernel_info = None

ISA_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file (default: the bundled GGUF)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads of every engine (default: torch's, passed to llama.cpp as -t)")
    p.add_argument("--prompt-len", type=int, default=512, help="prefill workload (llama-bench -p)")
    p.add_argument("--gen-len", type=int, default=128, help="decode workload (llama-bench -n, batched -ntg)")
    p.add_argument("--batches", default="1,4,16,48", help="batched decode sizes (llama-batched-bench -npl)")
    p.add_argument("--batch-prompt-len", type=int, default=32, help="prompt tokens per sequence (-npp)")
    p.add_argument("--repeats", type=int, default=3, help="runs per tokenfab figure (median) and llama-bench -r")
    p.add_argument("--quantization", default=None, help="tokenfab's GGUF mode (gguf, gguf-q8act; default: gguf)")
    p.add_argument("--hf-batch-sizes", default="48",
                   help="transformers batch sizes on the largest batch's prompts (best kept); empty: no transformers")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp tools")
    p.add_argument("--tiny", action="store_true", help="small roofline probes (tests; the figures mean little)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-raw", default=None, help="a folder for the llama.cpp tools' raw output")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--markdown", default=None, help="write the Markdown report here")


def cpu_flags(path: str = "/proc/cpuinfo") -> dict[str, bool]:
    """{flag: present} for the ISA extensions the kernels (ours and llama.cpp's) choose between."""
    try:
        with open(path) as fh:
            flags = next((ln.split(":", 1)[1].split() for ln in fh if ln.startswith("flags")), [])
    except OSError:
        flags = []
    return {f: f in flags for f in ISA_FLAGS}


def cpu_model_name() -> str | None:
    """``lscpu``'s model name (None where lscpu is absent)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), None)


def isa_tag(flags: dict[str, bool]) -> str:
    """A short name for the result files: amx, avx512_vnni, avx512, avx2 or generic."""
    for tag, flag in (("amx", "amx_int8"), ("avx512_vnni", "avx512_vnni"), ("avx512", "avx512f"), ("avx2", "avx2")):
        if flags.get(flag):
            return tag
    return "generic"


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def kernel_report() -> dict[str, Any]:
    """The native kernels this process runs (after the model is loaded: the library is built then)."""
    return cpu_kernel_info() if cpu_kernel_info is not None else {"ggml": ggml_kernel_info()}


def run_tokenfab(args: argparse.Namespace, model: Path, batches: list[int]) -> tuple[dict[str, Any], LLM]:
    llm = LLM(str(model), quantization=args.quantization, max_num_seqs=max(64, *batches),
              max_num_batched_tokens=max(2048, args.prompt_len, max(batches) * args.batch_prompt_len))
    prompts = cpu_workloads.Prompts(llm.engine.vocab_size, args.seed)
    cpu_workloads.warm_up(llm, prompts, args.prompt_len, max(batches))
    res: dict[str, Any] = {"prefill": cpu_workloads.prefill(llm, prompts, args.prompt_len, args.repeats),
                           "decode": cpu_workloads.decode(llm, prompts, args.gen_len, args.repeats), "batched": []}
    for b in batches:
        row, last = cpu_workloads.batched_decode(llm, prompts, b, args.batch_prompt_len, args.gen_len, args.repeats)
        res["batched"].append(row)
    res["largest_batch_prompts"] = last
    eng = llm.engine
    res["settings"] = {"dtype": str(eng.dtype), "device": str(eng.device), "quantization": args.quantization or "gguf",
                       "max_num_seqs": max(64, *batches), "torch_threads": torch.get_num_threads(),
                       "sampling": "greedy, ignore_eos", "repeats": args.repeats,
                       "vocab_size": eng.vocab_size}
    return res, llm


def run_llama_cpp(args: argparse.Namespace, model: Path, threads: int, batches: list[int]) -> dict[str, Any]:
    """The llama.cpp tools' figures, or ``{"skipped": why}``."""
    if args.no_llama_cpp:
        return {"skipped": "--no-llama-cpp"}
    missing = llama_cpp_tools.missing_tools()
    if missing:
        return {"skipped": f"llama.cpp tools not built ({', '.join(missing)} absent from "
                           f"{llama_cpp_tools.tools_dir()}): run scripts/llama_cpp_server.sh build-tools"}
    settings = llama_cpp_tools.tools_settings()  # first: a broken build fails before the long runs
    bench = llama_cpp_tools.run_llama_bench(model, threads, args.prompt_len, args.gen_len, args.repeats)
    batched = llama_cpp_tools.run_batched_bench(model, threads, batches, args.batch_prompt_len, args.gen_len)
    return {"settings": settings, "llama_bench": bench, "batched_bench": batched, "threads": threads}


def run_transformers(args: argparse.Namespace, model: Path, prompts: list[list[int]], dtype: str,
                     vocab: int) -> dict[str, Any]:
    """transformers generate at each of ``--hf-batch-sizes`` on ``prompts``; the best is kept."""
    sizes = throughput.peer_batch_sizes(args.hf_batch_sizes, len(prompts))
    if not sizes:
        return {"skipped": "--hf-batch-sizes is empty"}
    ns = argparse.Namespace(output_len=args.gen_len, warmup_tokens=4)
    warm = cpu_workloads.Prompts(vocab, args.seed + 1).draw(2, args.batch_prompt_len)
    runs = [throughput.transformers_run(ns, prompts, model, bs, "cpu", dtype, warm) for bs in sizes]
    return {"runs": runs, "best": max(runs, key=lambda r: r["output_tok_s"])}


def ratios(ours: dict[str, Any], llama: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """tokenfab / peer for every workload both ran."""
    out: dict[str, Any] = {}
    if "llama_bench" in llama:
        lb = llama["llama_bench"]["results"]
        for key in ("prefill", "decode"):
            name = ours[key]["workload"]
            if name in lb:
                out[f"{name} vs llama-bench"] = ours[key]["tok_s"] / lb[name]["tok_s"]
        rows = {int(r["B"]): r for r in llama["batched_bench"]["rows"]}
        for row in ours["batched"]:
            if row["batch"] in rows:
                peer = rows[row["batch"]]["S_TG t/s"]
                out[f"B={row['batch']} decode vs llama-batched-bench S_TG"] = row["tok_s"] / peer
    if "best" in hf:
        out[f"B={ours['batched'][-1]['batch']} end-to-end vs transformers ({hf['best']['engine']})"] = (
            ours["batched"][-1]["e2e_output_tok_s"] / hf["best"]["output_tok_s"])
    return out


def bounds(roof: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """The roofline bound of each workload (tokens/s). The compute side is the float32 FMA peak, or
    the int8 matmul peak for a run whose products are int8 (``gguf-q8act``)."""
    w = roof["model"]
    bw, peak = roof["copy"]["gb_s"], roof["fp32_matmul"]["gflop_s"] * 1e9
    if ours.get("settings", {}).get("quantization") == "gguf-q8act" and roof.get("int8_matmul"):
        peak = roof["int8_matmul"]["gop_s"] * 1e9
    out = {ours["prefill"]["workload"]: roofline.prefill_bound(peak, w["parameters"]),
           ours["decode"]["workload"]: roofline.decode_bound(1, bw, w["weight_bytes"], peak, w["parameters"])}
    for row in ours["batched"]:
        out[row["workload"]] = roofline.decode_bound(row["batch"], bw, w["weight_bytes"], peak, w["parameters"])
    if roof.get("int8_matmul"):
        out[f"{ours['prefill']['workload']} (int8 peak)"] = roofline.prefill_bound(
            roof["int8_matmul"]["gop_s"] * 1e9, w["parameters"])
    return out


def run(args: argparse.Namespace) -> int:
    load_before, started = _load(), time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    commit, dirty = git_commit(), git_dirty()
    model = Path(args.model) if args.model else bundled_model_path()
    if model.suffix != ".gguf":
        raise SystemExit("tokenfab bench cpu: --model must be a .gguf file (llama.cpp runs the same file)")
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    flags = cpu_flags()
    roof = roofline.measure(model, tiny=args.tiny)
    ours, llm = run_tokenfab(args, model, batches)
    kernels = kernel_report()
    prompts = ours.pop("largest_batch_prompts")
    dtype = ours["settings"]["dtype"]
    llm.shutdown()
    del llm
    llama = run_llama_cpp(args, model, threads, batches)
    hf = run_transformers(args, model, prompts, dtype, ours["settings"]["vocab_size"])
    report = {
        "benchmark": "cpu", "started": started, "commit": commit, "uncommitted_changes": dirty,
        "machine": {**machine(), "lscpu_model_name": cpu_model_name()}, "isa_flags": flags, "isa_tag": isa_tag(flags),
        "threads": threads, "model": str(model), "kernels": kernels, "roofline": roof,
        "workload": {"prompt_len": args.prompt_len, "gen_len": args.gen_len, "batches": batches,
                     "batch_prompt_len": args.batch_prompt_len, "repeats": args.repeats},
        "tokenfab": ours, "llama_cpp": llama, "transformers": hf,
        "ratios": ratios(ours, llama, hf), "roofline_bounds": bounds(roof, ours),
        "load_average_before": load_before, "load_average_after": _load(),
    }
    text = cpu_report.markdown(report)
    print(text)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text + "\n")
    raws = (("llama_bench.json", llama.get("llama_bench")), ("batched_bench.txt", llama.get("batched_bench")))
    for name, side in raws:
        if side and args.save_raw:
            Path(args.save_raw).mkdir(parents=True, exist_ok=True)
            Path(args.save_raw, name).write_text(side["raw"])
        if side:
            side.pop("raw", None)  # the parsed figures stay; the logs are long
    write_json(args.json, report)
    return 0
