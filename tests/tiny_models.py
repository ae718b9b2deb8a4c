"""Tiny random-weight Hugging Face models saved as safetensors, for comparing against transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def tiny_config(model_type: str, **overrides: Any):
    import transformers

    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[model_type]
    kwargs = dict(TINY_COMMON)
    if model_type == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    return cls(**kwargs)


def randomize_(module: Any) -> Any:
    """Every parameter ~N(0, 0.2), larger than the default init so that errors are visible, and
    DeepSeek's routing correction biases ~N(0, 0.1); returns the module (eval)."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
        for name, buf in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.1)
    return module.eval()


def save_tiny_model(config, path: Path, seed: int = 0) -> Any:
    """Build the transformers model with random weights (fp32, ``randomize_``), save it, return it (eval)."""
    import transformers

    torch.manual_seed(seed)
    model = randomize_(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits for every position of one sequence."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_greedy_tokens(path, ids: list[int], n: int) -> list[int]:
    """transformers' ``n`` greedy tokens after ``ids`` from the checkpoint at ``path`` (fp32, full forward
    per token: no cache, the independent reference)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = list(ids)
    for _ in range(n):
        out.append(int(hf_logits(hf, out)[-1].argmax()))
    return out[len(ids):]


def tiny_llama_with_bundled_tokenizer(std: float | None = None) -> tuple[Any, Any]:
    """(transformers model, tokenizer): a 2-layer random Llama (hidden 32, tied embeddings, seed 0) over the
    bundled model's tokenizer and chat template, for the chat, fine-tuning and LoRA tests; ``std``: draw
    every weight from N(0, std) instead of the config's initialization."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from tokenfab.loader.bundled import bundled_model_path

    gguf = bundled_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if std is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, std)
    model.config.architectures = ["LlamaForCausalLM"]
    return model, tokenizer


def small_engine(path, **kw):
    """An ``LLMEngine`` on the checkpoint at ``path`` with a small paged cache (64 blocks of 4 tokens)
    and 64-token steps, so that short prompts already span several blocks and chunks."""
    from tokenfab.engine.llm_engine import LLMEngine

    return LLMEngine(model=str(path), block_size=4, num_kv_blocks=64, max_num_batched_tokens=64, **kw)


def run_capturing_logits(engine, ids: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy-generate ``max_tokens`` for one prompt through the engine, returning the tokens and
    the logits the runner produced at each step (prefill chunk ends, then each decode step)."""
    from tokenfab.engine.requests.sampling_params import SamplingParams

    engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    step_logits: list[torch.Tensor] = []
    orig = engine.runner.execute

    def spy(batch):
        out = orig(batch)
        step_logits.append(out.clone())
        return out

    engine.runner.execute = spy
    try:
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
    finally:
        engine.runner.execute = orig
    return outs[-1].outputs[0].token_ids, step_logits


def run_batch(engine, prompts: list[list[int]], max_tokens: int, arrivals: list[int] | None = None,
              logprobs: int = 5) -> tuple[list[list[int]], list[list[dict[int, float]]], list]:
    """Greedy-generate for several prompts in one engine, prompt i added before step ``arrivals[i]``
    (default: all at once), so that later prompts' prefills share steps with earlier ones' decodes.

    Returns, per request, its tokens and its per-token top-``logprobs`` {token: logprob}, and the
    ForwardBatch of every step (for asserting which paths a test reached).
    """
    from tokenfab.engine.requests.sampling_params import SamplingParams

    arrivals = arrivals or [0] * len(prompts)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    batches: list = []
    orig = engine.runner.execute

    def spy(batch):
        batches.append(batch)
        return orig(batch)

    engine.runner.execute = spy
    done = {}
    step = 0
    try:
        while step <= max(arrivals) or engine.has_unfinished_requests():
            for i, at in enumerate(arrivals):
                if at == step:
                    engine.add_request(f"batch-{i}", list(prompts[i]), params)
            for o in engine.step() if engine.has_unfinished_requests() else []:
                if o.finished:
                    done[o.request_id] = o.outputs[0]
            step += 1
    finally:
        engine.runner.execute = orig
    outs = [done[f"batch-{i}"] for i in range(len(prompts))]
    tokens = [list(o.token_ids) for o in outs]
    lps = [[{t: lp.logprob for t, lp in d.items()} for d in o.logprobs] for o in outs]
    return tokens, lps, batches


def assert_batch_matches_hf(hf, prompts: list[list[int]], tokens: list[list[int]],
                            logprobs: list[list[dict[int, float]]], atol: float = 1e-3) -> None:
    """Per request: every generated token is transformers' greedy choice (fp32, the request alone)
    and the top log-probabilities the engine reported equal transformers' log-softmax."""
    for i, (prompt, gen, lps) in enumerate(zip(prompts, tokens, logprobs)):
        ref = torch.log_softmax(hf_logits(hf, list(prompt) + gen), dim=-1)
        for s, (tok, top) in enumerate(zip(gen, lps)):
            row = ref[len(prompt) - 1 + s]
            assert tok == int(row.argmax()), (
                f"request {i} (prompt of {len(prompt)}), step {s}: token {tok}, transformers' top 3 "
                f"{row.topk(3).indices.tolist()}")
            ids = list(top)
            got = torch.tensor([top[t] for t in ids])
            torch.testing.assert_close(got, row[ids], atol=atol, rtol=0,
                                       msg=lambda m, i=i, s=s: f"request {i}, step {s}: {m}")


def paths_reached(batches: list, threshold: int) -> set[str]:
    """Which batch shapes the steps had: "mixed" (a prefill chunk and a decode in one step),
    "chunked" (a prefill chunk after a cached prefix), "decodes" (several decodes in one step),
    "long+short" (one step with contexts above ``threshold`` and at most ``threshold``), and
    "long+short decodes" (the same among decode rows)."""
    seen: set[str] = set()
    for b in batches:
        q = (b.cu_seqlens_q[1:] - b.cu_seqlens_q[:-1]).tolist()
        ctx = b.context_lens.tolist()
        dec = [c for n, c in zip(q, ctx) if n == 1]
        if any(n > 1 for n in q) and dec:
            seen.add("mixed")
        if any(1 < n < c for n, c in zip(q, ctx)):
            seen.add("chunked")
        if len(dec) > 1:
            seen.add("decodes")
        if max(ctx) > threshold >= min(ctx):
            seen.add("long+short")
        if dec and max(dec) > threshold >= min(dec):
            seen.add("long+short decodes")
    return seen


def finished_outputs(engine, prompts: list[list[int]], params, tag: str = "g") -> list:
    """Add every prompt (request ids ``{tag}{i}``), step until all finish; their final
    ``RequestOutput``s in prompt order."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"{tag}{i}"] for i in range(len(prompts))]


def greedy_tokens(engine, prompts: list[list[int]], max_tokens: int, tag: str = "g") -> list[list[int]]:
    """Each prompt's ``max_tokens`` greedy tokens (EOS ignored), all prompts in one engine run."""
    from tokenfab.engine.requests.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in finished_outputs(engine, prompts, params, tag)]


