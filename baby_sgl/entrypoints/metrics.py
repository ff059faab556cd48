"""Prometheus metrics for the server: engine gauges read at scrape time, request histograms."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.running = Gauge("sglang_num_running_reqs", "Requests being prefilled or decoded", registry=r)
        self.queued = Gauge("sglang_num_queue_reqs", "Requests waiting to be scheduled", registry=r)
        self.token_usage = Gauge("sglang_token_usage", "Fraction of KV slots held by running requests", registry=r)
        self.cached_kv = Gauge("sglang_cached_kv_tokens", "KV slots held by the prefix cache (evictable)", registry=r)
        self.hit_rate = Gauge("sglang_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens",
                              registry=r)
        self.prompt_tokens = Counter("sglang_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("sglang_generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter("sglang_requests", "Finished requests", ["finish_reason"], registry=r)
        self.ttft = Histogram("sglang_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("sglang_inter_token_latency_seconds", "Mean time between output tokens, per request", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("sglang_e2e_request_latency_seconds", "Request latency", registry=r,
                             buckets=_LATENCY_BUCKETS)

    def observe_finished(self, meta: dict) -> None:
        self.prompt_tokens.inc(meta["prompt_tokens"])
        self.generation_tokens.inc(meta["completion_tokens"])
        self.requests.labels((meta["finish_reason"] or {}).get("type", "unknown")).inc()
        self.e2e.observe(meta["e2e_latency"])
        if meta.get("ttft") is not None:
            self.ttft.observe(meta["ttft"])
            if meta["completion_tokens"] > 1:
                gap = (meta["e2e_latency"] - meta["ttft"]) / (meta["completion_tokens"] - 1)
                for _ in range(meta["completion_tokens"] - 1):
                    self.itl.observe(gap)

    def render(self, info: dict) -> bytes:
        self.running.set(info["num_running_reqs"])
        self.queued.set(info["num_waiting_reqs"])
        self.token_usage.set(info["kv_used_tokens"] / info["kv_total_tokens"])
        self.cached_kv.set(info["kv_cached_tokens"])
        self.hit_rate.set(info["cached_tokens"] / info["prompt_tokens"] if info["prompt_tokens"] else 0.0)
        return generate_latest(self.registry)
