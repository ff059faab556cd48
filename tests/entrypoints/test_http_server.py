"""SGLang's native routes, errors, concurrency and disconnects, driven over real HTTP."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from conftest import aborted_requests, serve_in_thread, wait_idle
from helpers import wait_until, wait_until_async

from baby_sgl import Engine

LONG = {"max_new_tokens": 16000, "ignore_eos": True}  # runs for seconds on long_server's model


@pytest.fixture(scope="module")
def long_server(tiny_llama_long):
    """A server whose LONG requests run for seconds on any machine (tiny_llama_long); each test
    that uses it ends with the server idle and its memory intact."""
    engine = Engine(tiny_llama_long, dtype="float32", max_total_tokens=65536)
    with serve_in_thread(engine) as base:
        yield base


@pytest.fixture
def long_server_clean(long_server):
    yield long_server
    wait_idle(long_server)


def sse_events(r: httpx.Response) -> list[str]:
    return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_native_generate(server):
    r = httpx.post(server + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 4,
                                                                                 "temperature": 0}})
    body = r.json()
    assert r.status_code == 200 and set(body) == {"text", "output_ids", "meta_info"}
    assert body["meta_info"]["completion_tokens"] == len(body["output_ids"]) <= 4
    batch = httpx.post(server + "/generate", json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}})
    assert len(batch.json()) == 2
    n2 = httpx.post(server + "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2, "n": 2}})
    assert len(n2.json()) == 2
    ids = httpx.post(server + "/generate", json={"input_ids": [5, 6, 7], "return_logprob": True,
                                                 "top_logprobs_num": 2,
                                                 "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}).json()
    assert len(ids["meta_info"]["output_token_logprobs"]) == 2
    assert [len(top) for top in ids["meta_info"]["output_top_logprobs"]] == [2, 2]


def test_native_stream_is_cumulative(server):
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    full = httpx.post(server + "/generate", json=body).json()
    with httpx.stream("POST", server + "/generate", json=body | {"stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for before, after in zip(chunks, chunks[1:]):  # SGLang: each event holds everything so far
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_info_routes(server):
    assert httpx.get(server + "/health").status_code == 200
    assert httpx.get(server + "/model_info").json()["is_generation"]
    assert httpx.get(server + "/get_model_info").json()["context_length"] == 1024
    info = httpx.get(server + "/server_info").json()
    assert info["page_size"] == 1 and info["kv_total_tokens"] == 8192
    # the server's own settings beside the engine's (the defaults here), never an API key
    assert info["max_queued_requests"] == 1024 and info["dp_size"] == 1 and "api_key" not in info
    assert httpx.get(server + "/health_generate", headers={"content-type": "application/json"}).status_code == 200
    assert httpx.post(server + "/flush_cache").status_code == 200
    assert httpx.get(server + "/server_info").json()["kv_cached_tokens"] == 0
    # the load report SGLang's router reads (power_of_two, /get_loads): one entry per dp rank
    assert httpx.get(server + "/get_load").json() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0,
                                                      "num_tokens": 0}]


async def _running(c: httpx.AsyncClient, server: str, at_least: int = 1) -> bool:
    return (await c.get(server + "/server_info")).json()["num_running_reqs"] >= at_least


async def _abort_after_start(server: str, body: dict, rid: str) -> list[dict]:
    async with httpx.AsyncClient(timeout=60) as c:
        task = asyncio.create_task(c.post(server + "/generate", json=body))
        await wait_until_async(lambda: _running(c, server), "the request to start")
        assert (await c.post(server + "/abort_request", json={"rid": rid})).status_code == 200
        out = (await task).json()
        return out if isinstance(out, list) else [out]


def test_abort_request(long_server_clean):
    server = long_server_clean
    outs = asyncio.run(_abort_after_start(server, {"text": "long", "rid": "abort-me", "sampling_params": LONG},
                                          "abort-me"))
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "abort"


def test_abort_request_reaches_every_copy(long_server_clean):
    server = long_server_clean
    body = {"text": "long", "rid": "copies", "sampling_params": LONG | {"n": 2}}
    outs = asyncio.run(_abort_after_start(server, body, "copies"))
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]


def test_duplicate_running_rid_is_refused(long_server_clean):
    server = long_server_clean
    async def scenario():
        async with httpx.AsyncClient(timeout=60) as c:
            task = asyncio.create_task(c.post(server + "/generate", json={"text": "a", "rid": "dup",
                                                                          "sampling_params": LONG}))
            await wait_until_async(lambda: _running(c, server), "the request to start")
            second = await c.post(server + "/generate", json={"text": "b", "rid": "dup"})
            await c.post(server + "/abort_request", json={"rid": "dup"})
            await task
            return second

    second = asyncio.run(scenario())
    assert second.status_code == 400 and "duplicate request id" in second.json()["error"]["message"]
    same_batch = httpx.post(server + "/generate", json={"text": ["a", "b"], "rid": ["x", "x"]})
    assert same_batch.status_code == 400


def test_32_concurrent_streaming_clients(server):
    async def one(c: httpx.AsyncClient, i: int) -> tuple[str, dict]:
        text, usage = "", {}
        async with c.stream("POST", server + "/v1/completions", json={
                "prompt": f"client {i}", "max_tokens": 16, "stream": True, "temperature": 0.5, "seed": i,
                "ignore_eos": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    data = json.loads(line[6:])
                    text += data["choices"][0]["text"] if data["choices"] else ""
                    usage = data.get("usage") or usage
        return text, usage

    async def all_clients():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    results = asyncio.run(all_clients())
    assert len(results) == 32 and all(usage["completion_tokens"] == 16 for _, usage in results)


def test_stream_disconnect_aborts_the_request(long_server_clean):
    server = long_server_clean
    before = aborted_requests(server)
    with httpx.stream("POST", server + "/generate", json={"text": "go on", "stream": True,
                                                          "sampling_params": LONG}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    wait_until(lambda: aborted_requests(server) == before + 1, "the abort")  # then the autouse fixture checks memory


def test_non_stream_disconnect_aborts_the_request(long_server_clean):
    server = long_server_clean
    before = aborted_requests(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/generate", json={"text": "go on", "sampling_params": LONG}, timeout=0.3)
    wait_until(lambda: aborted_requests(server) == before + 1, "the abort")


@pytest.mark.parametrize("path, body, fragment", [
    ("/v1/completions", b"{not json", "malformed JSON"),
    ("/generate", b'{"text": "x",', "malformed JSON"),
    ("/v1/completions", {"prompt": "x", "bogus": 1}, "unknown field 'bogus'"),
    ("/generate", {"text": "x", "bogus": 1}, "unknown field 'bogus'"),
    ("/generate", {"text": "x", "sampling_params": {"bogus": 1}}, "bogus"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": "many"}, "n"),
    ("/v1/completions", {"prompt": "x" * 3000}, "prompt is too long"),
    ("/v1/completions", {"prompt": "x" * 3000, "stream": True}, "prompt is too long"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/generate", {"text": "", "sampling_params": {}}, "prompt is empty"),
    ("/generate", {"text": "x" * 3000, "stream": True}, "prompt is too long"),
    ("/generate", {"input_ids": [1, 10 ** 6]}, "outside the vocabulary"),
    ("/generate", {"text": "x", "sampling_params": {"top_p": 2}}, "top_p"),
    ("/generate", {"text": "x", "input_ids": [1]}, "exactly one of text or input_ids"),
    ("/generate", {"text": ["a", "b"], "rid": ["r1"]}, "got 2 prompts but 2 sampling_params and 1 rids"),
    ("/abort_request", {}, "rid"),
])
def test_bad_input_gets_400(server, path, body, fragment):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server + path, headers={"content-type": "application/json"}, **kw)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error" and error["code"] == 400
    assert httpx.get(server + "/health").status_code == 200


def test_form_body_is_explained(server):
    r = httpx.post(server + "/generate", content=b'{"text": "x"}',
                   headers={"content-type": "application/x-www-form-urlencoded"})  # what curl -d sends
    assert r.status_code == 415 and "Content-Type: application/json" in r.json()["error"]["message"]


def test_unknown_route_is_404(server):
    r = httpx.get(server + "/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    assert httpx.get(server + "/generate").status_code == 405


def test_health_answers_while_busy(long_server_clean):
    server = long_server_clean

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as c:
            work = [asyncio.create_task(c.post(server + "/generate", json={
                "text": f"busy {i}", "rid": f"busy-{i}", "sampling_params": LONG})) for i in range(8)]
            await wait_until_async(lambda: _running(c, server, 8), "all eight requests to start")
            health = await c.get(server + "/health")
            # answered while all eight still run: the event loop is not waiting on the engine
            running = (await c.get(server + "/server_info")).json()["num_running_reqs"]
            for i in range(8):
                await c.post(server + "/abort_request", json={"rid": f"busy-{i}"})
            outs = [r.json() for r in await asyncio.gather(*work)]
            return health.status_code, running, outs

    status, running, outs = asyncio.run(scenario())
    assert status == 200 and running == 8
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort"] * 8
