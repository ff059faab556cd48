"""Speculative decoding seen from the server: meta_info's spec_verify_ct, /metrics' accept
length and draft hit rate, the dashboard's verify counters and drafts per batch."""

from __future__ import annotations

import httpx
import pytest

from baby_sgl import Engine
from entrypoints.conftest import serve_in_thread, wait_idle
from entrypoints.test_metrics import scrape


@pytest.fixture(scope="module")
def spec_server(tiny_llama):
    engine = Engine(tiny_llama, dtype="float32", speculative_algorithm="NGRAM", max_running_requests=8)
    with serve_in_thread(engine) as base:
        yield base


def test_visible_in_meta_info_metrics_and_dashboard(spec_server):
    body = {"input_ids": list(range(30, 60)), "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                                                   "ignore_eos": True}}
    first = httpx.post(spec_server + "/generate", json=body).json()
    again = httpx.post(spec_server + "/generate", json=body).json()  # drafts the first answer from the cache
    assert again["output_ids"] == first["output_ids"]
    meta = again["meta_info"]
    assert meta["spec_verify_ct"] > 0 and meta["spec_accepted_tokens"] > 0
    metrics = scrape(spec_server)
    assert metrics["sglang:spec_accept_length"]["sglang:spec_accept_length"] > 1
    assert 0 < metrics["sglang:spec_draft_hit_rate"]["sglang:spec_draft_hit_rate"] <= 1
    activity = httpx.get(spec_server + "/dashboard/state").json()["activity"]
    assert sum(h["spec_steps"] for h in activity["history"]) >= meta["spec_verify_ct"]
    assert sum(h["spec_accepted"] for h in activity["history"]) >= meta["spec_accepted_tokens"]
    assert any(b["draft_tokens"] > 0 for b in activity["batches"])
    wait_idle(spec_server)
