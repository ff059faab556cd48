"""/metrics in Prometheus' text format, under SGLang's metric names."""

from __future__ import annotations

import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baby_sgl import Engine
from entrypoints.conftest import serve_checked, wait_idle
from helpers import wait_until


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
    # present here; their values: test_gauges_follow_the_requests_and_the_pool
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


KV_SLOTS = 4096
GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_used_tokens", "sglang:token_usage",
          "sglang:cached_kv_tokens")


@pytest.fixture(scope="module")
def one_at_a_time(tiny_llama):
    """A server that runs one request at a time, so a second one waits in the queue."""
    with serve_checked(Engine(tiny_llama, dtype="float32", max_running_requests=1, max_total_tokens=KV_SLOTS)) as base:
        yield base


def gauges(server: str) -> dict[str, float]:
    scraped = scrape(server)
    return {name: scraped[name][name] for name in GAUGES}


def test_gauges_follow_the_requests_and_the_pool(one_at_a_time):
    """The gauges' values, not only their names: four long requests sent at once, one decoding
    and the others queued behind it (running 1, queued, its KV used), then, once they are aborted,
    idle (nothing used, the tree's slots cached)."""
    # Checked by breaking each gauge in turn in `Metrics.render` (`self.running.set(0)`,
    # `self.queued.set(0)`, `self.used_tokens.set(0)`, the token usage's divisor doubled,
    # `self.cached_kv.set(0)`): each failed here, the first four at the wait, the last at the end.
    base, prompt, rids = one_at_a_time, "gauges " * 8, [f"gauge-{i}" for i in range(4)]
    body = {"text": [prompt] * 4, "rid": rids, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    batch = threading.Thread(target=lambda: httpx.post(base + "/generate", json=body, timeout=120))
    batch.start()

    def one_running_others_queued() -> bool:
        g = gauges(base)
        return (g["sglang:num_running_reqs"] == 1 and g["sglang:num_queue_reqs"] >= 1
                and g["sglang:num_used_tokens"] >= len(prompt)
                and g["sglang:token_usage"] == g["sglang:num_used_tokens"] / KV_SLOTS)

    wait_until(one_running_others_queued, "the gauges to show one request running and others queued", timeout=30)
    for rid in rids:
        httpx.post(base + "/abort_request", json={"rid": rid})
    batch.join()
    counts = wait_idle(base)
    assert gauges(base) == {"sglang:num_running_reqs": 0, "sglang:num_queue_reqs": 0, "sglang:num_used_tokens": 0,
                            "sglang:token_usage": 0, "sglang:cached_kv_tokens": counts["evictable"]}
    assert counts["evictable"] > 0


def test_scrapes_that_would_show_the_same_values_share_one_rendering(server, monkeypatch):
    """Before: every scrape rendered the registry (~1 ms of the event loop's time), so 16 clients
    polling /metrics as fast as answered slowed a neighbour's 16-token request from 0.06 s to 0.67 s
    (tests/entrypoints/test_hostile_neighbour.py, its floor of 0.25 s hid it on a CPU; a GPU's
    faster steps showed it). A finished request still shows at the next scrape."""
    from baby_sgl.entrypoints import metrics

    wait_idle(server)
    before = scrape(server)["sglang:num_requests"]["sglang:num_requests_total"]
    renders: list[int] = []
    render = metrics.generate_latest
    monkeypatch.setattr(metrics, "generate_latest", lambda registry: renders.append(1) or render(registry))
    scrapes = {httpx.get(server + "/metrics").text for _ in range(10)}
    assert len(renders) == 0 and len(scrapes) == 1
    body = {"text": "metrics", "sampling_params": {"max_new_tokens": 3}}
    httpx.post(server + "/generate", json=body).raise_for_status()
    assert scrape(server)["sglang:num_requests"]["sglang:num_requests_total"] == before + 1
    assert len(renders) == 1
    wait_idle(server)
