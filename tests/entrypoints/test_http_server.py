"""The HTTP server driven by real clients: the official openai client and plain HTTP."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none")


def test_models(client):
    assert len(client.models.list().data) == 1


def test_completion(client):
    r = client.completions.create(model="m", prompt="Hello", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens == 5
    again = client.completions.create(model="m", prompt="Hello", max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == r.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens >= 4


def test_completion_stream_equals_non_stream(client):
    kw = dict(model="m", prompt="Stream me", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    parts = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == full
    assert parts[-1].usage.completion_tokens == 12


def test_chat(client):
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       temperature=0, n=2, seed=3)
    assert len(r.choices) == 2 and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy
    assert 2 <= r.usage.completion_tokens <= 12  # both choices count; each stops by max_tokens=6
    single = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                            temperature=0)
    assert r.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once for n=2
    assert r.usage.completion_tokens == 2 * single.usage.completion_tokens


def test_chat_stream_and_seed(client):
    kw = dict(model="m", messages=[{"role": "user", "content": "tell"}], max_tokens=10, temperature=0.9, seed=11)
    full = client.chat.completions.create(**kw).choices[0].message.content
    parts = list(client.chat.completions.create(**kw, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == full
    assert parts[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "lp"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and len(content[0].top_logprobs) == 2
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)


def test_stop_string(client):
    text = client.completions.create(model="m", prompt="abc", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = text[3:5]
    if stop.strip() and "\ufffd" not in stop:
        r = client.completions.create(model="m", prompt="abc", max_tokens=16, temperature=0, stop=stop,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[: text.index(stop)]


def test_native_generate(server):
    r = httpx.post(server + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 4,
                                                                                 "temperature": 0}})
    body = r.json()
    assert r.status_code == 200 and set(body) == {"text", "output_ids", "meta_info"}
    batch = httpx.post(server + "/generate", json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}})
    assert len(batch.json()) == 2
    ids = httpx.post(server + "/generate", json={"input_ids": [5, 6, 7], "return_logprob": True,
                                                 "sampling_params": {"max_new_tokens": 2}}).json()
    assert len(ids["meta_info"]["output_token_logprobs"]) == 2


def test_native_stream(server):
    events = []
    with httpx.stream("POST", server + "/generate", json={"text": "Hi", "stream": True,
                                                          "sampling_params": {"max_new_tokens": 6, "temperature": 0}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["meta_info"]["completion_tokens"] == len(last["output_ids"])
    assert last["meta_info"]["finish_reason"] is not None


def test_info_routes(server):
    assert httpx.get(server + "/model_info").json()["is_generation"]
    assert httpx.get(server + "/get_model_info").status_code == 200
    assert httpx.get(server + "/server_info").json()["page_size"] == 1
    assert httpx.get(server + "/health_generate").status_code == 200
    assert httpx.post(server + "/flush_cache").status_code == 200


def test_abort_request(server):
    async def scenario():
        async with httpx.AsyncClient(timeout=60) as c:
            task = asyncio.create_task(c.post(server + "/generate", json={
                "text": "long", "rid": "abort-me", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}))
            await asyncio.sleep(0.3)
            await c.post(server + "/abort_request", json={"rid": "abort-me"})
            return (await task).json()

    out = asyncio.run(scenario())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"


def test_32_concurrent_streaming_clients(server):
    async def one(c: httpx.AsyncClient, i: int) -> str:
        text = ""
        async with c.stream("POST", server + "/v1/completions", json={
                "prompt": f"client {i}", "max_tokens": 16, "stream": True, "temperature": 0.5, "seed": i}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def all_clients():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    results = asyncio.run(all_clients())
    assert len(results) == 32


def test_client_disconnect_aborts_the_request(server):
    with httpx.stream("POST", server + "/generate", json={
            "text": "go on", "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    # The autouse fixture waits until nothing runs and the memory check is clean.


@pytest.mark.parametrize("path, body, fragment", [
    ("/v1/completions", b"{not json", "malformed JSON"),
    ("/v1/completions", {"prompt": "x", "bogus": 1}, "bogus"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "x" * 3000}, "prompt is too long"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/generate", {"text": "", "sampling_params": {}}, "prompt is empty"),
    ("/generate", {"input_ids": [1, 10 ** 6]}, "outside the vocabulary"),
    ("/generate", {"text": "x", "sampling_params": {"top_p": 2}}, "top_p"),
])
def test_bad_input_gets_400(server, path, body, fragment):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server + path, headers={"content-type": "application/json"}, **kw)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
    assert httpx.get(server + "/health").status_code == 200


def test_unknown_route_is_404(server):
    r = httpx.get(server + "/nope")
    assert r.status_code == 404 and "error" in r.json()


def test_metrics_parse(server):
    httpx.post(server + "/generate", json={"text": "m", "sampling_params": {"max_new_tokens": 3}})
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server + "/metrics").text)}
    for name in ("sglang_num_running_reqs", "sglang_num_queue_reqs", "sglang_token_usage", "sglang_cache_hit_rate",
                 "sglang_prompt_tokens", "sglang_generation_tokens", "sglang_time_to_first_token_seconds",
                 "sglang_inter_token_latency_seconds", "sglang_e2e_request_latency_seconds"):
        assert name in families, name
    count = next(s.value for s in families["sglang_e2e_request_latency_seconds"].samples if s.name.endswith("_count"))
    assert count >= 1


def test_health_answers_while_busy(server):
    async def scenario():
        async with httpx.AsyncClient(timeout=60) as c:
            work = [asyncio.create_task(c.post(server + "/generate", json={
                "text": f"busy {i}", "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}})) for i in range(8)]
            await asyncio.sleep(0.1)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            r = await c.get(server + "/health")
            elapsed = loop.time() - t0
            await asyncio.gather(*work)
            return r.status_code, elapsed

    status, elapsed = asyncio.run(scenario())
    assert status == 200 and elapsed < 1.0


def test_bench_serving_against_our_server(server, tmp_path):
    from baby_sgl.entrypoints.bench_serving import main

    out = tmp_path / "bench.jsonl"
    for backend, dataset in [("sglang", "random"), ("openai", "shared-prefix")]:
        code = main(["--base-url", server, "--backend", backend, "--dataset", dataset, "--num-prompts", "6",
                     "--random-input-max", "40", "--random-output-min", "4", "--random-output-max", "8", "--gsp-num-groups", "2",
                     "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "40", "--gsp-output-len", "4",
                     "--request-rate", "50", "--output-file", str(out)])
        assert code == 0
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["completed"] == 6 and r["failed"] == 0 and r["output_token_throughput"] > 0 for r in runs)
    assert runs[0]["ttft_s"]["p50"] > 0 and runs[0]["tpot_s"]["mean"] > 0


def test_chat_cli_against_our_server(server):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "baby_sgl.cli", "chat", "--base-url", server, "--max-new-tokens", "4",
                           "--temperature", "0"], input="hello\n/reset\nagain\n/exit\n", capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("assistant> ") == 2
