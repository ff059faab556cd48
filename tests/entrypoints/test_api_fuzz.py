"""Property-based fuzzing of the running server from its own OpenAPI schema (Schemathesis):
every route, a few hundred generated requests, valid ones and ones that break the schema; the
server reads tool calls, so the tool, Anthropic and session routes run their own code. No request may get a 5xx, and
afterwards the server must be healthy, idle and own every KV slot exactly once."""

from __future__ import annotations

import itertools

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error

from baby_sgl import Engine
from baby_sgl.server_args import ServerArgs
from conftest import serve_in_thread, wait_idle

EXAMPLES_PER_ROUTE = 25


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama):
    # A short context keeps any generated max_new_tokens cheap.
    engine = Engine(tiny_llama, dtype="float32", max_total_tokens=4096, context_length=256, max_running_requests=16)
    with serve_in_thread(engine, ServerArgs(tool_call_parser="qwen25")) as base:
        yield base


def test_no_request_gets_a_server_error(fuzz_server):
    schema = schemathesis.openapi.from_url(fuzz_server + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15  # every route of both APIs is in the schema
    paths = {operation.path for operation in operations}
    assert {"/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/open_session",
            "/close_session"} <= paths
    cases = 0

    for operation, mode in itertools.product(operations, (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)):
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def call(case) -> None:
            nonlocal cases
            cases += 1
            case.call_and_validate(base_url=fuzz_server, checks=[not_a_server_error], timeout=60)

        try:
            call()
        except Unsatisfiable:
            assert mode == GenerationMode.NEGATIVE  # a route with no body or parameters has nothing to break
    assert cases >= 200, cases


def test_server_is_healthy_and_leak_free_after_fuzzing(fuzz_server):
    assert httpx.get(fuzz_server + "/health").status_code == 200
    counts = wait_idle(fuzz_server, timeout=60)
    assert counts["free"] + counts["evictable"] + counts["protected"] + counts["session_held"] == counts["total"]
    out = httpx.post(fuzz_server + "/generate", json={"text": "still here", "sampling_params": {"max_new_tokens": 3}})
    assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] >= 1
