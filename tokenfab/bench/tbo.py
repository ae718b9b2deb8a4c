"""`tokenfab bench comm --tbo`: step time with and without two-batch overlap on N gloo ranks.

Each of ``--tp`` spawned ranks (one gloo group on loopback) builds the same engine (SPMD) over a
random-weight Llama of a small real-ish shape (``--model`` instead: any TP-divisible model), prefills
``--tbo-seqs`` prompts of ``tokens / seqs`` tokens in one step for each ``--tbo-tokens`` size, keeps
that step's ForwardBatch and re-runs its forward ``--steps`` times with TBO off and on, alternating
(``two_batch.configure``, the same on every rank). Reported: rank 0's median step time each way and
the ratio. With ``--ep`` the MoE layers are expert-parallel (pass an MoE ``--model``).

On CPU gloo ranks sharing a few cores the figure is informational only: the all-reduce's gloo thread
competes with the other micro-batch's compute for the same cores, and loopback is not NVLink.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

from tokenfab.bench.gloo_ranks import run_on_ranks

SHAPE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)


def random_llama(path: str) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


def step_times(model: str, sizes: list[int], seqs: int, steps: int) -> list[dict[str, Any]]:
    """In this rank: per size, the forward time of one mixed prefill step with TBO off and on."""
    import torch

    from tokenfab.distributed import two_batch
    from tokenfab.engine.llm_engine import LLMEngine
    from tokenfab.engine.requests.sampling_params import SamplingParams

    top = max(sizes)
    engine = LLMEngine(model=model, max_num_seqs=seqs, max_num_batched_tokens=top, enable_prefix_caching=False,
                       num_kv_blocks=(top // 16 + 2 * seqs) * 2, block_size=16)
    vocab = engine.vocab_size
    seen: list = []
    orig = engine.runner.execute

    def spy(b):
        seen.append(b)
        return orig(b)

    engine.runner.execute = spy
    rows = []
    for n in sizes:
        per = n // seqs
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        for i in range(seqs):
            engine.add_request(f"t{n}-{i}", [(13 * i + 7 * j) % (vocab - 10) + 5 for j in range(per)], params)
        seen.clear()
        while engine.has_unfinished_requests():
            engine.step()
        batch = max(seen, key=lambda b: b.num_tokens)
        times: dict[bool, list[float]] = {False: [], True: []}
        with torch.inference_mode():
            for i in range(2 * steps + 2):
                on = bool(i % 2)
                two_batch.configure(on, 2)
                t0 = time.perf_counter()
                orig(batch)
                if i >= 2:  # the first of each way: warm-up
                    times[on].append(time.perf_counter() - t0)
        two_batch.configure(False)
        off_ms, on_ms = (statistics.median(times[k]) * 1e3 for k in (False, True))
        rows.append({"tokens": batch.num_tokens, "seqs": batch.num_seqs, "off_ms": off_ms, "tbo_ms": on_ms,
                     "speedup": off_ms / on_ms})
    return rows


def run_tbo(tp: int, model: str | None, sizes: list[int], seqs: int, steps: int, threads: int = 1,
            ep: bool = False) -> list[list[dict]]:
    """``step_times`` on ``tp`` spawned gloo ranks (a random Llama when ``model`` is None)."""
    with tempfile.TemporaryDirectory(prefix="tokenfab-tbo-") as out:
        model = model or random_llama(os.path.join(out, "model"))
        return run_on_ranks(step_times, (model, sizes, seqs, steps), tp, out, threads, "" if ep else None)


def run(args: Any) -> int:
    from tokenfab.bench.common import git_commit, load_average, machine, markdown_table, write_json

    tp = args.tp[0]
    ranks = run_tbo(tp, args.model, args.tbo_tokens, args.tbo_seqs, args.steps, args.threads, args.ep)
    rows = ranks[0]
    print(f"two-batch overlap, {tp} gloo ranks x {args.threads} thread(s), model "
          f"{args.model or 'random Llama ' + str(SHAPE)}; median of {args.steps} forwards each way")
    print(markdown_table(["tokens", "seqs", "plain ms", "TBO ms", "plain/TBO"],
                         [[r["tokens"], r["seqs"], round(r["off_ms"], 2), round(r["tbo_ms"], 2),
                           round(r["speedup"], 3)] for r in rows]))
    print("informational: CPU gloo ranks on shared cores (the collective's thread competes with compute)")
    write_json(args.json, {"bench": "comm --tbo", "machine": machine(), "commit": git_commit(),
                           "load_average": load_average(), "tp": tp, "ep": args.ep, "threads": args.threads,
                           "model": args.model or {"random_llama": SHAPE}, "rows": rows})
    return 0
