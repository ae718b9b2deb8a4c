"""Prometheus metrics of the server: latency histograms observed per request, engine gauges and
counters read from the engine's stats snapshot at scrape time. One registry per app, so several
servers can live in one process (tests). Beside our ``tokenfab_*`` names, the same measurements under vLLM's
``vllm:*`` names (``metrics_vllm.py``), which routers and endpoint pickers scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenfab.server.metrics_vllm import VllmEngineCollector, VllmLoraCollector, VllmRequestMetrics

PREFIX = "tokenfab"

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


# (kind, name after tokenfab_, help, the EngineStats field it reads; None: the server's own waiting count),
# in the order /metrics lists them
_ENGINE_SERIES: tuple[tuple[str, str, str, str | None], ...] = (
    ("gauge", "num_requests_running", "Sequences in the running batch.", "num_running"),
    ("gauge", "num_requests_waiting", "Sequences waiting to be scheduled (queued included).", None),
    ("gauge", "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", "kv_cache_usage"),
    ("gauge", "kv_cache_used_blocks", "KV cache blocks in use.", "num_used_blocks"),
    ("gauge", "kv_cache_total_blocks", "KV cache blocks in all.", "num_total_blocks"),
    ("gauge", "kv_cache_capacity_tokens", "Tokens the KV cache holds.", "kv_cache_tokens"),
    ("gauge", "weight_bytes_per_param",
     "Weight bytes per model parameter as held in memory.",
     "weight_bytes_per_param"),
    ("gauge", "kv_cache_bytes_per_token", "KV cache bytes per token.", "kv_bytes_per_token"),
    ("gauge", "quantized_weight_bytes_per_param",
     "Weight bytes per parameter of the quantized layers (FP8, INT4, FP4; scales included; 0 without any).",
     "quantized_weight_bytes_per_param"),
    ("gauge", "prefix_cache_hit_rate", "Prefix cache hit rate (blocks).", "prefix_cache_hit_rate"),
    ("counter", "prompt_tokens", "Prompt tokens received.", "prompt_tokens_total"),
    ("counter", "generation_tokens", "Tokens generated.", "generation_tokens_total"),
    ("counter", "computed_prompt_tokens",
     "Prompt tokens computed (prefix-cache misses).",
     "computed_prompt_tokens_total"),
    ("counter", "num_preemptions", "Sequences preempted for lack of KV cache.", "num_preemptions_total"),
    ("counter", "kv_offload_queries",
     "Prompt tokens looked up in the KV tier past the local prefix hit.",
     "kv_offload_queries_total"),
    ("counter", "kv_offload_hits",
     "Prompt tokens loaded from the KV tier instead of recomputed.",
     "kv_offload_hits_total"),
    ("counter", "kv_offload_misses",
     "Prompt tokens looked up in the KV tier and not found.",
     "kv_offload_misses_total"),
    ("counter", "kv_offload_saved_blocks",
     "Evicted KV blocks copied into the KV tier.",
     "kv_offload_saved_blocks_total"),
    ("counter", "kv_offload_loaded_blocks", "KV blocks loaded from the KV tier.", "kv_offload_loaded_blocks_total"),
    ("counter", "kv_offload_failed_blocks",
     "KV blocks the tier could not deliver (file gone or corrupt).",
     "kv_offload_failed_blocks_total"),
    ("counter", "kv_offload_spilled_blocks",
     "KV blocks moved from host memory to disk.",
     "kv_offload_spilled_blocks_total"),
    ("counter", "kv_offload_dropped_blocks",
     "KV blocks dropped from the tier (full).",
     "kv_offload_dropped_blocks_total"),
    ("gauge", "kv_offload_host_bytes", "Bytes of KV blocks held in host memory.", "kv_offload_host_bytes"),
    ("gauge", "kv_offload_disk_bytes", "Bytes of KV blocks held on disk.", "kv_offload_disk_bytes"),
    ("gauge", "kv_offload_host_blocks", "KV blocks held in host memory.", "kv_offload_host_blocks"),
    ("gauge", "kv_offload_disk_blocks", "KV blocks held on disk.", "kv_offload_disk_blocks"),
    ("counter", "engine_steps", "Model steps run.", "num_steps"),
    ("gauge", "last_step_num_seqs", "Sequences in the latest step's batch.", "last_step_num_seqs"),
    ("gauge", "last_step_prefill_tokens", "Prompt tokens in the latest step.", "last_step_prefill_tokens"),
    ("gauge", "last_step_decode_tokens", "Decode tokens in the latest step.", "last_step_decode_tokens"),
    ("counter", "spec_decode_num_draft_tokens", "Draft tokens verified.", "spec_draft_tokens_total"),
    ("counter", "spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_accepted_tokens_total"),
    ("gauge", "spec_decode_acceptance_rate", "Accepted / verified draft tokens.", "spec_acceptance_rate"),
    ("gauge", "spec_decode_mean_accepted_length",
     "Tokens emitted per verified sequence-step (accepted + 1).",
     "spec_mean_accepted_length"),
    ("counter", "spec_decode_draft_seconds", "Time spent proposing drafts.", "spec_draft_seconds_total"),
    ("counter", "spec_decode_verify_seconds",
     "Time in verify steps (forward + acceptance).",
     "spec_verify_seconds_total"),
)


class _EngineCollector(Collector):
    """Gauges and counters mirrored from the engine's latest stats (no locking on a step)."""

    def __init__(self, stats: Callable[[], Any], waiting: Callable[[], int], model: str) -> None:
        self._stats = stats
        self._waiting = waiting
        self._model = model

    def collect(self) -> Iterator[Metric]:
        s = self._stats()

        def get(name: str, default: float = 0.0) -> float:
            v = getattr(s, name, None) if s is not None else None
            return float(v) if v is not None else default

        labels = ["model_name"]
        lv = [self._model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)
            c.add_metric(lv, value)
            return c

        for kind, name, doc, key in _ENGINE_SERIES:
            value = float(self._waiting()) if key is None else get(key)
            yield (gauge if kind == "gauge" else counter)(name, doc, value)

