"""The engine: requests in, a model step at a time, incremental outputs out."""

from __future__ import annotations

import itertools
import logging
import operator
import secrets
import time

import torch

from tokenfab.distributed import two_batch
from tokenfab.engine.args import EngineArgs
from tokenfab.engine.output_processor import TokenTexts, append_text, logprob_entry, visible_text
from tokenfab.engine.overlap import OverlapScheduler
from tokenfab.engine.requests.block_manager import BlockManager
from tokenfab.engine.requests.errors import EngineDeadError, is_device_fatal
from tokenfab.engine.requests.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.scheduler import ScheduledBatch, Scheduler
from tokenfab.engine.requests.sequence import Sequence, SequenceStatus
from tokenfab.engine.requests.stats import EngineStats
from tokenfab.engine.runner.device_setup import (  # noqa: F401 (resolve_*, tune_cpu_allocator: imported from here)
    log_memory_figures,
    maybe_pack_cpu_weights,
    physical_memory_bytes,
    resolve_device,
    resolve_dtype,
    tune_cpu_allocator,
)
from tokenfab.engine.runner.kv_budget import kv_cache_blocks
from tokenfab.engine.runner.model_runner import ModelRunner, kv_bytes_per_token
from tokenfab.engine.runner.prompt_logprobs import prompt_rows_of, score_prompt
from tokenfab.engine.runner.sampler import sample_next
from tokenfab.loader.model_loader import config_max_len, load_model, text_config
from tokenfab.quant.kv_fp8 import configure_kv_cache
from tokenfab.speculative.config import SpeculativeConfig
from tokenfab.tokenizer import eos_token_ids

