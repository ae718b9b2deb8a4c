"""`tokenfab bench comm`: bytes communicated per token under tensor parallelism, measured on CPU
gloo ranks against ``tokenfab plan``'s figure, and decode throughput with 1 vs N ranks.

Each of N spawned processes (one gloo group on loopback) builds the same engine with its shard of
the weights (SPMD: the same requests, the same scheduler decisions), prefills ``--batch`` requests,
then counts the collectives of one decode-only step (``parallel_state.CommCounter``: kind and
payload) and times ``--steps`` decode steps. Bytes sent per rank are the ring algorithm's: an
all-reduce sends 2 (t-1)/t of its payload, an all-gather (t-1) pieces; divided by the step's tokens
(one per sequence) this is what ``tokenfab plan`` reports as ``decode_comm_bytes_per_token`` for a
replica batch of the same size, float32 activations. Throughput on a shared-core CPU is
informational: gloo over loopback and 2 cores say nothing about NVLink.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

from tokenfab.bench.common import git_commit, load_average, machine, markdown_table, write_json
from tokenfab.bench.gloo_ranks import run_on_ranks


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the bundled model)")
    p.add_argument("--tp", type=int, nargs="+", default=[2], help="tensor parallel sizes to run")
    p.add_argument("--batch", type=int, default=8, help="decoding sequences")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=16, help="timed decode steps")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--ep", action="store_true",
                   help="expert parallel over the ranks (MoE models; normal-mode all-to-all, counted as sent)")
    p.add_argument("--tbo", action="store_true", help="instead: step time with vs without two-batch overlap "
                   "(bench/tbo.py; --model default there: a random small Llama)")
    p.add_argument("--tbo-tokens", type=int, nargs="+", default=[64, 256, 1024], help="--tbo: tokens per step")
    p.add_argument("--tbo-seqs", type=int, default=4, help="--tbo: sequences per step")
    p.add_argument("--json", default=None)


def ring_bytes(calls: list[tuple[str, int]], tp: int) -> float:
    """Bytes one rank sends for ``calls`` ((kind, payload bytes) per collective) with ring algorithms."""
    return sum(2 * (tp - 1) / tp * b if kind == "all_reduce" else b if kind in EP_KINDS else (tp - 1) * b
               for kind, b in calls)


# expert-parallel all-to-alls: CommCounter records the bytes sent to other ranks already
EP_KINDS = ("count_exchange", "dispatch", "dispatch_meta", "combine", "dispatch_ll", "dispatch_ll_meta", "combine_ll")


def decode_run(model: str | None, batch: int, prompt_len: int, steps: int, seed: int = 0) -> dict[str, Any]:
    """In this process (a TP rank, or TP 1): the collectives of one decode-only step and the decode speed."""
    from tokenfab.distributed import parallel_state as ps
    from tokenfab.engine.llm_engine import LLMEngine
    from tokenfab.engine.requests.sampling_params import SamplingParams

    engine = LLMEngine(model=model, seed=seed, max_num_seqs=batch, enable_prefix_caching=False)
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):  # distinct deterministic prompts, the same on every rank
        engine.add_request(f"c{i}", [(17 * i + 31 * j) % (vocab - 10) + 5 for j in range(prompt_len)], params)
    shapes: list[int] = []
    orig = engine.runner.execute

    def spy(b):
        shapes.append(int(b.input_ids.numel()))
        return orig(b)

    engine.runner.execute = spy
    while not shapes or shapes[-1] != batch or len(shapes) < 2:  # until a step decodes every sequence
        engine.step()
    counter = ps.CommCounter()
    ps.set_comm_counter(counter)
    engine.step()
    ps.set_comm_counter(None)
    assert shapes[-1] == batch, "the counted step was not decode-only"
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t0
    engine.runner.execute = orig
    return {"calls": counter.calls, "tokens": batch, "decode_tok_s": steps * batch / elapsed,
            "config": engine.model.config.to_dict()}


def run_tp(tp: int, model: str | None, batch: int, prompt_len: int, steps: int, threads: int = 1,
           ep: bool = False) -> list[dict]:
    """``decode_run`` on ``tp`` spawned gloo ranks; every rank's result. ``ep``: the MoE layers
    expert-parallel over the TP group, normal mode (what plan models)."""
    with tempfile.TemporaryDirectory(prefix="tokenfab-comm-") as out:
        return run_on_ranks(decode_run, (model, batch, prompt_len, steps), tp, out, threads,
                            "normal" if ep else None)


def plan_bytes_per_token(config: dict[str, Any], tp: int, batch: int, ep: bool = False) -> float:
    """``tokenfab plan``'s decode bytes sent per rank per token for TP ``tp`` at this batch (float32)."""
    from tokenfab.planner.hardware import get_gpu, parse_interconnect
    from tokenfab.planner.model_spec import build_spec
    from tokenfab.planner.plan import PlanRequest, plan_model

    gpu = get_gpu("h100")
    spec = build_spec(dict(config, torch_dtype="float32"))
    plan = plan_model(spec, PlanRequest(gpus=tp, gpu=gpu, interconnect=parse_interconnect(None, gpu), context=256,
                                        max_num_seqs=batch, dtype="float32"))
    layout = next(p for p in plan.layouts if p.tp == tp and p.dp == 1 and p.ep == (tp if ep else 1))
    assert layout.decode_batch == batch, (layout.decode_batch, batch)
    return layout.decode_comm_bytes_per_token


def run(args: argparse.Namespace) -> int:
    import torch

    if args.tbo:
        from tokenfab.bench.tbo import run as run_tbo

        return run_tbo(args)

    torch.set_num_threads(args.threads)  # TP 1 gets what one rank gets: 1 vs N ranks of equal threads
    base = decode_run(args.model, args.batch, args.prompt_len, args.steps)  # TP 1, this process
    rows, results = [], []
    for tp in args.tp:
        ranks = run_tp(tp, args.model, args.batch, args.prompt_len, args.steps, args.threads, args.ep)
        calls = ranks[0]["calls"]
        measured = ring_bytes(calls, tp) / ranks[0]["tokens"]
        planned = plan_bytes_per_token(ranks[0]["config"], tp, args.batch, args.ep)
        kinds = {k: sum(1 for c, _ in calls if c == k) for k in ("all_reduce", "all_gather")}
        speed = min(r["decode_tok_s"] for r in ranks)
        results.append({"tp": tp, "ep": args.ep, "batch": args.batch, "collectives": kinds,
                        "measured_bytes_per_token": measured,
                        "plan_bytes_per_token": planned, "decode_tok_s": speed,
                        "decode_tok_s_tp1": base["decode_tok_s"]})
        rows.append([tp, args.batch, f"{kinds['all_reduce']} + {kinds['all_gather']}", f"{measured:,.0f}",
                     f"{planned:,.0f}", f"{measured / planned:.4f}", f"{base['decode_tok_s']:.1f}", f"{speed:.1f}"])
    print(markdown_table(["TP", "batch", "all-reduce + all-gather / step", "measured B/token", "plan B/token",
                          "ratio", "decode tok/s TP1", "decode tok/s TPn"], rows))
    print("(bytes sent per rank per decode token, ring algorithms; throughput on shared CPU cores is informational)")
    write_json(args.json, {"benchmark": "comm", "model": args.model or "bundled", "commit": git_commit(),
                           "machine": machine(), "load_average": load_average(), "threads_per_rank": args.threads,
                           "results": results})
    return 0
