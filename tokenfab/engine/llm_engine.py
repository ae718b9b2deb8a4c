"""The engine: requests in, a model step at a time, incremental outputs out."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from tokenfab.distributed import two_batch
from tokenfab.engine.args import EngineArgs, background_limits
from tokenfab.engine.forwarded import Forwarded
from tokenfab.engine.intake import RequestIntake, RequestLimits, tokenize_prompt
from tokenfab.engine.overlap import OverlapScheduler
from tokenfab.engine.postprocess import Postprocessor
from tokenfab.engine.requests.block_manager import BlockManager
from tokenfab.engine.requests.errors import raise_if_fatal
from tokenfab.engine.requests.kv_event_publisher import attach_publisher
from tokenfab.engine.requests.lora_request import LoRARequest
from tokenfab.engine.requests.outputs import RequestOutput
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.scheduler import ScheduledBatch, Scheduler
from tokenfab.engine.requests.sequence import Sequence
from tokenfab.engine.requests.state_slots import StateSlots
from tokenfab.engine.requests.state_snapshots import StateSnapshots
from tokenfab.engine.requests.stats import EngineStats, lora_adapter_counts
from tokenfab.engine.runner.cpu_threads import configure_engine_threads
from tokenfab.engine.runner.device_setup import (  # noqa: F401 (resolve_*, tune_cpu_allocator: imported from here)
    log_memory_figures,
    maybe_pack_cpu_weights,
    physical_memory_bytes,
    resolve_device,
    resolve_dtype,
    tune_cpu_allocator,
)
from tokenfab.engine.runner.isolation import isolated_forward, isolated_sample
from tokenfab.engine.runner.kv_budget import kv_cache_blocks
from tokenfab.engine.runner.kv_offload import offload_connector_for, offload_stats
from tokenfab.engine.runner.lora_manager import LoRAManager, lora_manager_for
from tokenfab.engine.runner.model_runner import ModelRunner, kv_bytes_per_token
from tokenfab.engine.runner.pd_hook import pd_hook_for, refuse_params
from tokenfab.engine.runner.prompt_logprobs import prompt_rows_of, score_prompt
from tokenfab.engine.runner.state_cache import num_state_slots_for, state_bytes_per_slot, state_cache_bytes
from tokenfab.executors.eplb_engine import EplbConfig, EplbController
from tokenfab.executors.tp_executor import start_tensor_parallel
from tokenfab.forward_batch import ForwardBatch
from tokenfab.loader.model_loader import config_max_len, load_model, text_config
from tokenfab.quant.kv_fp8 import configure_kv_cache
from tokenfab.speculative.config import SpeculativeConfig
from tokenfab.speculative.step import SpecDecoder
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
        self.cpu_threads = None  # CPU: the thread plan (engine/runner/cpu_threads.py); rank 0 takes slice 0
        if resolve_device(args.device).type == "cpu":
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", args.tensor_parallel_size))  # torchrun: this node's
            self.cpu_threads = configure_engine_threads(args.cpu_threads, (0, local_ranks))
        if args.tensor_parallel_size != 1:
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
        self.lora: LoRAManager | None = lora_manager_for(args, self.model, self.device, self.dtype)  # --enable-lora
        self.lora_targets = self.lora.targets if self.lora is not None else None  # API servers check adapters
        copies = maybe_pack_cpu_weights(self.model, self.device, args.cpu_weight_packing)
        configure_kv_cache(self.model, args.kv_cache_dtype, args.kv_cache_dtype_skip_layers)  # FP8 KV layers
        two_batch.configure_from_args(args)  # --enable-two-batch-overlap (every TP rank does the same)
        self.memory = log_memory_figures(self.model, self.dtype, copies)
        # hybrid cache: per-sequence recurrent-state slots beside the paged KV (0: none; docs/hybrid-cache.md)
        self.num_state_slots = num_state_slots_for(self.model, args.num_state_slots, args.max_num_seqs,
                                                   args.tensor_parallel_size,
                                                   spec_config.num_speculative_tokens if spec_config else 0)
        # their prefix caching: state snapshots at block boundaries (0: prefix caching off for this model)
        snapshots = args.num_state_snapshots if args.num_state_snapshots is not None else self.num_state_slots
        self.num_state_snapshots = snapshots if self.num_state_slots and args.enable_prefix_caching else 0
        self.spec = None  # speculative decoding (tokenfab/speculative/step.py); a draft module loads here
        if spec_config is not None:
            self.spec = SpecDecoder(spec_config, self)
        draft = self.spec.kv_bytes_per_token() if self.spec is not None else 0  # same blocks, more bytes
        per_token = kv_bytes_per_token(self.model, self.dtype, args.block_size)  # per-block caches: by block size
        num_blocks = kv_cache_blocks(args, per_token + draft, self.device,
                                     self.max_model_len, self._make_runner,
                                     state_cache_bytes(self.model, self.num_state_slots)
                                     + self.num_state_snapshots * state_bytes_per_slot(self.model))
        self.runner = self._make_runner(args.block_size, num_blocks)
        if spec_config is not None:  # verify rows must round as decode rows do (kernels/batch_invariant.py)
            self.runner.batch_invariant = True
            self.spec.bind_cache(args.block_size, num_blocks)  # the draft's cache: the target's blocks
        if self.device.type == "cuda" and not args.enforce_eager:
            self.runner.capture_decode_graphs(min(args.max_num_seqs, 256), self.max_model_len)
        prefix_caching = args.enable_prefix_caching
        if prefix_caching and self.num_state_slots and not self.num_state_snapshots:
            prefix_caching = False
            log.info("prefix caching is off: this model keeps recurrent state per sequence, which cached KV "
                     "blocks cannot rebuild, and --num-state-snapshots is 0 (docs/hybrid-cache.md)")
        self.block_manager = BlockManager(num_blocks, args.block_size, prefix_caching,
                                          StateSlots(self.num_state_slots) if self.num_state_slots else None)
        if self.num_state_snapshots:
            self.block_manager.state_snapshots = StateSnapshots(self.num_state_snapshots)
            self.runner.attach_state_snapshots(self.block_manager.state_snapshots)
            log.info("prefix caching with %d recurrent-state snapshots at block boundaries (%.1f MiB)",
                     self.num_state_snapshots, self.num_state_snapshots * state_bytes_per_slot(self.model) / 2**20)
        self.kv_events = attach_publisher(self.block_manager, args.kv_events_config)  # None: events off
        # --kv-offload-bytes / --kv-offload-dir: evicted prefix blocks kept beyond the device (None: off)
        self.kv_connector = offload_connector_for(args, self.runner, spec_config is not None)
        self.block_manager.connector = self.kv_connector
        # --kv-transfer-config: prefill/decode disaggregation (engine/runner/pd_hook.py; None: off)
        self.kv_transfer = pd_hook_for(args, self.runner, self.block_manager, spec_config is not None)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, args.max_num_batched_tokens,
                                   args.background_prefill_share, *background_limits(args, self.device.type))
        self.kv_cache_tokens = num_blocks * args.block_size
        self.intake = RequestIntake(self.tokenizer, RequestLimits(self.vocab_size, self.max_model_len,
                                                                  self.kv_cache_tokens), self.scheduling_policy)
        self._seqs: dict[str, Sequence] = {}
        self.prompt_tokens_total = 0
        self.post = Postprocessor(self.scheduler, self.block_manager, self.spec, self.tokenizer, args.detokenize,
                                  self.eos_token_ids, self.max_model_len, self._seqs)
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
        return ModelRunner(self.model, self.device, self.dtype, block_size, num_blocks, self.num_state_slots)

    def _make_eplb(self, args: EngineArgs) -> EplbController | None:
        cfg = EplbConfig.parse(args.eplb_config)
        if cfg is None:
            return None
        try:
            return EplbController(cfg, self.model, self.tp.send_eplb if self.tp is not None else None)
        except ValueError:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (if any) and the KV-event publisher; the engine serves nothing after
        this."""
        if self.tp is not None:
            self.tp.shutdown()
        if getattr(self, "kv_events", None) is not None:
            self.kv_events.close()
        if getattr(self, "kv_connector", None) is not None:
            self.kv_connector.close()
        if getattr(self, "kv_transfer", None) is not None:
            self.kv_transfer.close()

    # ---- requests -------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Everything that makes a request unservable by this model, checked before it is queued
        (pure, any thread; ``engine/intake.py``). Raises ValueError naming the parameter."""
        self.intake.limits.check(prompt_token_ids, params)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; ValueError with a clear message (and nothing queued) if it cannot be
        served. ``priority`` counts only under the "priority" scheduling policy (lower runs first);
        requests with different ``cache_salt`` (or adapters) never share prefix-cache blocks.
        ``prompt_token_ids``: the text prompt's ids when the caller tokenized it already.
        ``lora_request``: the LoRA adapter to run with (``--enable-lora``)."""
        params = params or SamplingParams()
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = self.intake.new_sequence(request_id, prompt, params, priority, arrival_time, cache_salt,
                                       prompt_token_ids)
        if lora_request is not None:
            if self.lora is None:
                raise ValueError("lora_request: this engine was started without --enable-lora")
            self.lora.admit(lora_request)  # read now: a bad adapter is refused before it is queued
            seq.lora_request = lora_request
        parked = False
        if self.kv_transfer is not None:
            parked = self.kv_transfer.on_add(seq)  # a decode leg waits for its blocks off the queue (pd_hook.py)
        else:
            refuse_params(seq)
        self._seqs[request_id] = seq
        self.prompt_tokens_total += seq.num_prompt_tokens
        if not parked:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        if self.kv_transfer is not None:
            self.kv_transfer.on_abort(request_id)
        seq = self._seqs.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq)
            seq.finish_reason = "abort"
            if self.spec is not None:
                self.spec.release(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or (self.kv_transfer is not None and self.kv_transfer.num_parked > 0)

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
                self.eplb.on_steps(self.post.num_steps)
            except Exception as e:
                if self.tp is None:
                    raise
                raise self.tp._dead_error(e) from e  # the workers may be stuck in a collective
        if self.kv_transfer is not None:  # decode legs whose blocks arrived (waits briefly if nothing else runs)
            for seq in self.kv_transfer.admit_ready(not self.scheduler.has_unfinished(), self.scheduler.running):
                self.scheduler.add(seq)
        if self._overlap is not None:
            return self._overlap.step()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)  # drafts ride in the batch the scheduler builds
        batch = self.scheduler.schedule()
        if self.lora is not None:
            self.lora.limit_batch(batch)  # at most --max-loras adapters a step; the others wait
        outputs = self.post.unschedulable() if batch.empty else self.run_batch(batch)
        if self.kv_transfer is not None:
            self.kv_transfer.on_outputs(outputs)  # finished prefill legs staged before the next schedule
        return outputs

    def run_batch(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Forward, sample and process one scheduled batch, synchronously."""
        seqs, counts, post = batch.seqs, batch.num_new_tokens, self.post
        if self.spec is not None:  # a draft model's tokens, now that their blocks are allocated
            self.spec.fill_drafts(seqs)
        now, t0 = time.time(), time.perf_counter()
        starts = [s.num_computed_tokens for s in seqs]
        ks = [len(s.spec_token_ids) for s in seqs]  # speculative drafts verified after the known tokens
        # a chunk that reaches the end of the known tokens yields the next token (max_tokens 0: none)
        done = [st + n - k == s.num_tokens for s, st, n, k in zip(seqs, starts, counts, ks)]
        sample_mask = [d and s.params.max_tokens != 0 for s, d in zip(seqs, done)]
        prompt_rows = [prompt_rows_of(s, st, n) for s, st, n in zip(seqs, starts, counts)]
        scoring = any(b > a for a, b in prompt_rows)
        failed: dict[int, str] = {}  # batch index -> why that sequence failed
        logits, hidden = isolated_forward(self.runner, self._execute, seqs, counts, sample_mask,
                                          prompt_rows if scoring else None, failed)
        # the rows of logits (and hidden) are those of the sequences that did not fail, in order
        sampling = [i for i, m in enumerate(sample_mask) if m and i not in failed]
        if any(ks):  # per sequence: the accepted drafts and the target's token
            sampled = self.spec.sample([seqs[i] for i in sampling], logits)
        else:
            rows = isolated_sample(logits, [seqs[i] for i in sampling], self.eos_token_ids)
            sampled = [r if isinstance(r, str) else [r] for r in rows]
        post.count_step(batch)
        self._book(batch, starts, ks, prompt_rows, hidden, now, failed)
        outputs = []
        for i, message in failed.items():
            post.fail(seqs[i], message)
            outputs.append(post.output(seqs[i]))
        for i, result in zip(sampling, sampled):
            if not seqs[i].is_finished:  # (else it failed while scoring its prompt)
                post.append_sampled(seqs[i], result, ks[i])
                outputs.append(post.output(seqs[i]))
        if any(ks):
            self.spec.num_spec_steps += 1
            self.spec.verify_seconds += time.perf_counter() - t0
        for i, seq in enumerate(seqs):
            if done[i] and not sample_mask[i] and not seq.is_finished:  # max_tokens 0: prefill only
                post.finish(seq, "length")
                outputs.append(post.output(seq))
        return outputs

    def _book(self, batch: ScheduledBatch, starts: list[int], ks: list[int], prompt_rows: list[tuple[int, int]],
              hidden: torch.Tensor | None, now: float, failed: dict[int, str]) -> None:
        """Per sequence whose forward succeeded: its prompt rows scored (prompt logprobs), then its
        computed tokens booked (speculative drafts count once accepted: ``SpecDecoder.commit``)."""
        row = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            if i in failed:
                continue
            a, b = prompt_rows[i]
            if b > a:
                try:
                    score_prompt(self.model, seq, starts[i] + a, hidden[row : row + b - a], self.post.decode_one)
                except Exception as e:
                    raise_if_fatal(e)
                    failed[i] = f"scoring the prompt failed: {e}"
                row += b - a
                if i in failed:
                    continue
            self.post.book_computed(seq, n - ks[i])

    def _execute(self, fb: ForwardBatch, seqs: list[Sequence], counts: list[int]) -> tuple[torch.Tensor, Any]:
        """The target's forward: (logits of the sampled rows, hidden states of the prompt rows)."""
        if self.spec is not None:  # a draft module follows the target's forward (its cache, its features)
            return self.spec.execute(self.runner, fb, seqs, counts)
        if self.lora is not None:  # a step with adapters: their deltas, through the Python layers
            return self.lora.execute(self.runner, fb, seqs, counts, lambda fb, *_: self.runner.execute_scoring(fb))
        return self.runner.execute_scoring(fb)

    # ---- stats ----------------------------------------------------------------------
    num_steps: Forwarded[int] = Forwarded("post.num_steps")
    generation_tokens_total: Forwarded[int] = Forwarded("post.generation_tokens_total")
    computed_prompt_tokens_total: Forwarded[int] = Forwarded("post.computed_prompt_tokens_total")

    def get_stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + (self.kv_transfer.num_parked if self.kv_transfer else 0),
            kv_cache_usage=bm.usage(),
            num_used_blocks=bm.num_used_blocks,
            num_total_blocks=bm.num_blocks,
            kv_cache_tokens=self.kv_cache_tokens,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.post.generation_tokens_total,
            computed_prompt_tokens_total=self.post.computed_prompt_tokens_total,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prefix_cache_hit_rate=bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0,
            prefix_cache_queries_total=bm.prefix_queries,
            prefix_cache_hits_total=bm.prefix_hits,
            num_steps=self.post.num_steps,
            last_step_num_seqs=self.post.last_step[0],
            last_step_prefill_tokens=self.post.last_step[1],
            last_step_decode_tokens=self.post.last_step[2],
            weight_bytes_per_param=self.memory["weight_bytes_per_param"],
            kv_bytes_per_token=self.memory["kv_bytes_per_token"],
            quantized_weight_bytes_per_param=self.memory.get("quantized_weight_bytes_per_param", 0.0),
            **(self.spec.stats() if self.spec is not None else {}),
            **offload_stats(bm),
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict[str, dict[str, int]]:
        """Sequences per adapter, running and waiting (vllm:lora_requests_info); none without --enable-lora."""
        if self.lora is None:
            return {}
        running, waiting = lora_adapter_counts(self.scheduler.running, self.scheduler.waiting,
                                               self.lora.last_step_ids)
        return {"running_lora_adapters": running, "waiting_lora_adapters": waiting}
