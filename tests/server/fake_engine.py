"""A small stand-in for LLMEngine (same interface), for fast tests of AsyncEngine's threading and of
the HTTP server in process: byte-level tokenizer, deterministic pseudo-random "model", a
configurable step time. It follows /work/notes/interface.md: ``check_request``, ``logit_bias``,
``prompt_logprobs``, ``max_tokens=0``, ``scheduling_policy``, and two failure switches: a prompt
containing ``POISON`` fails alone (finish_reason "error"), ``die_on_next_step`` makes the next
step raise ``EngineDeadError``."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from tokenfab.engine.requests.errors import EngineDeadError
from tokenfab.engine.requests.outputs import CompletionOutput, Logprob, RequestOutput
from tokenfab.engine.requests.sampling_params import SamplingParams

EOS = 0
VOCAB = 260
POISON = "POISON"


class ByteTokenizer:
    eos_token_id = EOS
    eos_token = "<eos>"

    def __len__(self) -> int:
        return VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 1 for i in ids if 1 <= i <= 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kw) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_used_blocks: int = 0
    num_total_blocks: int = 64
    kv_cache_tokens: int = 1024
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    prefix_cache_hit_rate: float = 0.0
    computed_prompt_tokens_total: int = 0


@dataclass
class _Seq:
    rid: str
    prompt: list[int]
    params: SamplingParams
    rng: random.Random
    out: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    emitted_text: int = 0
    emitted_plp: bool = False


class FakeEngine:
    """Generates lowercase letters; ``max_num_seqs`` running at once, the rest wait."""

    def __init__(self, step_time: float = 0.002, max_num_seqs: int = 8, max_model_len: int = 512,
                 scheduling_policy: str = "fcfs") -> None:
        self.scheduling_policy = scheduling_policy
        self.die_on_next_step = False
        self.cache_salts: list[str | None] = []
        self.tokenizer = ByteTokenizer()
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.vocab_size = VOCAB
        self.step_time = step_time
        self.max_num_seqs = max_num_seqs
        self.waiting: list[_Seq] = []
        self.running: list[_Seq] = []
        self.stats = FakeStats()
        self.steps = 0
        self.max_batch_seen = 0

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        params.validate()
        if not ids:
            raise ValueError("prompt is empty")
        if any(not 0 <= t < VOCAB for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {VOCAB})")
        if len(ids) + (params.max_tokens != 0) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, but this model's context is {self.max_model_len}")
        if any(not 0 <= t < VOCAB for t in params.stop_token_ids or []):
            raise ValueError(f"stop_token_ids must be in [0, {VOCAB})")
        if any(not 0 <= t < VOCAB for t in params.logit_bias or {}):
            raise ValueError(f"logit_bias keys must be token ids in [0, {VOCAB})")

    def add_request(self, request_id: str, prompt, params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_request(ids, params)
        self.cache_salts.append(cache_salt)
        seed = params.seed if params.seed is not None else random.getrandbits(32)
        self.waiting.append(_Seq(request_id, ids, params, random.Random(seed)))
        self.stats.prompt_tokens_total += len(ids)

    def abort_request(self, request_id: str) -> None:
        self.waiting = [s for s in self.waiting if s.rid != request_id]
        self.running = [s for s in self.running if s.rid != request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def prompt_logprobs(self, ids: list[int], k: int) -> list[dict[int, Logprob] | None]:
        """Deterministic stand-in scores: position i's distribution is a softmax seeded by ids[:i]."""
        out: list[dict[int, Logprob] | None] = [None]
        for i in range(1, len(ids)):
            gen = torch.Generator().manual_seed(sum(ids[:i]) * 31 + i)
            lp = torch.log_softmax(torch.randn(VOCAB, generator=gen), -1)
            order = torch.argsort(lp, descending=True)
            ranks = torch.empty_like(order)
            ranks[order] = torch.arange(1, VOCAB + 1)
            d = {int(t): Logprob(float(lp[t]), int(ranks[t]), self.tokenizer.decode([int(t)])) for t in order[:k]}
            tok = ids[i]
            d.setdefault(tok, Logprob(float(lp[tok]), int(ranks[tok]), self.tokenizer.decode([tok])))
            out.append(d)
        return out

    def step(self) -> list[RequestOutput]:
        if self.die_on_next_step:
            raise EngineDeadError("fake CUDA error: the device is gone")
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self.waiting.pop(0))
        self.max_batch_seen = max(self.max_batch_seen, len(self.running))
        time.sleep(self.step_time)
        self.steps += 1
        outs = []
        for seq in list(self.running):
            p = seq.params
            plp = (self.prompt_logprobs(seq.prompt, p.prompt_logprobs)
                   if p.prompt_logprobs is not None and not seq.emitted_plp else None)
            if POISON in self.tokenizer.decode(seq.prompt):  # this request's part of the step fails
                self.running.remove(seq)
                co = CompletionOutput(0, "", [], "error")
                outs.append(RequestOutput(seq.rid, None, seq.prompt, [co], True, error="poisoned request"))
                continue
            if p.max_tokens == 0:  # score the prompt only
                self.running.remove(seq)
                co = CompletionOutput(0, "", [], "length", None, [] if p.logprobs is not None else None)
                outs.append(RequestOutput(seq.rid, None, seq.prompt, [co], True, prompt_logprobs=plp))
                continue
            logits = torch.tensor([seq.rng.random() for _ in range(VOCAB)], dtype=torch.float32)
            for t, b in (p.logit_bias or {}).items():
                logits[t] += b
            logits[:98] = float("-inf")  # lowercase letters only: never EOS
            logits[124:] = float("-inf")
            if p.constraint is not None:
                logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seq.rng.getrandbits(31)))
                p.constraint.mask_logits(logits)
            tok = int(torch.argmax(logits))
            lp = torch.log_softmax(logits, -1)
            seq.out.append(tok)
            self.stats.generation_tokens_total += 1
            if p.constraint is not None:
                p.constraint.accept_token(tok)
            finish = None
            if tok != EOS:
                seq.text += self.tokenizer.decode([tok])
            for s in p.stop or []:
                if s in seq.text:
                    seq.text = seq.text[: seq.text.index(s)]
                    finish = "stop"
            if finish is None and tok == EOS and not p.ignore_eos:
                finish = "stop"
            if finish is None and p.constraint is not None and p.constraint.is_terminated():
                finish = "stop"
            if finish is None and p.max_tokens is not None and len(seq.out) >= p.max_tokens:
                finish = "length"
            if finish is None and len(seq.prompt) + len(seq.out) >= self.max_model_len:
                finish = "length"
            logprobs = None
            if p.logprobs is not None:
                top = torch.topk(lp, max(p.logprobs, 1))
                logprobs = []
                for _ in seq.out:
                    d = {int(t): Logprob(float(v), r + 1, self.tokenizer.decode([int(t)]))
                         for r, (v, t) in enumerate(zip(top.values, top.indices)) if r < p.logprobs}
                    d.setdefault(tok, Logprob(float(lp[tok]), 1, self.tokenizer.decode([tok])))
                    logprobs.append(d)
            co = CompletionOutput(0, seq.text, list(seq.out), finish, None, logprobs,
                                  seq.text[seq.emitted_text:], seq.out[seq.emitted:])
            seq.emitted = len(seq.out)
            seq.emitted_text = len(seq.text)
            if finish:
                self.running.remove(seq)
            outs.append(RequestOutput(seq.rid, None, seq.prompt, [co], finish is not None,
                                      prompt_logprobs=plp))
            seq.emitted_plp = True
        self.stats.num_running = len(self.running)
        self.stats.num_waiting = len(self.waiting)
        self.stats.kv_cache_usage = min(1.0, len(self.running) / 64)
        return outs

    def get_stats(self) -> FakeStats:
        s = self.stats
        s.num_running = len(self.running)
        s.num_waiting = len(self.waiting)
        s.kv_cache_usage = min(1.0, len(self.running) / 64)
        return FakeStats(**vars(s))
