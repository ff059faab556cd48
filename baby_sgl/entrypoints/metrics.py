"""Prometheus metrics for the server, under SGLang's names (`sglang:...{model_name=...}`) so
its dashboards work unchanged. Engine gauges are read at scrape time; request counters and
latency histograms are fed by the async bridge as results arrive."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from baby_sgl.core.finish_reason import FinishAbort, FinishReason

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)


class Metrics:
    """One registry per app, so several servers (or tests) in a process do not collide."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=buckets).labels(model_name)

        self.running = gauge("sglang:num_running_reqs", "Requests being prefilled or decoded")
        self.queued = gauge("sglang:num_queue_reqs", "Requests waiting to be scheduled")
        self.used_tokens = gauge("sglang:num_used_tokens", "KV slots held by running requests")
        self.token_usage = gauge("sglang:token_usage", "Fraction of KV slots held by running requests")
        self.cached_kv = gauge("sglang:cached_kv_tokens", "KV slots held only by the prefix cache (evictable)")
        self.hit_rate = gauge("sglang:cache_hit_rate", "Prompt tokens served from the prefix cache / prompt "
                              "tokens, since start")
        self.retractions = gauge("sglang:num_retractions", "Decode requests retracted for lack of KV, since start")
        self.spec_accept_length = gauge("sglang:spec_accept_length", "Speculative decoding: tokens a request gains "
                                        "per verify pass (accepted drafts + 1), since start")
        self.spec_hit_rate = gauge("sglang:spec_draft_hit_rate", "Speculative decoding: decode steps of a request "
                                   "that found a draft / those that looked for one, since start")
        self.prompt_tokens = counter("sglang:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("sglang:generation_tokens", "Generated tokens of finished requests")
        self.requests = counter("sglang:num_requests", "Finished requests")
        self.aborted = counter("sglang:num_aborted_requests", "Requests that ended by abort (client or error)")
        self.ttft = histogram("sglang:time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.itl = histogram("sglang:inter_token_latency_seconds", "Time between output tokens", _ITL_BUCKETS)
        self.e2e = histogram("sglang:e2e_request_latency_seconds", "Request latency", _LATENCY_BUCKETS)
        # The last exposition and what it showed: pollers asking within one scheduler turn, with no
        # request finished between them, share one rendering (~1 ms of the event loop's time each).
        self._observed = 0
        self._shown: tuple = ()
        self._text = b""

    def observe_finished(self, meta: dict) -> None:
        self._observed += 1
        self.prompt_tokens.inc(meta["prompt_tokens"])
        self.generation_tokens.inc(meta["completion_tokens"])
        self.requests.inc()
        if isinstance(FinishReason.from_json(meta["finish_reason"]), FinishAbort):
            self.aborted.inc()
        self.e2e.observe(meta["e2e_latency"])
        if meta.get("ttft") is not None:
            self.ttft.observe(meta["ttft"])

    def observe_inter_token_latency(self, interval: float, num_tokens: int) -> None:
        """A piece that brought several tokens counts as that many equal gaps (as SGLang does)."""
        self._observed += 1
        for _ in range(num_tokens):
            self.itl.observe(interval / num_tokens)

    def render(self, info: dict) -> bytes:
        steps = info.get("spec_verify_steps", 0)
        gauges = {
            self.running: info["num_running_reqs"],
            self.queued: info["num_waiting_reqs"],
            self.used_tokens: info["kv_used_tokens"],
            self.token_usage: info["kv_used_tokens"] / info["kv_total_tokens"],
            self.cached_kv: info["kv_cached_tokens"],
            self.hit_rate: info["cached_tokens"] / info["prompt_tokens"] if info["prompt_tokens"] else 0.0,
            self.retractions: info.get("num_retractions", 0),
            self.spec_accept_length: 1 + info["spec_accepted_tokens"] / steps if steps else 0.0,
            self.spec_hit_rate: steps / info["spec_draft_chances"] if info.get("spec_draft_chances") else 0.0,
        }
        shown = (self._observed, *gauges.values())
        if shown != self._shown:
            for gauge, value in gauges.items():
                gauge.set(value)
            self._shown, self._text = shown, generate_latest(self.registry)
        return self._text
