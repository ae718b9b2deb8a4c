"""Shared checks for model-based proposers in the engine: greedy outputs identical with and without
speculation, alone, batched (mixed lengths), with prefix-cache hits, chunked prefill and preemption.

The reference engine runs the same batch-invariant kernels as a speculative engine
(``runner.batch_invariant = True``): the property under test is that speculation changes nothing,
not that two kernel families round alike."""

from __future__ import annotations

import random

from tokenfab import LLM, SamplingParams


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def outputs(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(n))]


def random_prompts(vocab: int, lengths: tuple[int, ...] = (3, 11, 30, 45), seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def plain_llm(path: str, **kw) -> LLM:
    llm = LLM(model=path, **kw)
    llm.engine.runner.batch_invariant = True  # the speculative engine's kernels (see the module docstring)
    return llm


def check_greedy_identity(plain: LLM, spec: LLM, tight: LLM, prompts: list[list[int]], n: int) -> None:
    """``spec``: a speculative engine with room; ``tight``: the same speculation with a small token
    budget (chunked prefill) and a small KV cache (preemption)."""
    ref = outputs(plain, prompts, n)
    for p, r in zip(prompts, ref):  # alone
        assert outputs(spec, [p], n) == [r]
    assert outputs(spec, prompts, n) == ref  # batched, mixed lengths
    bm = spec.engine.block_manager
    hits = bm.prefix_hits
    assert outputs(spec, prompts[::-1], n) == ref[::-1]  # again: prefix-cache hits
    assert bm.prefix_hits > hits
    pre = tight.engine.scheduler.num_preemptions_total
    assert outputs(tight, prompts, n) == ref  # chunked prefill + preemption
    assert tight.engine.scheduler.num_preemptions_total > pre
    for llm in (spec, tight):
        assert llm.engine.spec.num_draft_tokens > 0  # drafts were verified


def record_drafts(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(the sequence's tokens, its drafts) for every drafting sequence of every step."""
    prop = llm.engine.spec.proposer
    seen: list[tuple[list[int], list[int]]] = []
    orig = prop.draft

    def spy(seqs, ks):
        out, qs = orig(seqs, ks)
        seen.extend((list(s.token_ids), d) for s, k, d in zip(seqs, ks, out) if k)
        return out, qs

    prop.draft = spy
    return seen