def assert_batched_equals_alone(engine) -> list[list[int]]:
    """Four prompts of different lengths give the same 8 greedy tokens batched as each alone; returns
    the tokens of each alone."""
    prompts = [[5, 17, 42, 99], [1, 2, 3, 4, 5, 6, 7, 8, 9], [200] * 13, [7]]
    alone = [greedy_tokens(engine, [p], 8, f"a{i}-")[0] for i, p in enumerate(prompts)]
    assert greedy_tokens(engine, prompts, 8, "b") == alone
    return alone


def assert_step_logits_match_hf(engine, hf, prompts: list[list[int]], steps: int = 6, atol: float = 1e-3) -> None:
    """Per prompt, alone: the logits of the prefill and of each decode step equal transformers' (fp32)
    at the same position, the engine's token is transformers' argmax, and every block is freed."""
    for prompt in prompts:
        generated, step_logits = run_capturing_logits(engine, list(prompt), steps)
        assert len(generated) == steps
        full = list(prompt) + generated
        ref = hf_logits(hf, full)
        assert len(step_logits) == steps  # the prefill (maybe in chunks), then steps - 1 decode steps
        for s, logits in enumerate(step_logits):
            pos = len(prompt) - 1 + s
            torch.testing.assert_close(logits[0], ref[pos], atol=atol, rtol=0)
            assert int(ref[pos].argmax()) == full[pos + 1]
        assert engine.block_manager.num_used_blocks == 0


def compiled_and_eager_logits(engine, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of a two-sequence prefill (5 and 3 tokens) through ``torch.compile(fullgraph=True,
    backend=backend)`` of the model, and eagerly."""
    from tokenfab.engine.requests.sampling_params import SamplingParams
    from tokenfab.engine.requests.sequence import Sequence

    seqs = [Sequence(f"s{i}", None, list(range(1, n + 1)), SamplingParams(), 0) for i, n in enumerate((5, 3))]
    for s in seqs:
        engine.block_manager.allocate(s, s.num_tokens)
    batch = engine.runner.prepare(seqs, [s.num_tokens for s in seqs], [True, True])
    model = engine.runner.model
    with torch.inference_mode():
        expected = model.compute_logits(model(batch)[batch.logits_indices])
        compiled = torch.compile(lambda b: model.compute_logits(model(b)[b.logits_indices]), fullgraph=True,
                                 backend=backend)
        return compiled(batch), expected
