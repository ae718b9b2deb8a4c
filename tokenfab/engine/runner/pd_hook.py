"""The engine's side of prefill/decode disaggregation (``--kv-transfer-config``): what ``LLMEngine`` calls when a
request arrives, is aborted, or finishes, with ``engine/kv_transfer/pd_connector.py`` doing the moving.

- A request with ``kv_transfer_params.do_remote_decode`` (the router's prefill leg) on a producer is tracked; when
  it finishes, its prompt's full blocks are staged for the consumer and its output carries the parameters.
- A request with ``kv_transfer_params.do_remote_prefill`` (the decode leg, carrying the producer's answer) on a
  consumer is *parked*: not queued in the scheduler while the fetch thread (``kv_transfer/pd_fetcher.py``) reads
  its blocks, so the streams already running keep stepping. At the start of each step the engine queues the
  parked requests whose reads ended (``admit_ready``); the block manager's admission then loads their blocks from
  the connector as from any KV tier (the consumer is the block manager's connector). A read that failed, or a
  request parked past ``transfer_timeout_s`` (its read still queued or stuck), is queued all the same and
  prefilled locally. Parked requests count as unfinished (the engine loop keeps stepping); aborting one cancels
  its read and gives up its blocks.
- On a CPU, a decode leg whose blocks came over computes the rest of its prompt (up to a block) at most
  ``TAIL_TOKENS_PER_STEP`` tokens a step while other sequences decode (``Sequence.max_prefill_chunk``): there a
  step costs a fixed part plus about as much per token, so a 15-token tail in one step would be a decode gap
  several times the usual; alone, it is computed at once.
- Parameters on an instance started without ``--kv-transfer-config``, or asking a role it was not given, are a
  ValueError (a 400): a prefill leg that silently decoded everything would hide a misconfigured fleet.
"""

from __future__ import annotations

import importlib
import logging
import time
from typing import Any

from tokenfab.engine.kv_transfer.pd_fetcher import BackgroundFetcher, FetchJob
from tokenfab.engine.kv_transfer.pd_params import check_params
from tokenfab.engine.kv_transfer.transfer_config import KVTransferConfig
from tokenfab.engine.requests.block_manager import BlockManager, hash_block, root_digest
from tokenfab.engine.requests.outputs import RequestOutput
from tokenfab.engine.requests.sequence import Sequence, SequenceStatus
from tokenfab.engine.runner.kv_offload import runner_block_io
from tokenfab.engine.runner.model_runner import ModelRunner

log = logging.getLogger("tokenfab")

#: how long a step with nothing to run waits for a parked request's read (the loop neither spins nor stalls)
PARKED_WAIT_S = 0.005
#: a parked request is queued (and prefilled locally) this long after its read's own timeout, whatever the read does
PARK_GRACE_S = 1.0
#: prompt tokens a transferred decode leg computes per step while others decode, on a CPU (see above)
TAIL_TOKENS_PER_STEP = 1


