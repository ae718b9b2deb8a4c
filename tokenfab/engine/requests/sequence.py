"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time

from tokenfab.engine.requests.lora_request import LoRARequest
from tokenfab.engine.requests.outputs import Logprob
from tokenfab.engine.requests.sampling_params import SamplingParams

# Requests at this priority (the largest the engine takes; the Batches worker submits at it) are background
# work, whatever the scheduling policy: they run only in the sequence slots, KV blocks and step tokens that
# online requests leave, and are preempted to make room for them (engine/requests/scheduler.py).
BACKGROUND_PRIORITY = 2**31 - 1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One generation stream: its tokens, how many of them have KV in the cache, its blocks."""

    lora_request: LoRARequest | None = None  # multi-LoRA: the adapter it runs with (None: the base model)

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        base_seed: int,
        priority: int = 0,
        arrival_index: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids: list[int] = list(prompt_token_ids)
        # one copy, handed to every step's output (not re-sliced per step: prompts can be long)
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.base_seed = base_seed
        self.priority = priority
        self.arrival_index = arrival_index
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V sit in the cache
        self.block_table: list[int] = []
        # hybrid cache: this sequence's row in the recurrent-state tensors (-1: none; requests/state_slots.py)
        self.state_slot = -1
        # hybrid prefix caching: the snapshot row to copy into the slot before the first chunk (-1: none)
        self.state_restore_row = -1
        # and the end of its cached KV prefix when no snapshot reached it: a chunk ends there once, so its
        # state there is saved and the next prompt sharing that prefix hits it (0: none)
        self.state_cut_at = 0
        self.block_hashes: list[bytes] = []  # chained digests of the full blocks, in order
        self.num_committed_blocks = 0  # leading blocks of block_table already offered to the prefix cache
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        # the most prompt tokens one step computes for this sequence (None: the budget's); a P/D decode leg's
        # tail rides along others' decode steps a token at a time (engine/runner/pd_hook.py)
        self.max_prefill_chunk: int | None = None
        # whether the sampler must edit this request's logits at every step (min_tokens aside)
        self.edits_logits = bool(
            params.logit_bias or params.presence_penalty or params.frequency_penalty
            or params.repetition_penalty != 1.0 or params.constraint is not None
        )
        self.cache_salt = cache_salt  # mixed into the first block's prefix-cache digest
        self.num_preemptions = 0
        # overlap scheduling: the token being sampled is this request's last by count (max_tokens or
        # the context length), so no further step is scheduled for it (engine/overlap.py)
        self.length_capped = False
        # speculative decoding: draft tokens verified in this step after the known tokens (tokenfab/speculative)
        self.spec_token_ids: list[int] = []
        self.error: str | None = None  # set when the request failed inside a step
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        # one entry per prompt token, filled chunk by chunk by the prefill (entry 0 stays None)
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        # detokenization state
        self.output_text = ""
        self.emitted_text_len = 0
        self.emitted_token_len = 0
        self.prefix_offset = max(len(prompt_token_ids) - 6, 0)
        self.read_offset = len(prompt_token_ids)
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower runs first: priority, then arrival (FCFS)."""
        return (self.priority, self.arrival_index)

    @property
    def is_background(self) -> bool:
        return self.priority >= BACKGROUND_PRIORITY

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """All known tokens but the last have their K/V cached: the next step is a decode."""
        return self.num_computed_tokens == self.num_tokens - 1 and self.num_output_tokens > 0
