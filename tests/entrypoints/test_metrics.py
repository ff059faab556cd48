"""/metrics in Prometheus' text format, under SGLang's metric names."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(server: str) -> dict[str, dict[str, float]]:
    """family name -> sample name -> value (label sets other than le are not distinguished)."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(server + "/metrics").text):
        for s in family.samples:
            if "le" not in s.labels:
                out.setdefault(family.name, {})[s.name] = s.value
    return out


def test_metrics_families_and_counts(server):
    before = scrape(server)
    body = {"text": "metrics", "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    httpx.post(server + "/generate", json=body)
    httpx.post(server + "/generate", json=body)  # the second prompt is a cache hit
    after = scrape(server)
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_used_tokens", "sglang:token_usage",
                 "sglang:cache_hit_rate", "sglang:cached_kv_tokens"):
        assert name in after, name

    def delta(family: str, sample: str) -> float:
        return after[family][sample] - before.get(family, {}).get(sample, 0.0)

    assert delta("sglang:prompt_tokens", "sglang:prompt_tokens_total") == 2 * 7
    assert delta("sglang:generation_tokens", "sglang:generation_tokens_total") == 2 * 5
    assert delta("sglang:num_requests", "sglang:num_requests_total") == 2
    assert delta("sglang:time_to_first_token_seconds", "sglang:time_to_first_token_seconds_count") == 2
    assert delta("sglang:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds_count") == 2
    # Every token after the first is one measured gap, streamed or not.
    assert delta("sglang:inter_token_latency_seconds", "sglang:inter_token_latency_seconds_count") == 2 * 4
    assert 0 < after["sglang:cache_hit_rate"]["sglang:cache_hit_rate"] <= 1
    assert after["sglang:num_running_reqs"]["sglang:num_running_reqs"] == 0
