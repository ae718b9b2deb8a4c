"""/metrics under vLLM's names (``server/metrics_vllm.py``), scraped from the live server on the bundled model and
parsed with prometheus_client's own parser: the series llm-d's endpoint picker and vLLM's production stack read,
with vLLM's labels, moving with the work done and agreeing with our own ``tokenfab_*`` series."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

VLLM_ENGINE_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                      "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                      "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total")


def scrape(http) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of /metrics by its name: [(labels, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def one(samples, name: str, **labels: str) -> float:
    values = [v for lb, v in samples[name] if all(lb.get(k) == x for k, x in labels.items())]
    assert len(values) == 1, (name, labels, samples[name])
    return values[0]


def test_vllm_series_beside_ours(served, http):
    before = scrape(http)
    model = {"model_name": served.model, "engine": "0"}
    for name in VLLM_ENGINE_SERIES:
        assert [lb for lb, _ in before[name]] == [model], name  # vLLM V1's label set, our model's name
    prompt = "A long shared system prompt about the history of the river and its bridges. " * 6
    for _ in range(2):  # the second request finds the first one's prompt blocks in the prefix cache
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0,
                                               "ignore_eos": True})
        assert r.status_code == 200, r.text
    after = scrape(http)
    n_prompt = r.json()["usage"]["prompt_tokens"]
    queries = one(after, "vllm:prefix_cache_queries_total") - one(before, "vllm:prefix_cache_queries_total")
    hits = one(after, "vllm:prefix_cache_hits_total") - one(before, "vllm:prefix_cache_hits_total")
    assert queries >= 2 * n_prompt and hits >= n_prompt // 2, (queries, hits, n_prompt)
    assert (one(after, "vllm:prompt_tokens_total") - one(before, "vllm:prompt_tokens_total")) >= 2 * n_prompt
    assert (one(after, "vllm:generation_tokens_total") - one(before, "vllm:generation_tokens_total")) >= 6
    for vllm_name, ours in (("vllm:kv_cache_usage_perc", "tokenfab_kv_cache_usage_perc"),
                            ("vllm:gpu_cache_usage_perc", "tokenfab_kv_cache_usage_perc"),
                            ("vllm:prompt_tokens_total", "tokenfab_prompt_tokens_total"),
                            ("vllm:generation_tokens_total", "tokenfab_generation_tokens_total"),
                            ("vllm:num_requests_running", "tokenfab_num_requests_running")):
        assert one(after, vllm_name) == one(after, ours, model_name=served.model), vllm_name
    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds"):
        grown = one(after, f"{hist}_count") - one(before, f"{hist}_count")
        assert grown >= 2, hist
        assert one(after, f"{hist}_bucket", le="+Inf") == one(after, f"{hist}_count")
    done = one(after, "vllm:request_success_total", finished_reason="length")
    assert done - dict((lb.get("finished_reason"), v) for lb, v in before.get("vllm:request_success_total", [])
                       ).get("length", 0.0) >= 2
