"""The engine's stats snapshot (``LLMEngine.get_stats``): read by the server's /metrics, the
engine-core client (field by field over IPC) and the benchmarks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenfab.engine.requests.sequence import Sequence


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_used_blocks: int
    num_total_blocks: int
    kv_cache_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    computed_prompt_tokens_total: int
    num_preemptions_total: int
    prefix_cache_hit_rate: float
    num_steps: int
    last_step_num_seqs: int
    last_step_prefill_tokens: int
    last_step_decode_tokens: int
    weight_bytes_per_param: float = 0.0  # as stored (packed GGUF rows: ~0.6-1.1)
    kv_bytes_per_token: float = 0.0
    quantized_weight_bytes_per_param: float = 0.0  # the tokenfab.quant layers alone (FP8 ~1, 4-bit ~0.5)
    # speculative decoding (0 when off): drafts verified / accepted, sequence-steps that verified,
    # accepted / drafted, tokens per verified sequence-step, seconds proposing / verifying
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_verified_total: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0
    spec_draft_seconds_total: float = 0.0
    spec_verify_seconds_total: float = 0.0
    # prefix cache, in prompt tokens: looked up / found (vLLM's prefix_cache_queries / prefix_cache_hits)
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    # multi-LoRA: sequences per adapter name, running and waiting (vLLM's vllm:lora_requests_info; empty when off)
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    # the KV tier beyond the device (--kv-offload-bytes; all 0 when off): prompt tokens looked up there past the
    # local prefix hit / found and loaded / not found (vLLM's external_prefix_cache_queries / _hits), blocks
    # loaded, saved, not delivered by a load, moved host -> disk, forgotten; blocks and bytes held now
    kv_offload_queries_total: int = 0
    kv_offload_hits_total: int = 0
    kv_offload_misses_total: int = 0
    kv_offload_loaded_blocks_total: int = 0
    kv_offload_saved_blocks_total: int = 0
    kv_offload_failed_blocks_total: int = 0
    kv_offload_spilled_blocks_total: int = 0
    kv_offload_dropped_blocks_total: int = 0
    kv_offload_host_blocks: int = 0
    kv_offload_host_bytes: int = 0
    kv_offload_disk_blocks: int = 0
    kv_offload_disk_bytes: int = 0


def lora_adapter_counts(running: Iterable[Sequence], waiting: Iterable[Sequence],
                        stepped: frozenset[int]) -> tuple[dict[str, int], dict[str, int]]:
    """Sequences per adapter name, (running, waiting): a running sequence whose adapter was not in the latest
    step (``stepped``: lora_int_ids; --max-loras held it back) counts as waiting, as in vLLM, where it would not
    have left the waiting queue. The base model's sequences are not counted."""
    run: Counter[str] = Counter()
    wait: Counter[str] = Counter()
    for s in running:
        if s.lora_request is not None:
            (run if s.lora_request.lora_int_id in stepped else wait)[s.lora_request.lora_name] += 1
    wait.update(s.lora_request.lora_name for s in waiting if s.lora_request is not None)
    return dict(run), dict(wait)
