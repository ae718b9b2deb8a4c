"""The offline API: ``LLM(model).generate(prompts, params)`` and ``LLM.chat(messages)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from tokenfab.engine.args import EngineArgs
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.lora_request import LoRARequest
from tokenfab.engine.requests.outputs import RequestOutput
from tokenfab.engine.requests.sampling_params import SEED_MAX, SamplingParams

Prompt = str | list[int]


class LLM:
    """Offline batched generation. ``LLM()`` loads the bundled SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        if engine_args.get("data_parallel_size", 1) != 1:
            raise ValueError("data_parallel_size: replicas are served by `tokenfab serve --data-parallel-size N`; "
                             "the offline LLM runs one engine (use tensor_parallel_size to shard it)")
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers now (also done at exit)."""
        self.engine.shutdown()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Seq[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt is text or a list of token ids; with
        ``n > 1`` the n completions of a prompt are in ``outputs[0..n-1]``. ``lora_request``: the
        LoRA adapter every prompt runs with (an engine started with ``enable_lora=True``)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError("give one SamplingParams, or one per prompt")
        return self._run(prompts, params, use_tqdm, priority, lora_request)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt, chat_template_kwargs) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template")
        out = tok.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
            **(chat_template_kwargs or {}),
        )
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def _run(
        self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool, priority: Seq[int] | None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        engine = self.engine
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("priority: give one per prompt")
        # validate the whole batch before queueing anything: a rejected batch leaves the engine as it was
        tokenized = []
        for prompt, p in zip(prompts, params):
            text, ids = engine.tokenize(prompt)
            engine.check_request(ids, p)
            tokenized.append((text, ids))
        order: dict[str, tuple[int, int]] = {}
        try:
            for i, ((text, ids), p) in enumerate(zip(tokenized, params)):
                for j in range(p.n):
                    rid = f"llm-{next(self._ids)}"
                    sub = p
                    if p.n > 1:
                        sub = _copy_params(p, seed=None if p.seed is None else (p.seed + j) % (SEED_MAX + 1))
                    engine.add_request(rid, text if text is not None else ids, sub, priority[i] if priority else 0,
                                       prompt_token_ids=ids, lora_request=lora_request)
                    order[rid] = (i, j)
        except BaseException:
            for rid in order:
                engine.abort_request(rid)
            raise
        results: dict[int, list] = {i: [None] * p.n for i, p in enumerate(params)}
        first: dict[int, RequestOutput] = {}
        errors: dict[int, str] = {}  # prompt index -> the first failed choice's error
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(order), desc="generating", unit="req")
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        i, j = order[out.request_id]
                        out.outputs[0].index = j
                        results[i][j] = out.outputs[0]
                        first.setdefault(i, out)
                        if out.error is not None:
                            errors.setdefault(i, out.error)
                        if bar is not None:
                            bar.update(1)
        except BaseException:  # interrupted or the engine died: leave nothing of this call queued
            for rid in order:
                engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        final = []
        for i in range(len(prompts)):
            out = first[i]
            final.append(RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, results[i], True,
                                       out.num_cached_tokens, out.metrics, out.prompt_logprobs,
                                       errors.get(i)))
        return final


def _copy_params(p: SamplingParams, **changes: Any) -> SamplingParams:
    from dataclasses import replace

    return replace(p, n=1, **changes)
