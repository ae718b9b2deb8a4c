"""``tokenfab plan MODEL --gpus 16 --gpu h200 [--interconnect nvlink,ib400] [--context 8192] [--json]``:
capacity planning on paper from a model folder's ``config.json`` alone (see ``tokenfab.planner.plan``)."""

from __future__ import annotations

import argparse
import json
import sys

from tokenfab.planner.hardware import GPUS, PlanInputError, get_gpu, parse_interconnect
from tokenfab.planner.model_spec import build_spec, load_config
from tokenfab.planner.plan import Plan, PlanRequest, plan_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model folder holding config.json (weights not needed), or the config.json file")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs in the cluster")
    p.add_argument("--gpu", default="h200", help=f"GPU type: {', '.join(sorted(GPUS))} (default h200)")
    p.add_argument("--interconnect", default=None,
                   help="intra-node link and inter-node fabric, e.g. 'nvlink,ib400' or 'pcie4,eth100x2' "
                        "(default: what the GPU usually ships with)")
    p.add_argument("--context", type=int, default=8192, help="tokens per sequence (prompt + output)")
    p.add_argument("--dtype", default=None, help="weights/activations dtype (default: the config's)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the dtype) or fp8_e4m3")
    p.add_argument("--quantization", default=None, choices=["fp8", "fp8-block"],
                   help="plan online FP8 of a 16-bit checkpoint (per-channel / 128x128 block scales, as "
                        "`tokenfab serve --quantization`); routed experts stay 16-bit")
    p.add_argument("--max-num-seqs", type=int, default=256, help="decode batch cap per replica")
    p.add_argument("--prefill-tokens", type=int, default=8192, help="tokens per prefill step per replica")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--redundant-experts", type=int, default=0, help="extra physical experts (EPLB)")
    p.add_argument("--gpu-hour-price", type=float, default=None, help="USD per GPU-hour: adds cost per 1M tokens")
    p.add_argument("--top", type=int, default=10, help="layouts to print (the JSON has all)")
    p.add_argument("--json", action="store_true", help="print the whole plan as JSON")


def make_plan(args: argparse.Namespace) -> Plan:
    gpu = get_gpu(args.gpu)
    req = PlanRequest(
        gpus=args.gpus, gpu=gpu, interconnect=parse_interconnect(args.interconnect, gpu), context=args.context,
        dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
        max_num_seqs=args.max_num_seqs, prefill_tokens=args.prefill_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, redundant_experts=args.redundant_experts,
        gpu_hour_price=args.gpu_hour_price,
    )
    return plan_model(build_spec(load_config(args.model)), req)


def _table(plan: Plan, top: int) -> str:
    m, hw = plan.model, plan.hardware
    lines = [
        f"model: {m['architecture']} ({m['attention']}), {m['params'] / 1e9:.2f}B params "
        f"({m['active_params'] / 1e9:.2f}B active), weights {m['weight_gib']:.1f} GiB ({m['quantization']}, "
        f"{m['dtype']}), KV {m['kv_bytes_per_token']:,} B/token",
        f"cluster: {hw['gpus']} x {hw['gpu']}, {hw['interconnect']}; context {hw['context']}",
        "roofline upper bounds (vendor peaks, balanced routing, no overlap); per-rank memory in GiB",
        "",
    ]
    head = (f"{'layout':<16}{'weights':>8}{'act':>6}{'KV':>7}{'seqs':>8}{'decode tok/s':>14}{'per seq':>9}"
            f"{'comm %':>7}{'prefill tok/s':>15}{'$/1M out':>10}")
    lines.append(head)
    for p in plan.layouts[:top]:
        share = 100 * p.decode_comm_ms / p.decode_step_ms if p.decode_step_ms else 0.0
        cost = f"{p.cost_per_1m_output_tokens:.3f}" if p.cost_per_1m_output_tokens is not None else "-"
        lines.append(f"{p.layout:<16}{p.weights_gib:>8.1f}{p.activation_gib:>6.1f}{p.kv_gib:>7.1f}"
                     f"{p.max_concurrent_seqs:>8}{p.decode_tokens_per_s:>14,.0f}{p.decode_tokens_per_s_per_seq:>9.1f}"
                     f"{share:>7.1f}{p.prefill_tokens_per_s:>15,.0f}{cost:>10}")
    if not plan.layouts:
        lines.append("(no layout fits)")
    if plan.excluded:
        lines.append("")
        lines.append(f"excluded ({len(plan.excluded)}):")
        lines += [f"  {p.layout}: {p.reason}" for p in plan.excluded[:top]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        plan = make_plan(args)
    except PlanInputError as e:
        print(f"tokenfab plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else _table(plan, args.top))
    return 0