def prompt_digests(seq: Sequence, block_size: int, num_tokens: int) -> list[bytes]:
    """The prefix-cache digests of the full blocks within ``seq``'s first ``num_tokens`` tokens, computed as the
    block manager computes them (salt and adapter in the root)."""
    lora = seq.lora_request.lora_int_id if seq.lora_request is not None else 0
    parent = root_digest(seq.cache_salt, lora)
    out = []
    for i in range(num_tokens // block_size):
        parent = hash_block(parent, seq.token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


def refuse_params(seq: Sequence) -> None:
    """An engine without --kv-transfer-config: kv_transfer_params are a ValueError, unless they ask for nothing."""
    params = check_params(seq.params.kv_transfer_params)
    if params is not None and (params.get("do_remote_decode") or params.get("do_remote_prefill")):
        raise ValueError("kv_transfer_params: this instance was started without --kv-transfer-config")


class PDHook:
    def __init__(self, cfg: KVTransferConfig, connector: Any, block_manager: BlockManager) -> None:
        self.cfg = cfg
        self.connector = connector  # pd_connector.PDConnector
        self.bm = block_manager
        self._producing: dict[str, Sequence] = {}  # request id -> a prefill leg to stage when it finishes
        # request id -> (a parked decode leg, its read, the monotonic time it is queued regardless)
        self._parked: dict[str, tuple[Sequence, FetchJob, float]] = {}
        self.fetcher = BackgroundFetcher() if cfg.is_consumer else None
        self.throttle_tails = False  # pd_hook_for: on a CPU
        self._tails: list[Sequence] = []  # admitted decode legs with transferred blocks, prompt not done

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def on_add(self, seq: Sequence) -> bool:
        """Check the request's parameters (ValueError naming the field). True when the request is parked (a decode
        leg whose blocks are being read): the engine queues it later, from ``admit_ready``."""
        params = check_params(seq.params.kv_transfer_params)
        if params is None:
            return False
        if params.get("do_remote_decode"):
            if not self.cfg.is_producer:
                raise ValueError(f"kv_transfer_params.do_remote_decode: this instance is a {self.cfg.kv_role}")
            self._producing[seq.request_id] = seq
        elif params.get("do_remote_prefill"):
            if not self.cfg.is_consumer:
                raise ValueError(f"kv_transfer_params.do_remote_prefill: this instance is a {self.cfg.kv_role}")
            if self.bm.enable_prefix_caching and self.fetcher is not None:  # else prefill locally
                job = self._fetch_job(seq, params)
                deadline = time.monotonic() + self.cfg.transfer_timeout_s + PARK_GRACE_S
                self._parked[seq.request_id] = (seq, job, deadline)
                self.fetcher.submit(job)
                return True
        return False

    def _fetch_job(self, seq: Sequence, params: dict[str, Any]) -> FetchJob:
        """The read of ``seq``'s blocks, run on the fetch thread (digests included: a long prompt's hashing is
        CPU time the engine thread does not spend). A parked sequence's tokens do not change."""
        digests: list[bytes] = []

        def run() -> int:
            digests.extend(prompt_digests(seq, self.bm.block_size, seq.num_tokens - 1))
            return self.connector.fetch(params, digests)

        return FetchJob(seq.request_id, run, lambda: self.connector.drop(digests))

    def admit_ready(self, idle: bool, running: list[Sequence]) -> list[Sequence]:
        """The parked requests to queue now: their reads ended (blocks held, or failed: prefilled locally), or
        they waited past their deadline. ``idle`` (nothing else to run): wait a little for a read first.
        ``running``: the scheduler's, for the tails' chunk limit."""
        if self._tails:
            self._limit_tails(running)
        if not self._parked:
            return []
        if idle:
            self.fetcher.wait(PARKED_WAIT_S)
        ready = []
        for job in self.fetcher.take_done():
            entry = self._parked.get(job.request_id)
            if entry is None or entry[1] is not job:  # aborted after its read ended
                if job.blocks:
                    job.drop()
                continue
            del self._parked[job.request_id]
            ready.append(entry[0])
            if job.blocks and self.throttle_tails:
                self._tails.append(entry[0])
                self._limit_tails(running)
        now = time.monotonic()
        for rid, (seq, job, deadline) in list(self._parked.items()):
            if now >= deadline:
                log.warning("KV transfer for request %s not done %.1f s after it arrived: prefilling locally",
                            rid, self.cfg.transfer_timeout_s + PARK_GRACE_S)
                job.cancelled.set()  # a read still to run is skipped; one under way gives its blocks up
                del self._parked[rid]
                ready.append(seq)
        return ready

    def _limit_tails(self, running: list[Sequence]) -> None:
        """Each step: the tails still to compute get ``TAIL_TOKENS_PER_STEP`` when another sequence decodes. One
        that has more than a block to compute (a block evicted before it loaded, a preemption) is let go."""
        decoding = any(s.is_decoding for s in running)
        tails = []
        for seq in self._tails:
            left = seq.num_prompt_tokens - seq.num_computed_tokens
            short = seq.num_preemptions == 0 and (seq.status != SequenceStatus.RUNNING or left <= self.bm.block_size)
            if seq.is_finished or left <= 0 or not short:
                seq.max_prefill_chunk = None
                continue
            seq.max_prefill_chunk = TAIL_TOKENS_PER_STEP if decoding else None
            tails.append(seq)
        self._tails = tails

    def on_abort(self, request_id: str) -> None:
        self._producing.pop(request_id, None)
        entry = self._parked.pop(request_id, None)
        if entry is not None:
            entry[1].cancelled.set()  # skipped if not started; dropped when its read ends if under way

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """After a step: the finished prefill legs' blocks staged, their outputs given the parameters. Runs before
        the next schedule, so blocks freed by this step still hold their data."""
        if self.cfg.is_producer:
            self.connector.poll()
        for out in outputs:
            if not out.finished:
                continue
            seq = self._producing.pop(out.request_id, None)
            if seq is None or out.error is not None:
                continue
            digests, blocks = [], []
            for d in seq.block_hashes[:seq.num_prompt_tokens // self.bm.block_size]:
                block = self.bm.cached.get(d)  # the prompt's blocks, freed at finish, still cached
                if block is None:
                    break
                digests.append(d)
                blocks.append(block)
            out.kv_transfer_params = self.connector.publish(digests, blocks)

    def close(self) -> None:
        if self.fetcher is not None:
            self.fetcher.close()  # joins the thread (a read under way ends within its timeout)
        self.connector.close()


def pd_hook_for(args: Any, runner: ModelRunner, block_manager: BlockManager, speculative: bool) -> PDHook | None:
    """The hook for ``args.kv_transfer_config``, or None when it is not set. ValueError for a bad config or a
    combination not supported yet; the consumer becomes the block manager's connector."""
    cfg = KVTransferConfig.parse(getattr(args, "kv_transfer_config", None))
    if cfg is None:
        return None
    refused = [(args.tensor_parallel_size != 1, "--tensor-parallel-size > 1 (each rank holds a shard of a block)"),
               (speculative, "--speculative-config (the draft's cache is not transferred)"),
               (bool(getattr(args, "async_scheduling", False)), "--async-scheduling (the next step may overwrite a "
                "finished prompt's blocks before they are staged)"),
               (not args.enable_prefix_caching, "prefix caching off (blocks are found by their prefix digests)"),
               (block_manager.connector is not None, "--kv-offload-bytes / --kv-offload-dir (one connector)"),
               (bool(runner.state_caches), "a model with recurrent-state layers (the hybrid cache's states and "
                "token rings are not transferred, only paged KV blocks)")]
    for bad, what in refused:
        if bad:
            raise ValueError(f"--kv-transfer-config with {what} is not supported yet")
    # NIXL is an optional dependency, imported only by instances that use it
    connector_module = importlib.import_module("tokenfab.engine.kv_transfer.pd_connector")
    connector = connector_module.PDConnector(cfg, runner_block_io(runner), block_manager.block_size)
    if cfg.is_consumer:
        block_manager.connector = connector
    hook = PDHook(cfg, connector, block_manager)
    hook.throttle_tails = runner.device.type == "cpu"
    return hook
