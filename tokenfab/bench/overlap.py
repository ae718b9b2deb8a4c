"""`tokenfab bench overlap`: the device time between decode steps, with and without overlap
scheduling (``--async-scheduling``), same engine, same workload, same run.

Each model forward (``ModelRunner.execute``) is bracketed by two marks on the device's timeline:
CUDA events recorded on the current stream on a GPU, ``time.perf_counter`` on CPU. The gap between
one decode forward's end and the next one's start is what the device does between two steps:

- on a GPU, the sampling kernels plus idle time while the host reads the sampled tokens, runs the
  stop checks and schedules and prepares the next batch. Overlap scheduling queues step N+1 before
  it reads step N, so the idle part should vanish: the gap left is the sampling kernels (and
  whatever the host still could not hide);
- on CPU the "device" is the host itself: nothing can overlap, the gap is the host work between
  forwards either way. That run is the harness's smoke test, not a figure about overlap.

Workload: ``--batch-sizes`` concurrent requests of ``--input-len`` random token ids, each decoding
``--output-len`` tokens greedily with ``ignore_eos``; each mode warms up, then runs ``--rounds``
times (the round with the smallest mean gap counts: shared machines). Reported per batch size and
mode: decode steps, gap per step (mean, p50, p90, ms), forward per step (ms), the gap's share of
the decode time, output tokens/s; and whether both modes gave the same tokens (they must).

Model: ``--model`` (a directory or .gguf; default the bundled model) or ``--shape``, a random
model of a real shape built on the spot (``bench engine``'s shapes: the GPU check's choice, since
the bundled model does not travel to the device machine).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenfab.bench.common import git_commit, load_average, machine, markdown_table, percentile, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory or .gguf (default: the bundled model)")
    p.add_argument("--shape", default=None, help="instead of --model: a random model of this shape "
                   "(bench engine's shapes: qwen3-0.6b, llama-3.1-8b, tiny)")
    p.add_argument("--batch-sizes", default="1,16", help="concurrent requests, comma list")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)


class Marks:
    """Points on the device's timeline: CUDA events on a GPU, host clock readings on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self) -> Any:
        if self.cuda:
            import torch

            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a: Any, b: Any) -> float:
        """Milliseconds from mark a to mark b (on a GPU: after the device reached b)."""
        return a.elapsed_time(b) if self.cuda else (b - a) * 1000.0


def instrument(runner: Any, marks: Marks, log: list) -> Any:
    """Wrap ``runner.execute``: each call appends (start mark, end mark, decode-only?) to ``log``;
    returns a function that undoes it."""
    inner = runner.execute

    def execute(batch):
        start = marks.mark()
        out = inner(batch)
        log.append((start, marks.mark(), batch.max_query_len == 1))
        return out

    runner.execute = execute

    def undo() -> None:
        del runner.execute  # the class's method again

    return undo


def step_gaps(log: list, marks: Marks) -> tuple[list[float], list[float]]:
    """(gaps, forwards) in ms: the gap between each decode forward and the decode forward after it,
    and each decode forward's own time."""
    gaps, forwards = [], []
    for (_, e0, d0), (s1, _, d1) in zip(log, log[1:]):
        if d0 and d1:
            gaps.append(marks.ms(e0, s1))
    for s, e, d in log:
        if d:
            forwards.append(marks.ms(s, e))
    return gaps, forwards


def _round(llm: Any, prompts: list[list[int]], params: Any, marks: Marks) -> tuple[dict, list]:
    log: list = []
    undo = instrument(llm.engine.runner, marks, log)
    try:
        _sync(marks)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        _sync(marks)
        wall = time.perf_counter() - t0
    finally:
        undo()
    gaps, forwards = step_gaps(log, marks)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    decode_ms = sum(gaps) + sum(forwards[1:])
    row = {"decode_steps": len(forwards), "gap_ms_mean": sum(gaps) / max(len(gaps), 1),
           "gap_ms_p50": percentile(gaps, 50), "gap_ms_p90": percentile(gaps, 90),
           "forward_ms_mean": sum(forwards) / max(len(forwards), 1),
           "gap_share": sum(gaps) / decode_ms if decode_ms > 0 else 0.0, "output_tok_s": n / wall}
    return row, [list(o.outputs[0].token_ids) for o in outs]


