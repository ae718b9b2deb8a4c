"""The same measurements under vLLM's Prometheus names, for what scrapes vLLM: llm-d's endpoint picker (the
Gateway API Inference Extension), vLLM's production-stack router and dashboards, HPAs on the queue length.

Names, types and labels are vLLM V1's (``vllm/v1/metrics/loggers.py``): every series carries ``model_name`` and
``engine`` (the engine core's index, "0" here: one core per server); prometheus_client appends ``_total`` to a
counter's name on the wire, as vLLM's own counters get it. Our own ``tokenfab_*`` series stay beside these.

============================================ ========= ==========================================================
series                                       type      from
============================================ ========= ==========================================================
vllm:num_requests_running                    gauge     sequences in the running batch
vllm:num_requests_waiting                    gauge     sequences waiting (queued included)
vllm:kv_cache_usage_perc                     gauge     fraction of KV blocks in use (0..1)
vllm:gpu_cache_usage_perc                    gauge     the same, vLLM V0's name (older pickers read it)
vllm:prefix_cache_queries_total              counter   prompt tokens looked up in the prefix cache
vllm:prefix_cache_hits_total                 counter   of which found
vllm:prompt_tokens_total                     counter   prompt tokens received
vllm:generation_tokens_total                 counter   tokens generated
vllm:num_preemptions_total                   counter   sequences preempted for lack of KV cache
vllm:external_prefix_cache_queries_total     counter   prompt tokens looked up in the KV tier (--kv-offload-bytes)
vllm:external_prefix_cache_hits_total        counter   of which loaded from it
vllm:request_success_total                   counter   finished requests, label ``finished_reason``
vllm:time_to_first_token_seconds             histogram per request
vllm:e2e_request_latency_seconds             histogram per request
vllm:time_per_output_token_seconds           histogram per request mean after the first token
vllm:request_time_per_output_token_seconds   histogram the same (vLLM's newer name)
vllm:lora_requests_info                      gauge     with --enable-lora: labels ``max_lora``,
                                                       ``running_lora_adapters``, ``waiting_lora_adapters``
============================================ ========= ==========================================================

``vllm:lora_requests_info`` is vLLM's: no ``model_name`` / ``engine`` labels; the adapters with running (waiting)
sequences joined by commas in the labels, ``max_lora`` the adapters one step may hold (``--max-loras``), the value
the time of the reading (Unix seconds), as vLLM's ``set_to_current_time``. vLLM keeps every label set it ever set,
and its readers (the inference gateway's endpoint picker) take the newest; we show only the current one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LABELS = ["model_name", "engine"]
ENGINE_INDEX = "0"


class VllmEngineCollector(Collector):
    """vLLM's engine gauges and counters, read from the engine's latest stats at scrape time."""

    def __init__(self, stats: Callable[[], Any], waiting: Callable[[], int], model: str) -> None:
        self._stats = stats
        self._waiting = waiting
        self._values = [model, ENGINE_INDEX]

    def collect(self) -> Iterator[Metric]:
        s = self._stats()

        def get(name: str) -> float:
            v = getattr(s, name, None) if s is not None else None
            return float(v) if v is not None else 0.0

        def family(kind: type, name: str, doc: str, value: float) -> Metric:
            m = kind(f"vllm:{name}", doc, labels=LABELS)
            m.add_metric(self._values, value)
            return m

        yield family(GaugeMetricFamily, "num_requests_running", "Number of requests in model execution batches.",
                     get("num_running"))
        yield family(GaugeMetricFamily, "num_requests_waiting", "Number of requests waiting to be processed.",
                     float(self._waiting()))
        usage = get("kv_cache_usage")
        yield family(GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield family(GaugeMetricFamily, "gpu_cache_usage_perc", "KV-cache usage (vLLM V0's name). 1 means 100 "
                     "percent usage.", usage)
        yield family(CounterMetricFamily, "prefix_cache_queries", "Prefix cache queries, in terms of number of "
                     "queried tokens.", get("prefix_cache_queries_total"))
        yield family(CounterMetricFamily, "prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                     "tokens.", get("prefix_cache_hits_total"))
        yield family(CounterMetricFamily, "prompt_tokens", "Number of prefill tokens processed.",
                     get("prompt_tokens_total"))
        yield family(CounterMetricFamily, "generation_tokens", "Number of generation tokens processed.",
                     get("generation_tokens_total"))
        yield family(CounterMetricFamily, "num_preemptions", "Cumulative number of preemption from the engine.",
                     get("num_preemptions_total"))
        yield family(CounterMetricFamily, "external_prefix_cache_queries", "External prefix cache queries from KV "
                     "connector cross-instance cache sharing, in terms of number of queried tokens.",
                     get("kv_offload_queries_total"))
        yield family(CounterMetricFamily, "external_prefix_cache_hits", "External prefix cache hits from KV "
                     "connector cross-instance cache sharing, in terms of number of cached tokens.",
                     get("kv_offload_hits_total"))


class VllmLoraCollector(Collector):
    """``vllm:lora_requests_info``, read from the engine's latest stats at scrape time."""

    def __init__(self, stats: Callable[[], Any], max_loras: int) -> None:
        self._stats = stats
        self._max_loras = str(max_loras)

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        running = getattr(s, "running_lora_adapters", None) or {}
        waiting = getattr(s, "waiting_lora_adapters", None) or {}
        m = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                              labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        m.add_metric([self._max_loras, ",".join(sorted(waiting)), ",".join(sorted(running))], time.time())
        yield m


class VllmRequestMetrics:
    """vLLM's per-request histograms and the finished-request counter, observed by ``ServerMetrics``' hooks."""

    def __init__(self, registry: CollectorRegistry, model_name: str, ttft_buckets: tuple[float, ...],
                 tpot_buckets: tuple[float, ...], e2e_buckets: tuple[float, ...]) -> None:
        values = (model_name, ENGINE_INDEX)
        self._values = values
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LABELS, buckets=ttft_buckets, registry=registry).labels(*values)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LABELS, buckets=e2e_buckets, registry=registry).labels(*values)
        self.tpot = [Histogram(name, "Histogram of time per output token in seconds (per request mean).", LABELS,
                               buckets=tpot_buckets, registry=registry).labels(*values)
                     for name in ("vllm:time_per_output_token_seconds",
                                  "vllm:request_time_per_output_token_seconds")]
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*LABELS, "finished_reason"], registry=registry)

    def on_first_token(self, ttft: float) -> None:
        self.ttft.observe(ttft)

    def on_finished(self, reason: str, e2e: float | None, tpot: float | None) -> None:
        self.success.labels(*self._values, reason).inc()
        if e2e is not None:
            self.e2e.observe(e2e)
        if tpot is not None:
            for h in self.tpot:
                h.observe(tpot)