log = logging.getLogger("tokenfab")


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, **kwargs) -> None:
        args = args or EngineArgs(**kwargs)
        if args.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {args.scheduling_policy!r}")
        spec_config = SpeculativeConfig.parse(args.speculative_config)  # a bad config fails before the load
        self.args = args
        self.scheduling_policy = args.scheduling_policy
        self.tp = None  # tensor parallel: rank 0's handle on the worker ranks (executors/tp_executor.py)
        if args.tensor_parallel_size != 1:
            from tokenfab.executors.tp_executor import start_tensor_parallel

            self.tp = start_tensor_parallel(args)  # before the load: layers shard at build time
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        t0 = time.perf_counter()
        loaded = load_model(args.model, self.dtype, self.device, args.max_model_len,
                            quantization=args.quantization)
        self.model = loaded.model
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = args.served_model_name or loaded.name
        text = text_config(loaded.config)
        self.max_model_len = min(args.max_model_len or config_max_len(text), config_max_len(text))
        self.eos_token_ids = sorted(set(eos_token_ids(self.tokenizer, self.config) + eos_token_ids(None, text)))
        self.vocab_size = text.vocab_size
        if self.device.type == "cpu":
            tune_cpu_allocator()
        copies = maybe_pack_cpu_weights(self.model, self.device, args.cpu_weight_packing)
        configure_kv_cache(self.model, args.kv_cache_dtype, args.kv_cache_dtype_skip_layers)  # FP8 KV layers
        two_batch.configure_from_args(args)  # --enable-two-batch-overlap (every TP rank does the same)
        self.memory = log_memory_figures(self.model, self.dtype, copies)
        self.spec = None  # speculative decoding (tokenfab/speculative/step.py); a draft module loads here
        if spec_config is not None:
            from tokenfab.speculative.step import SpecDecoder

            self.spec = SpecDecoder(spec_config, self)
        draft = self.spec.kv_bytes_per_token() if self.spec is not None else 0  # same blocks, more bytes
        num_blocks = kv_cache_blocks(args, kv_bytes_per_token(self.model, self.dtype) + draft, self.device,
                                     self.max_model_len, self._make_runner)
        self.runner = self._make_runner(args.block_size, num_blocks)
        if spec_config is not None:  # verify rows must round as decode rows do (kernels/batch_invariant.py)
            self.runner.batch_invariant = True
            self.spec.bind_cache(args.block_size, num_blocks)  # the draft's cache: the target's blocks
        if self.device.type == "cuda" and not args.enforce_eager:
            self.runner.capture_decode_graphs(min(args.max_num_seqs, 256), self.max_model_len)
        self.block_manager = BlockManager(num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, args.max_num_batched_tokens)
        self.kv_cache_tokens = num_blocks * args.block_size
        self._seqs: dict[str, Sequence] = {}
        # detokenize=False (the engine-core process): token ids only; the API server makes the text
        self.detokenize = args.detokenize
        self._decode_one = TokenTexts(self.tokenizer if args.detokenize else None)  # logprob entry texts
        self._arrivals = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.computed_prompt_tokens_total = 0
        self.num_steps = 0
        self._last = (0, 0, 0)
        # --async-scheduling: step N+1 is launched before step N's tokens are read (engine/overlap.py)
        self._overlap = OverlapScheduler(self) if args.async_scheduling else None
        self.eplb = self._make_eplb(args)  # --eplb-config: experts re-placed between steps
        log.info(
            "loaded %s on %s (%s) in %.1fs; KV cache: %d blocks x %d = %d tokens",
            self.model_name, self.device, self.dtype, time.perf_counter() - t0, num_blocks,
            args.block_size, self.kv_cache_tokens,
        )

    def _make_runner(self, block_size: int, num_blocks: int) -> ModelRunner:
        """The runner; under tensor parallelism one whose forwards the workers mirror (its twin
        there gets the same cache layout)."""
        if self.tp is not None:
            return self.tp.make_runner(self.model, self.device, self.dtype, block_size, num_blocks)
        return ModelRunner(self.model, self.device, self.dtype, block_size, num_blocks)

    def _make_eplb(self, args: EngineArgs) -> object:
        from tokenfab.executors.eplb_engine import EplbConfig, EplbController

        cfg = EplbConfig.parse(args.eplb_config)
        if cfg is None:
            return None
        try:
            return EplbController(cfg, self.model, self.tp.send_eplb if self.tp is not None else None)
        except ValueError:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (if any); the engine serves nothing after this."""
        if self.tp is not None:
            self.tp.shutdown()

    # ---- requests -------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give the prompt as token ids")
            try:
                return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
            except (TypeError, UnicodeError) as e:  # e.g. a lone UTF-16 surrogate ("\ud800")
                raise ValueError(f"prompt cannot be tokenized: {e}") from None
        try:
            return None, [operator.index(t) for t in prompt]  # ints, numpy/torch integer scalars
        except TypeError:
            raise ValueError("prompt token ids must be integers") from None

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Everything that makes a request unservable by this model, checked before it is queued
        (pure: reads only what never changes after load, so any thread may call it). Raises
        ValueError whose message starts with the parameter's name."""
        params.validate()
        v = self.vocab_size
        ids = prompt_token_ids
        if not ids:
            raise ValueError("prompt is empty")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < v for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {v})")
        n = len(ids)
        generates = params.max_tokens != 0
        if n + generates > self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens, but this model's context is {self.max_model_len} tokens"
                + (" (including at least one generated token)" if generates else "")
            )
        if n + generates > self.kv_cache_tokens:
            raise ValueError(f"prompt has {n} tokens, more than the KV cache holds ({self.kv_cache_tokens})")
        bad = [t for t in params.stop_token_ids or [] if not 0 <= t < v]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {v}), got {bad[:5]}")
        bad = [t for t in params.logit_bias or {} if not 0 <= t < v]
        if bad:
            raise ValueError(f"logit_bias keys must be token ids in [0, {v}), got {bad[:5]}")

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a request; ValueError with a clear message (and nothing queued) if it cannot be
        served. ``priority`` counts only under the "priority" scheduling policy (lower runs first);
        requests with different ``cache_salt`` never share prefix-cache blocks.
        ``prompt_token_ids``: the text prompt's ids when the caller tokenized it already."""
        params = params or SamplingParams()
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > 2**31 - 1:
            raise ValueError(f"priority must be an integer in [-2**31+1, 2**31-1], got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
        if prompt_token_ids is not None:
            text, ids = (prompt if isinstance(prompt, str) else None), list(prompt_token_ids)
        else:
            text, ids = self.tokenize(prompt)
        self.check_request(ids, params)
        # unseeded: OS entropy (two servers, or two runs, never share their "random" draws)
        base_seed = params.seed if params.seed is not None else secrets.randbits(63)
        if self.scheduling_policy != "priority":
            priority = 0
        seq = Sequence(request_id, text, ids, params, base_seed, priority, next(self._arrivals), arrival_time,
                       cache_salt)
        self._seqs[request_id] = seq
        self.prompt_tokens_total += len(ids)
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq)
            seq.finish_reason = "abort"
            if self.spec is not None:
                self.spec.release(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def async_scheduling(self) -> bool:
        return self._overlap is not None

    # ---- the step -------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One model step. A failure that belongs to some requests (their rows of the forward,
        their sampling, their constraint) fails only those (finish_reason "error"); a device
        error raises EngineDeadError. With async scheduling the outputs of a step come back
        from the next call (engine/overlap.py)."""
        if self.eplb is not None:  # between steps, on every rank in lockstep (the workers by command)
            try:
                self.eplb.on_steps(self.num_steps)
            except Exception as e:
                if self.tp is None:
                    raise
                raise self.tp._dead_error(e) from e  # the workers may be stuck in a collective
        if self._overlap is not None:
            return self._overlap.step()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)  # drafts ride in the batch the scheduler builds
        batch = self.scheduler.schedule()
        if batch.empty:
            return self._unschedulable()
        return self.run_batch(batch)

    def run_batch(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Forward, sample and process one scheduled batch, synchronously."""
        seqs, counts = batch.seqs, batch.num_new_tokens
        if self.spec is not None:  # a draft model's tokens, now that their blocks are allocated
            self.spec.fill_drafts(seqs)
        now, t0 = time.time(), time.perf_counter()
        starts = [s.num_computed_tokens for s in seqs]
        ks = [len(s.spec_token_ids) for s in seqs]  # speculative drafts verified after the known tokens
        # a chunk that reaches the end of the known tokens yields the next token (max_tokens 0: none)
        done = [st + n - k == s.num_tokens for s, st, n, k in zip(seqs, starts, counts, ks)]
        sample_mask = [d and s.params.max_tokens != 0 for s, d in zip(seqs, done)]
        scoring = any(s.prompt_logprobs is not None for s in seqs)
        if scoring:
            prompt_rows = [prompt_rows_of(s, st, n) for s, st, n in zip(seqs, starts, counts)]
            scoring = any(b > a for a, b in prompt_rows)
        else:
            prompt_rows = [(0, 0)] * len(seqs)
        failed: dict[int, str] = {}
        logits, hidden = self._forward(seqs, counts, sample_mask, prompt_rows if scoring else None, failed)
        # the rows of logits (and hidden) are those of the sequences that did not fail, in order
        sampling = [i for i, m in enumerate(sample_mask) if m and i not in failed]
        if any(ks):  # per sequence: the accepted drafts and the target's token
            sampled = self.spec.sample([seqs[i] for i in sampling], logits)
        else:
            sampled = [r if isinstance(r, str) else [r] for r in self._sample([seqs[i] for i in sampling], logits)]
        self.num_steps += 1
        self._last = (len(seqs), batch.num_prefill_tokens, batch.num_decode_tokens)
        row = 0
        for i, (seq, n) in enumerate(zip(seqs, counts)):
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            if i in failed:
                continue
            a, b = prompt_rows[i]
            if b > a:
                try:
                    score_prompt(self.model, seq, starts[i] + a, hidden[row : row + b - a], self._decode_one)
                except EngineDeadError:
                    raise
                except Exception as e:
                    self._raise_if_fatal(e)
                    failed[i] = f"scoring the prompt failed: {e}"
                row += b - a
                if i in failed:
                    continue
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.computed_prompt_tokens_total += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += n - ks[i]  # drafts count once accepted (spec commit)
            self.block_manager.commit_full_blocks(seq)
        outputs = []
        for i, message in failed.items():
            self._fail(seqs[i], message)
            outputs.append(self._output(seqs[i]))
        for i, result in zip(sampling, sampled):
            seq = seqs[i]
            if seq.is_finished:  # failed while scoring its prompt
                continue
            if isinstance(result, str):
                self._fail(seq, result)
            else:
                try:
                    for token, lp in result:  # stops where plain decoding would
                        self._append_token(seq, token, lp)
                        if seq.is_finished:
                            break
                    if ks[i] and not seq.is_finished:  # all of result appended
                        self.spec.commit(seq, len(result))
                except Exception as e:
                    self._raise_if_fatal(e)
                    self._fail(seq, f"processing the sampled token failed: {e}")
            outputs.append(self._output(seq))
        if any(ks):
            self.spec.num_spec_steps += 1
            self.spec.verify_seconds += time.perf_counter() - t0
        for i, seq in enumerate(seqs):
            if done[i] and not sample_mask[i] and not seq.is_finished:  # max_tokens 0: prefill only
                self._finish(seq, "length")
                outputs.append(self._output(seq))
        return outputs

    def _forward(
        self, seqs: list[Sequence], counts: list[int], sample_mask: list[bool],
        prompt_rows: list[tuple[int, int]] | None, failed: dict[int, str],
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits of the sampled rows and hidden states of the prompt rows, in batch order, of the
        sequences whose forward succeeded. If the batched forward fails, each sequence is run
        alone (rewriting the same K/V is harmless) and the ones that fail again go to ``failed``."""
        try:
            return self._execute(self.runner.prepare(seqs, counts, sample_mask, prompt_rows), seqs, counts)
        except EngineDeadError:
            raise
        except Exception as e:
            self._raise_if_fatal(e)
            log.warning("the forward of %d sequences failed (%r); running them one by one", len(seqs), e)
        logits: list[torch.Tensor] = []
        hidden: list[torch.Tensor] = []
        for i, (seq, n) in enumerate(zip(seqs, counts)):
            try:
                rows = None if prompt_rows is None else [prompt_rows[i]]
                lg, hd = self._execute(self.runner.prepare([seq], [n], [sample_mask[i]], rows), [seq], [n])
            except EngineDeadError:
                raise
            except Exception as e:
                self._raise_if_fatal(e)
                failed[i] = f"the model's forward failed for this request: {e}"
                continue
            logits.append(lg)
            if hd is not None:
                hidden.append(hd)
        return (torch.cat(logits) if logits else None), (torch.cat(hidden) if hidden else None)

    def _execute(self, fb, seqs: list[Sequence], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.spec is not None:  # a draft module follows the target's forward (its cache, its features)
            return self.spec.execute(self.runner, fb, seqs, counts)
        return self.runner.execute_scoring(fb)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor | None) -> list[tuple | str]:
        """Per row: (token, logprobs) or the error message of a row whose sampling failed (the
        batch is re-sampled row by row to find it: ``sample_next`` leaves ``logits`` untouched)."""
        if not seqs:
            return []
        try:
            out = sample_next(logits, seqs, self.eos_token_ids)
            return list(zip(out.token_ids, out.logprobs))
        except EngineDeadError:
            raise
        except Exception as e:
            self._raise_if_fatal(e)
            log.warning("sampling %d rows failed (%r); sampling them one by one", len(seqs), e)
        results: list[tuple | str] = []
        for r, seq in enumerate(seqs):
            try:
                out = sample_next(logits[r : r + 1], [seq], self.eos_token_ids)
                results.append((out.token_ids[0], out.logprobs[0]))
            except Exception as e:
                self._raise_if_fatal(e)
                results.append(f"sampling failed for this request: {e}")
        return results

    def _raise_if_fatal(self, error: BaseException) -> None:
        if isinstance(error, EngineDeadError):
            raise error
        if is_device_fatal(error):
            raise EngineDeadError(f"the device failed, the engine cannot go on: {error}") from error

    def _fail(self, seq: Sequence, message: str) -> None:
        log.warning("request %s failed: %s", seq.request_id, message)
        seq.error = message
        self._finish(seq, "error")

    def _unschedulable(self) -> list[RequestOutput]:
        """Nothing fits although nothing runs: the head request exceeds the whole cache."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        seq = self.scheduler.waiting[0]
        self._finish(seq, "length")  # also releases its proposer state
        return [self._output(seq)]

    def _append_token(self, seq: Sequence, token: int, lp) -> None:
        now = time.time()
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.token_ids.append(token)
        self.generation_tokens_total += 1
        p = seq.params
        if p.constraint is not None:
            p.constraint.accept_token(token)
        if lp is not None and seq.logprobs is not None:
            seq.logprobs.append(logprob_entry(token, lp, self._decode_one))
        # detokenize (output_processor: the same code the API server runs for an engine-core process)
        stop_token = token in p.stop_token_ids
        is_eos = not p.ignore_eos and token in self.eos_token_ids
        if self.detokenize and append_text(self.tokenizer, seq, is_eos or stop_token):
            return self._finish(seq, "stop")
        if seq.num_output_tokens >= p.min_tokens:
            if is_eos:
                return self._finish(seq, "stop", token)
            if stop_token:
                return self._finish(seq, "stop", token)
        if p.constraint is not None and p.constraint.is_terminated():  # it accepts nothing more: min_tokens yields
            return self._finish(seq, "stop")
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return self._finish(seq, "length")
        if seq.num_tokens >= self.max_model_len:
            return self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, stop_token: int | None = None) -> None:
        seq.finish_reason = reason
        if stop_token is not None:
            seq.stop_reason = stop_token
        seq.finished_time = time.time()
        self.scheduler.finish(seq)
        if self.spec is not None:
            self.spec.release(seq)

    def _output(self, seq: Sequence) -> RequestOutput:
        finished = seq.status == SequenceStatus.FINISHED
        text, delta_text = visible_text(seq, finished)  # holds back a possible stop-string prefix
        delta_ids = seq.token_ids[seq.num_prompt_tokens + seq.emitted_token_len :]
        seq.emitted_token_len = seq.num_output_tokens
        if finished:
            self._seqs.pop(seq.request_id, None)
        out = CompletionOutput(
            index=0,
            text=text,
            token_ids=seq.output_token_ids,  # a fresh slice already
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
        )
        metrics = RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time, seq.finished_time)
        return RequestOutput(
            seq.request_id, seq.prompt, seq.prompt_token_ids, [out], finished,
            seq.num_cached_tokens, metrics, seq.prompt_logprobs, seq.error,
        )

    # ---- stats ----------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=bm.usage(),
            num_used_blocks=bm.num_used_blocks,
            num_total_blocks=bm.num_blocks,
            kv_cache_tokens=self.kv_cache_tokens,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            computed_prompt_tokens_total=self.computed_prompt_tokens_total,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prefix_cache_hit_rate=bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0,
            num_steps=self.num_steps,
            last_step_num_seqs=self._last[0],
            last_step_prefill_tokens=self._last[1],
            last_step_decode_tokens=self._last[2],
            weight_bytes_per_param=self.memory["weight_bytes_per_param"],
            kv_bytes_per_token=self.memory["kv_bytes_per_token"],
            quantized_weight_bytes_per_param=self.memory.get("quantized_weight_bytes_per_param", 0.0),
            **(self.spec.stats() if self.spec is not None else {}),
        )