def _sync(marks: Marks) -> None:
    if marks.cuda:
        import torch

        torch.cuda.synchronize()


def measure(model: str | None, args: argparse.Namespace, async_scheduling: bool,
            work: dict[int, list[list[int]]]) -> dict[int, tuple[dict, list]]:
    """Per batch size: (best round's figures, its tokens) for one engine."""
    from tokenfab.engine.llm import LLM
    from tokenfab.engine.requests.sampling_params import SamplingParams

    largest = max(work)
    llm = LLM(model, dtype=args.dtype, device=args.device, enforce_eager=args.enforce_eager,
              max_num_seqs=max(largest, 1), max_model_len=max(256, args.input_len + args.output_len + 16),
              async_scheduling=async_scheduling)
    try:
        marks = Marks(llm.engine.device.type == "cuda")
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        llm.generate([[t % 997 + 3 for t in p] for p in work[largest]], warm)  # not the measured prompts
        vocab = int(llm.engine.vocab_size)
        result = {}
        for b, prompts in work.items():
            prompts = [[t % (vocab - 1) + 1 for t in p] for p in prompts]
            rounds = [_round(llm, prompts, params, marks) for _ in range(max(args.rounds, 1))]
            result[b] = min(rounds, key=lambda r: r[0]["gap_ms_mean"])
        return result
    finally:
        llm.engine.shutdown()
        del llm


def run(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in str(args.batch_sizes).split(",") if s.strip()]
    if not sizes or min(sizes) < 1:
        raise SystemExit("--batch-sizes: positive integers, e.g. 1,16")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.shape is not None:
            from tokenfab.bench.engine import SHAPES, build_model_dir
            from tokenfab.engine.llm_engine import resolve_device, resolve_dtype

            if args.shape not in SHAPES:
                raise SystemExit(f"--shape: one of {sorted(SHAPES)}")
            dtype = resolve_dtype(args.dtype, resolve_device(args.device))
            model = str(build_model_dir(args.shape, dtype, Path(tmp) / args.shape))
            vocab = SHAPES[args.shape]["vocab_size"]
        else:
            vocab = 32000
        rng = random.Random(0)
        work = {b: [[rng.randrange(100, vocab - 100) for _ in range(args.input_len)] for _ in range(b)]
                for b in sizes}
        off = measure(model, args, False, work)
        on = measure(model, args, True, work)
    rows, table = [], []
    for b in sizes:
        (r_off, t_off), (r_on, t_on) = off[b], on[b]
        same = t_off == t_on
        for mode, r in (("sync", r_off), ("async", r_on)):
            rows.append({"batch": b, "mode": mode, **r, "same_tokens": same})
            table.append([b, mode, r["decode_steps"], f"{r['gap_ms_mean']:.3f}", f"{r['gap_ms_p50']:.3f}",
                          f"{r['gap_ms_p90']:.3f}", f"{r['forward_ms_mean']:.3f}", f"{r['gap_share']:.1%}",
                          f"{r['output_tok_s']:.1f}", same])
    import torch

    on_gpu = torch.cuda.is_available() and args.device in ("auto", "cuda")
    report = {"benchmark": "overlap", "commit": git_commit(), "machine": machine(), "load_average": load_average(),
              "model": args.shape and f"random {args.shape}" or (args.model or "bundled"),
              "timeline": "CUDA events" if on_gpu else "host clock (CPU: nothing overlaps; harness smoke test)",
              "workload": {"batch_sizes": sizes, "input_len": args.input_len, "output_len": args.output_len,
                           "rounds": args.rounds, "greedy": True, "ignore_eos": True},
              "results": rows,
              "gap_ratio_async_over_sync": {b: (on[b][0]["gap_ms_mean"] / off[b][0]["gap_ms_mean"]
                                                if off[b][0]["gap_ms_mean"] > 0 else None) for b in sizes}}
    headers = ["batch", "mode", "decode steps", "gap ms mean", "p50", "p90", "forward ms", "gap share", "tok/s",
               "same tokens"]
    md = markdown_table(headers, table)
    print(md)
    write_json(args.json, report)
    if args.markdown:
        Path(args.markdown).write_text(f"# bench overlap ({report['timeline']})\n\n{md}\n")
    return 0 if all(r["same_tokens"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tokenfab bench overlap", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
