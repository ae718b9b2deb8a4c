"""tokenfab's side of `tokenfab bench cpu`: the llama.cpp tools' workloads, through the LLM API.

Every request is greedy with ``ignore_eos`` (exactly the asked-for tokens) and has a prompt of
fresh random token ids (no two measurements share a prefix, so the prefix cache never helps).

- prefill (llama-bench's ppN): one N-token prompt, one token generated; prompt tokens / seconds from
  arrival to the first token;
- decode (tgN): a 1-token prompt, N tokens generated; (N - 1) tokens / seconds from the first
  token to the last (llama-bench times N single-token decodes from an empty context);
- batched decode (llama-batched-bench's S_TG at B): B prompts of PP tokens generating TG tokens
  each, together; the tokens after each request's first / seconds from the earliest first token
  to the last finish (a prefill split over steps counts against us), plus the end-to-end output
  tokens / wall seconds of the whole call (the figure transformers is compared on).

Each figure is the median of ``repeats`` runs (the engine warmed up beforehand).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from tokenfab.engine.llm import LLM
from tokenfab.engine.requests.sampling_params import SamplingParams


class Prompts:
    """Fresh random prompts: every call draws new ids (the lowest ids skipped: special tokens)."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.low, self.vocab, self.rng = min(100, vocab // 2), vocab, random.Random(seed)

    def draw(self, n: int, length: int) -> list[list[int]]:
        return [[self.rng.randrange(self.low, self.vocab) for _ in range(length)] for _ in range(n)]


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[Any], float]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return outs, time.perf_counter() - t0


def warm_up(llm: LLM, prompts: Prompts, prompt_len: int, max_batch: int) -> None:
    """One long prompt and one full batch of short ones, a few tokens each (allocator, thread
    pools and kernel choices settled before anything is timed)."""
    _generate(llm, prompts.draw(1, prompt_len), 2)
    _generate(llm, prompts.draw(max_batch, 8), 4)


def prefill(llm: LLM, prompts: Prompts, prompt_len: int, repeats: int) -> dict[str, Any]:
    runs = []
    for _ in range(repeats):
        outs, wall = _generate(llm, prompts.draw(1, prompt_len), 1)
        m = outs[0].metrics
        sec = m.first_token_time - m.arrival_time if m and m.first_token_time else wall
        runs.append(prompt_len / sec)
    return {"workload": f"pp{prompt_len}", "tok_s": statistics.median(runs), "runs_tok_s": runs,
            "timing": "prompt tokens / (first token - arrival)"}


def _decode_rate(outs: list[Any], wall: float) -> float:
    """Tokens after each request's first / (last finish - earliest first token)."""
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    ms = [o.metrics for o in outs]
    if all(m is not None and m.first_token_time and m.finished_time for m in ms):
        window = max(m.finished_time for m in ms) - min(m.first_token_time for m in ms)
        if window > 0:
            return tokens / window
    return tokens / wall


def decode(llm: LLM, prompts: Prompts, gen_len: int, repeats: int) -> dict[str, Any]:
    runs = [_decode_rate(*_generate(llm, prompts.draw(1, 1), gen_len)) for _ in range(repeats)]
    return {"workload": f"tg{gen_len}", "tok_s": statistics.median(runs), "runs_tok_s": runs,
            "timing": "(tokens - 1) / (last token - first token), 1-token prompt"}


def batched_decode(llm: LLM, prompts: Prompts, batch: int, prompt_len: int, gen_len: int,
                   repeats: int) -> tuple[dict[str, Any], list[list[int]]]:
    """The figures at ``batch`` sequences, and the last run's prompts (the transformers peer's workload)."""
    rates, e2e, last = [], [], []
    for _ in range(repeats):
        last = prompts.draw(batch, prompt_len)
        outs, wall = _generate(llm, last, gen_len)
        rates.append(_decode_rate(outs, wall))
        e2e.append(sum(len(o.outputs[0].token_ids) for o in outs) / wall)
    return ({"workload": f"B={batch}, pp{prompt_len}, tg{gen_len}", "batch": batch, "tok_s": statistics.median(rates),
             "runs_tok_s": rates, "e2e_output_tok_s": statistics.median(e2e),
             "timing": "decode tokens / (last finish - earliest first token); e2e: output tokens / wall"}, last)