class _LoraCollector(Collector):
    """Our LoRA series: the adapters the server serves, and per adapter its running and waiting sequences."""

    def __init__(self, stats: Callable[[], Any], adapters: Callable[[], list[str]], model: str) -> None:
        self._stats = stats
        self._adapters = adapters
        self._model = model

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        names = sorted(self._adapters())
        loaded = GaugeMetricFamily(f"{PREFIX}_lora_adapters_loaded", "LoRA adapters served (--lora-modules and "
                                   "/v1/load_lora_adapter).", labels=["model_name"])
        loaded.add_metric([self._model], float(len(names)))
        yield loaded
        for kind, doc in (("running", "in the running batch"), ("waiting", "waiting to be scheduled")):
            counts = getattr(s, f"{kind}_lora_adapters", None) or {}
            g = GaugeMetricFamily(f"{PREFIX}_lora_requests_{kind}", f"Sequences {doc}, per LoRA adapter.",
                                  labels=["model_name", "lora_name"])
            for name in sorted(set(names) | set(counts)):  # an unloaded adapter's requests still finish
                g.add_metric([self._model, name], float(counts.get(name, 0)))
            yield g


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], Any] | None = None,
                 waiting: Callable[[], int] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "Time per output token after the first (per request mean).",
                              labels, buckets=_TPOT_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "End-to-end request latency.",
                             labels, buckets=_E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.finished = Counter(f"{PREFIX}_request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.http_errors = Counter(f"{PREFIX}_request_errors", "Requests answered with an error status.",
                                   ["model_name", "status"], registry=self.registry)
        self.vllm = VllmRequestMetrics(self.registry, model_name, _TTFT_BUCKETS, _TPOT_BUCKETS, _E2E_BUCKETS)
        self._stats = stats
        if stats is not None:
            self.registry.register(_EngineCollector(stats, waiting or (lambda: 0), model_name))
            self.registry.register(VllmEngineCollector(stats, waiting or (lambda: 0), model_name))

    def register_lora(self, adapters: Callable[[], list[str]], max_loras: int) -> None:
        """With --enable-lora: vLLM's ``vllm:lora_requests_info`` and our ``tokenfab_lora_*`` series;
        ``adapters`` gives the names of the adapters served now."""
        if self._stats is not None:
            self.registry.register(VllmLoraCollector(self._stats, max_loras))
            self.registry.register(_LoraCollector(self._stats, adapters, self.model_name))

    # Hooks called on the engine thread (prometheus_client metrics are thread-safe).
    def on_first_token(self, ttft: float) -> None:
        self.ttft.observe(max(ttft, 0.0))
        self.vllm.on_first_token(max(ttft, 0.0))

    def on_finished(self, chunk: Any, num_generated: int) -> None:
        reason = chunk.finish_reason or "stop"
        self.finished.labels(self.model_name, reason).inc()
        e2e = tpot = None
        if chunk.finished_time is not None:
            e2e = max(chunk.finished_time - chunk.arrival_time, 0.0)
            self.e2e.observe(e2e)
            if chunk.first_token_time is not None and num_generated > 1:
                tpot = max(chunk.finished_time - chunk.first_token_time, 0.0) / (num_generated - 1)
                self.tpot.observe(tpot)
        self.vllm.on_finished(reason, e2e, tpot)

    def error(self, status: int) -> None:
        self.http_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
