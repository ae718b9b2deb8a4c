"""Online TTFT with background work in flight, at the engine (no server): the scheduler's share of issue 27's
isolation figure, without the API server's own overheads.

Online requests arrive as a Poisson process (``--rate`` a second, ``--prompt-len`` random token ids, ``--max-tokens``
greedy tokens); arrivals are added at the next step boundary with their true arrival time, so a request's TTFT
includes the step in flight when it arrived. Three phases on one engine: online alone; with ``--bg-concurrency``
background requests (priority 2**31-1, what /v1/batches submits) kept in flight; and with the same requests at
priority 0 (online, the scheduler's behaviour before background work existed). Engine flags as JSON:

    python scripts/batch_isolation_engine.py --engine '{"cpu_threads": 1, "background_max_prefill_tokens": 16}'
"""

from __future__ import annotations

import argparse
import json
import random
import time

from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.sequence import BACKGROUND_PRIORITY


def phase(eng: LLMEngine, args: argparse.Namespace, n: int, bg_conc: int, bg_priority: int, seed: int) -> dict:
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    t = time.perf_counter() + 0.5
    arrivals = []
    for _ in range(n):
        t += rng.expovariate(args.rate)
        arrivals.append(t)
    ttft: dict[str, float] = {}
    bg_live: set[str] = set()
    bg_done = k = j = 0
    t0 = time.perf_counter()
    while len(ttft) < n:
        now = time.perf_counter()
        while k < n and arrivals[k] <= now:
            eng.add_request(f"o{k}", [rng.randrange(1, 30000) for _ in range(args.prompt_len)], params,
                            arrival_time=arrivals[k])
            k += 1
        while len(bg_live) < bg_conc:
            bg_live.add(f"b{j}")
            eng.add_request(f"b{j}", [rng.randrange(1, 30000) for _ in range(rng.randint(30, 45))], params,
                            priority=bg_priority)
            j += 1
        if not eng.has_unfinished_requests():
            time.sleep(max(0.0, min(arrivals[k] - now, 0.01)))
            continue
        for out in eng.step():
            rid = out.request_id
            if rid.startswith("o") and rid not in ttft and out.outputs[0].token_ids:
                ttft[rid] = time.perf_counter() - arrivals[int(rid[1:])]
            if out.finished and rid in bg_live:
                bg_live.discard(rid)
                bg_done += 1
    seconds = time.perf_counter() - t0
    for rid in list(bg_live):
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    xs = sorted(ttft.values())
    return {"p50": xs[len(xs) // 2], "p99": xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))],
            "mean": sum(xs) / len(xs), "bg_done": bg_done, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="{}", help="LLMEngine keyword arguments as JSON")
    p.add_argument("--online-requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=1.0, help="online arrivals a second (Poisson)")
    p.add_argument("--prompt-len", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--bg-concurrency", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    extra = json.loads(args.engine)
    eng = LLMEngine(**{"max_model_len": 512, "num_kv_blocks": 512, **extra})
    phase(eng, args, 10, 0, 0, seed=99)  # warm-up
    n = args.online_requests
    res = {"alone": phase(eng, args, n, 0, 0, 0),
           "background": phase(eng, args, n, args.bg_concurrency, BACKGROUND_PRIORITY, 0),
           "as_online": phase(eng, args, n, args.bg_concurrency, 0, 0)}
    print(f"{'phase':<12}{'p50 TTFT s':>12}{'p99 TTFT s':>12}{'bg done':>9}{'seconds':>9}")
    for name, r in res.items():
        print(f"{name:<12}{r['p50']:>12.3f}{r['p99']:>12.3f}{r['bg_done']:>9}{r['seconds']:>9.1f}")
    print(f"p99 ratio with background {res['background']['p99'] / res['alone']['p99']:.2f}x, "
          f"as online {res['as_online']['p99'] / res['alone']['p99']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"engine": extra, "args": vars(args), **res}, f, indent=2)


if __name__ == "__main__":
    main()
