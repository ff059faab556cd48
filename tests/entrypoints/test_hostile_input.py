"""What a hostile client found (D1-D9), each as a regression test against the real server: the
bad request gets a clear 4xx naming the problem, the others are served, nothing leaks (the
memory check runs after every test)."""

from __future__ import annotations

import concurrent.futures
import socket
import threading

import httpx
import openai
import pytest

from baby_sgl import Engine
from baby_sgl.server_args import ServerArgs
from conftest import serve_in_thread, wait_idle
from helpers import wait_until

JSON = {"content-type": "application/json"}
OK_BODY = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}


def raw(server: str, path: str, body: str) -> httpx.Response:
    """A body sent as written: JSON that Python's own parser accepts (NaN, lone surrogates)."""
    return httpx.post(server + path, content=body.encode("utf-8", "surrogatepass"), headers=JSON)


def error_of(r: httpx.Response) -> str:
    return r.json()["error"]["message"]


def test_d1_huge_session_timeout_cannot_stop_the_scheduler(server):
    r = httpx.post(server + "/open_session", json={"capacity_of_str_len": 100, "timeout": 1e10})
    assert r.status_code == 400 and "timeout" in error_of(r)
    # The longest allowed timeout opens, and the idle scheduler still wakes and serves.
    sid = httpx.post(server + "/open_session", json={"capacity_of_str_len": 100, "timeout": 30 * 24 * 3600}).json()
    assert httpx.post(server + "/generate", json=OK_BODY).json()["meta_info"]["completion_tokens"] == 6
    assert httpx.post(server + "/close_session", json={"session_id": sid}).status_code == 200
    assert httpx.get(server + "/health").status_code == 200


def test_d2_overflowing_top_k_is_refused_and_spares_the_batch(server):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(httpx.post, server + "/generate", json=OK_BODY, timeout=60) for _ in range(3)]
        bad = httpx.post(server + "/generate", json={"text": "x", "sampling_params": {"top_k": 2**63}})
        chat = httpx.post(server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                "top_k": 2**63})
        results = [f.result().json() for f in others]
    assert bad.status_code == 400 and "sampling_params.top_k" in error_of(bad)
    assert chat.status_code == 400 and "top_k" in error_of(chat)
    assert all(r["meta_info"]["finish_reason"]["type"] == "length" and len(r["output_ids"]) == 6 for r in results)


@pytest.mark.parametrize("timeout", ["NaN", "Infinity", "-1", "0"])
def test_d3_non_finite_or_non_positive_session_timeout_is_refused(server, timeout):
    r = raw(server, "/open_session", f'{{"capacity_of_str_len": 100, "timeout": {timeout}}}')
    assert r.status_code == 400 and "timeout" in error_of(r)


def test_d4_oversized_and_overlong_bodies_are_refused_early(server):
    big = b'{"text": "' + b"a" * (17 * 2**20) + b'"}'
    r = httpx.post(server + "/generate", content=big, headers=JSON)
    assert r.status_code == 413 and "limit" in error_of(r)

    def chunks():  # no Content-Length: refused as soon as it grows past the limit
        yield b'{"text": "'
        for _ in range(20):
            yield b"a" * 2**20

    r = httpx.post(server + "/generate", content=chunks(), headers=JSON)
    assert r.status_code == 413
    # Under the byte limit but longer than any prompt can be: refused by its length, untokenized.
    r = httpx.post(server + "/generate", json={"text": "a" * 2_000_000})
    assert r.status_code == 400 and "characters" in error_of(r)
    r = httpx.post(server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 2_000_000}]})
    assert r.status_code == 400 and "characters" in error_of(r)


def test_d6_max_new_tokens_zero_is_prefill_only(server):
    prompt = list(range(40, 120))
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0}}
    first = httpx.post(server + "/generate", json=body).json()
    assert first["output_ids"] == [] and first["text"] == ""
    assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    again = httpx.post(server + "/generate", json=body | {"sampling_params": {"max_new_tokens": 2}}).json()
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1  # the prefix landed in the cache
    completion = httpx.post(server + "/v1/completions", json={"prompt": prompt, "max_tokens": 0}).json()
    assert completion["choices"][0]["text"] == "" and completion["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("body", [
    '{"text": "x", "sampling_params": {"temperature": NaN}}',
    '{"text": "x", "sampling_params": {"top_p": Infinity}}',
    '{"text": "x", "sampling_params": {"frequency_penalty": -Infinity}}',
    '{"text": "x", "sampling_params": {"min_p": NaN}}',
])
def test_d7_non_finite_floats_are_refused(server, body):
    r = raw(server, "/generate", body)
    assert r.status_code == 400 and "finite" in error_of(r)


