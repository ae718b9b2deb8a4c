"""Overlap scheduling on CPU: wall and process-CPU milliseconds per decode step, off vs on.

The bundled model (float32, 1 thread), 48 greedy tokens for 1 and for 8 streams, rounds interleaved
(off/on, then on/off), medians printed. On CPU the "device" is the CPU, so no change is expected:
this shows the overlapped loop costs nothing extra on the host. Process-CPU time is the figure a
busy shared machine inflates least.

    .venv/bin/python scripts/overlap_cpu_check.py [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from tokenfab import LLM, SamplingParams


def main(rounds: int = 4) -> None:
    torch.set_num_threads(1)
    llms = {a: LLM(async_scheduling=a) for a in (False, True)}
    n = 48
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    prompt = "Write a long story about a lighthouse keeper who"
    prompts8 = [f"{prompt} number {i}" for i in range(8)]
    for llm in llms.values():  # warm-up
        llm.generate(prompts8, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    res: dict[tuple[bool, int], list[tuple[float, float]]] = {}
    tokens: dict[tuple[bool, int], list] = {}
    for r in range(rounds):
        for a in ((False, True) if r % 2 == 0 else (True, False)):
            for ps in ([prompt], prompts8):
                w, c = time.perf_counter(), time.process_time()
                outs = llms[a].generate(ps, params)
                w, c = time.perf_counter() - w, time.process_time() - c
                res.setdefault((a, len(ps)), []).append((1000 * w / n, 1000 * c / n))
                tokens[(a, len(ps))] = [o.outputs[0].token_ids for o in outs]
    for (a, k), v in sorted(res.items()):
        print(f"async_scheduling={a!s:5} streams={k}: ms per step, wall median "
              f"{statistics.median(x[0] for x in v):.1f}, CPU median {statistics.median(x[1] for x in v):.1f}")
    print("same tokens:", all(tokens[(False, k)] == tokens[(True, k)] for k in (1, 8)))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
