"""`tokenfab` command line: each subcommand lives in its own module with
``add_arguments(parser)`` and ``run(args) -> int``, imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "serve": ("tokenfab.server.cli", "OpenAI-compatible HTTP server"),
    "run-batch": ("tokenfab.server.batch.cli", "run an OpenAI batch input file (JSONL) offline"),
    "generate": ("tokenfab.cli.generate", "generate completions for prompts"),
    "chat": ("tokenfab.cli.chat", "interactive chat in the terminal"),
    "finetune": ("tokenfab.train.cli", "LoRA or full fine-tuning on JSONL chat records"),
    "plan": ("tokenfab.planner.cli", "capacity planning on paper: TP/EP/DP layouts, memory, throughput"),
}
BENCH_COMMANDS = {
    "throughput": ("tokenfab.bench.throughput", "offline throughput vs transformers"),
    "serve": ("tokenfab.bench.serve", "load generator against an OpenAI-compatible server"),
    "kernels": ("tokenfab.bench.kernels", "kernel microbenchmarks"),
    "engine": ("tokenfab.bench.engine", "end-to-end engine speed on a random model of a real shape"),
    "prefix": ("tokenfab.bench.prefix", "prefix caching and chunked prefill workloads"),
    "fleet": ("tokenfab.bench.fleet", "N tokenfab serve behind vllm-router/sglang-router: prefix hit rate, TTFT"),
    "chaos": ("tokenfab.bench.chaos", "N tokenfab serve behind vllm-router, SIGKILLs under load: nothing lost, RSS"),
    "finetune": ("tokenfab.bench.finetune", "LoRA training tokens/s vs transformers + peft"),
    "flce-memory": ("tokenfab.bench.flce_memory", "peak memory of the loss step with vs without fused linear CE"),
    "ggml": ("tokenfab.bench.ggml", "packed GGUF matmul kernels (CPU) vs float32 torch, weight GB/s"),
    "train-kernels": ("tokenfab.bench.train_kernels", "RMSNorm/RoPE/SiLU training kernels fwd+bwd vs HF ops"),
    "spec": ("tokenfab.bench.spec", "speculative decoding on vs off: tokens/s, acceptance (bundled model)"),
    "overlap": ("tokenfab.bench.overlap", "device time between decode steps with vs without --async-scheduling"),
    "comm": ("tokenfab.bench.comm", "TP bytes/token on gloo ranks vs tokenfab plan; 1 vs N ranks"),
    "cpu": ("tokenfab.bench.cpu", "bundled GGUF vs llama.cpp's llama-bench/batched-bench, transformers, roofline"),
    "lora": ("tokenfab.bench.lora", "16 streams over 8 LoRA adapters vs the base; online TTFT with a batch running"),
    "kv-tier": ("tokenfab.bench.kv_tier", "second-turn TTFT with the KV tier (host memory, disk) vs recompute"),
    "pd": ("tokenfab.bench.pd", "prefill/decode disaggregation vs one instance: decode ITL p99 under a prompt flood"),
}


def _add(sub, name: str, module: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text)
    p.set_defaults(_module=module)
    try:
        importlib.import_module(module).add_arguments(p)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        p.set_defaults(_missing=True)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenfab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    # Import only the chosen command's module: argument parsing stays fast.
    wanted = argv[0] if argv else None
    for name, (module, help_text) in COMMANDS.items():
        if wanted in (None, name, "-h", "--help"):
            _add(sub, name, module, help_text)
        else:
            sub.add_parser(name, help=help_text)
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    if wanted == "bench":
        for name, (module, help_text) in BENCH_COMMANDS.items():
            if len(argv) < 2 or argv[1] in (name, "-h", "--help"):
                _add(bsub, name, module, help_text)
            else:
                bsub.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    if getattr(args, "_missing", False):
        print(f"tokenfab: '{args.command}' is not available in this build", file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)