@pytest.mark.parametrize("path, body, field", [
    ("/generate", '{"text": "x", "sampling_params": {"stop": 5}}', "sampling_params.stop"),
    ("/generate", '{"text": "abc\\ud800def"}', "text"),
    ("/generate", '{"text": "x", "rid": "r\\udfff"}', "rid"),
    ("/generate", '{"text": "x", "session_params": {"id": ["a"]}}', "session_params.id"),
    ("/generate", '{"text": "x", "sampling_params": {"stop": ["\\ud800"]}}', "sampling_params.stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ("/v1/completions", '{"prompt": "\\udc00"}', "prompt"),
    ("/open_session", '{"capacity_of_str_len": 10, "session_id": ["x"]}', "session_id"),
    ("/close_session", '{"session_id": 5}', "session_id"),
])
def test_d8_wrong_types_and_lone_surrogates_are_400(server, path, body, field):
    r = raw(server, path, body)
    assert r.status_code == 400, r.text
    assert field in error_of(r)


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/v1/messages"])
def test_d8_a_body_nested_past_the_parsers_depth_is_400(server, path):
    # Before: prompt_bound.py caught only ValueError from the JSON parse, so its RecursionError
    # was a 500 with a traceback in the log for every such body (200 KB).
    r = raw(server, path, '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert r.status_code == 400 and error_of(r) == "the request body's JSON is nested too deeply", r.text
    assert httpx.post(server + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}}).status_code == 200
    wait_idle(server)


BLOCKS = [{"type": "text", "text": ""}] * 1000  # 1000 empty content blocks


@pytest.mark.parametrize("path, body, message", [
    # Before: 16 MB of such blocks took 4.4 s of validation on the event loop before any limit.
    ("/v1/messages", {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": BLOCKS}] * 21},
     "more than 20000 JSON objects"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BLOCKS}] * 21}, "more than 20000 JSON objects"),
    # A list that merely starts with an integer is walked too, not taken for token ids.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [0] + BLOCKS * 21}]},
     "more than 20000 JSON objects"),
    ("/generate", {"text": "x", "sampling_params": {"logit_bias": {str(i): 1.0 for i in range(200_001)}}},
     "more than 200000 values"),
    # Before: each distinct pattern compiled as the body was validated, on the event loop (~30 ms
    # each for 256 patterns near RE2's memory limit).
    ("/generate", {"text": ["x"] * 65, "sampling_params": [{"stop_regex": f"a{i}b"} for i in range(65)]},
     "more than 64 distinct stop_regex patterns"),
])
def test_a_body_is_bounded_before_it_is_validated(server, path, body, message):
    r = httpx.post(server + path, json=body, timeout=60)
    assert r.status_code == 400 and message in error_of(r), r.text
    # The same patterns for every prompt compile once: a batch sharing them is served.
    same = {"text": ["x"] * 65, "sampling_params": {"stop_regex": [f"a{i}b" for i in range(30)], "max_new_tokens": 1}}
    assert httpx.post(server + "/generate", json=same, timeout=60).status_code == 200
    wait_idle(server)


def test_openai_logit_bias_and_stop_regex_lists_are_capped(server):
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    r = httpx.post(server + "/v1/chat/completions", json={**chat, "logit_bias": {str(i): 1 for i in range(4097)}})
    assert r.status_code == 400 and "logit_bias" in error_of(r), r.text
    r = httpx.post(server + "/v1/chat/completions", json={**chat, "stop_regex": [f"a{i}" for i in range(33)]})
    assert r.status_code == 400 and "stop_regex" in error_of(r), r.text


@pytest.mark.parametrize("path, body", [
    ("/generate", {"text": "x", "sampling_params": {"n": 1000}}),
    ("/v1/completions", {"prompt": "x", "n": 1000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 17}),
    ("/generate", {"text": ["x"] * 1000}),
])
def test_d9_n_and_batch_size_are_capped(server, path, body):
    assert httpx.post(server + path, json=body).status_code == 400


def test_d9_cross_origin_posts_are_refused(server):
    form = httpx.post(server + "/flush_cache", content=b"a=1",
                      headers={"content-type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415
    page = httpx.post(server + "/flush_cache", headers={"origin": "http://evil.example"})
    assert page.status_code == 403 and "cross-origin" in error_of(page)
    host = server.removeprefix("http://")
    same = httpx.post(server + "/flush_cache", headers={"origin": server, "host": host})
    assert same.status_code == 200


# ---- a server with tight limits and an API key ---------------------------------------------
KEY = "test-key-123"


@pytest.fixture(scope="module")
def strict_engine(tiny_llama):
    return Engine(tiny_llama, dtype="float32", max_total_tokens=2048, max_running_requests=1, max_sessions=3)


@pytest.fixture(scope="module")
def strict_server(strict_engine):
    args = ServerArgs(api_key=KEY, max_sessions=3, request_body_timeout=1.0, max_queued_requests=4,
                      max_request_bytes=64 * 1024)
    with serve_in_thread(strict_engine, args) as base:
        yield base


AUTH = {"authorization": f"Bearer {KEY}"}


def test_api_key_guards_every_route_but_health(strict_server):
    assert httpx.get(strict_server + "/health").status_code == 200
    for method, path in [("GET", "/server_info"), ("GET", "/metrics"), ("GET", "/v1/models"),
                         ("POST", "/generate"), ("POST", "/flush_cache"), ("GET", "/health_generate")]:
        r = httpx.request(method, strict_server + path, json={})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
        wrong = httpx.request(method, strict_server + path, json={}, headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401
    assert "api_key" not in httpx.get(strict_server + "/server_info", headers=AUTH).json()
    client = openai.OpenAI(base_url=strict_server + "/v1", api_key=KEY)
    out = client.completions.create(model="x", prompt="hello", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=strict_server + "/v1", api_key="wrong").models.list()
    wait_idle(strict_server, headers=AUTH)


def test_session_limit(strict_server):
    sids = [httpx.post(strict_server + "/open_session", json={"capacity_of_str_len": 10}, headers=AUTH).json()
            for _ in range(3)]
    r = httpx.post(strict_server + "/open_session", json={"capacity_of_str_len": 10}, headers=AUTH)
    assert r.status_code == 503 and "sessions" in error_of(r)
    for sid in sids:
        httpx.post(strict_server + "/close_session", json={"session_id": sid}, headers=AUTH)
    assert httpx.post(strict_server + "/open_session", json={"capacity_of_str_len": 10}, headers=AUTH).status_code == 200


def test_full_queue_is_503_with_retry_after(strict_server, strict_engine):
    # The scheduler is held inside a call, so nothing is admitted and four requests fill the queue.
    held_now, release = threading.Event(), threading.Event()
    sched = strict_engine.scheduler

    def hold() -> None:
        held_now.set()
        release.wait()

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        held = pool.submit(sched.call, hold)
        try:
            # Held before the requests come, or the first could be admitted and run first.
            assert held_now.wait(timeout=30), "the scheduler never took the call"
            # The held call is no queued request: it must not take one of the four places (Before:
            # Scheduler.num_queued counted the inbox's calls too, and a fourth request could be refused).
            queued = [pool.submit(httpx.post, strict_server + "/generate", json={"text": f"q{i}", "sampling_params": {
                "max_new_tokens": 2}}, headers=AUTH, timeout=60) for i in range(4)]
            wait_until(lambda: sched.num_queued() >= 4, "four requests to queue", timeout=30, interval=0.01)
            r = httpx.post(strict_server + "/generate", json={"text": "x"}, headers=AUTH)
            assert r.status_code == 503 and r.headers["retry-after"] == "1" and "queue" in error_of(r)
        finally:
            release.set()  # a failure above must not leave the scheduler held
        held.result()
        assert all(f.result().status_code == 200 for f in queued)
    # A call larger than the whole queue could never fit: that is the client's error. Its samples
    # count (before: async_bridge.py counted the prompts, so n=16 let 16 times the limit wait).
    for body in ({"text": ["a"] * 5}, {"text": "a", "sampling_params": {"n": 5}}):
        r = httpx.post(strict_server + "/generate", json=body, headers=AUTH)
        assert r.status_code == 400 and "this call holds 5 requests" in error_of(r), r.text
    wait_idle(strict_server, headers=AUTH)


def test_requests_waiting_for_their_grammars_count_against_the_queue(strict_server, strict_engine, monkeypatch):
    """Before: async_bridge.py compiled a call's grammars before counting its requests, so any
    number of calls with distinct grammars could wait for the two compile threads (tens of
    seconds each for large ones), outside --max-queued-requests; every later constrained request
    waited behind them."""
    grammars, entered, release = strict_engine.grammars, threading.Semaphore(0), threading.Event()
    compile_one = grammars._compile

    def held(kind, text):
        entered.release()
        assert release.wait(timeout=60)
        return compile_one(kind, text)

    monkeypatch.setattr(grammars, "_compile", held)
    body = {"text": "x", "sampling_params": {"max_new_tokens": 2, "n": 2}}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        try:
            waiting = [pool.submit(httpx.post, strict_server + "/generate", headers=AUTH, timeout=120, json=body | {
                "sampling_params": body["sampling_params"] | {"regex": f"[a-z]{{{k + 1},9}}"}}) for k in range(2)]
            for _ in waiting:  # both compiling on the two threads: four requests wait
                assert entered.acquire(timeout=60), "a grammar never reached its compile"
            r = httpx.post(strict_server + "/generate", json={"text": "x"}, headers=AUTH)
            assert r.status_code == 503 and "queue is full" in error_of(r), r.text
        finally:
            release.set()
        assert [w.result().status_code for w in waiting] == [200, 200]
    assert httpx.post(strict_server + "/generate", json={"text": "x"}, headers=AUTH).status_code == 200
    wait_idle(strict_server, headers=AUTH)


def test_body_size_limit_is_configurable(strict_server):
    r = httpx.post(strict_server + "/generate", json={"text": "a" * 70_000}, headers=AUTH)
    assert r.status_code == 413


def test_slow_body_is_timed_out(strict_server):
    host, port = strict_server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Authorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n{{\"text\"".encode())
        reply = sock.recv(4096).decode()  # nothing more is sent: the server gives up after 1 s
    assert reply.startswith("HTTP/1.1 408"), reply
    assert httpx.get(strict_server + "/health").status_code == 200


# ---- found by a hostile client after the first round of fixes ------------------------------
def test_session_turn_adding_nothing_to_a_held_row_is_refused_alone(server):
    sid = httpx.post(server + "/open_session", json={"capacity_of_str_len": 10, "streaming": True}).json()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        other = pool.submit(httpx.post, server + "/generate", timeout=60, json={
            "input_ids": [9, 8, 7], "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}})
        first = httpx.post(server + "/generate", json={"input_ids": [1, 20, 21, 22], "sampling_params": {
            "max_new_tokens": 0}, "session_params": {"id": sid}})
        assert first.status_code == 200
        bos_only = httpx.post(server + "/generate", json={"input_ids": [1], "session_params": {"id": sid}})
        assert bos_only.status_code == 400 and "adds no tokens" in error_of(bos_only)
        assert other.result().json()["meta_info"]["finish_reason"]["type"] == "length"
    assert httpx.post(server + "/generate", json={"input_ids": [1, 30], "sampling_params": {"max_new_tokens": 2},
                                                  "session_params": {"id": sid}}).status_code == 200
    assert httpx.post(server + "/close_session", json={"session_id": sid}).status_code == 200


@pytest.mark.parametrize("origin", ["http://[", "http://[::1", b"http://\xff["])
def test_malformed_origin_is_refused_not_an_error(server, origin):
    assert httpx.get(server + "/health", headers={"origin": origin}).status_code == 403


def test_rids_of_n_copies_cannot_collide_with_other_rids(server):
    body = {"text": ["Hello", "Paris is"], "rid": ["x-0", "x"],
            "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 5, "n": 2}]}
    r = httpx.post(server + "/generate", json=body)
    assert r.status_code == 400 and "duplicate request id 'x-0'" in error_of(r)


def test_largest_seed_with_n_choices(server):
    r = httpx.post(server + "/v1/completions", json={"prompt": "hi", "n": 2, "seed": 2**63 - 1, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_health_generate_answers_while_long_work_runs(server):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(httpx.post, server + "/generate", timeout=60, json={
            "input_ids": [5] * 900, "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}})
        wait_until(lambda: busy.done() or httpx.get(server + "/server_info").json()["num_running_reqs"],
                   "the long request to start")
        probe = httpx.get(server + "/health_generate", headers={"content-type": "application/json"}, timeout=30)
        assert probe.status_code == 200
        assert busy.result().status_code == 200
