"""The server's front door: which Host names it answers (DNS rebinding), which methods act on
it, its settings refused at start, and the bounds on what a request costs before it is queued
(a prompt far past the context, the pool that tokenizes)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import shutil
import subprocess
import sys
import threading

import httpx
import pytest
from transformers import AutoTokenizer

from baby_sgl import Engine
from baby_sgl.entrypoints import native_api
from baby_sgl.server_args import ServerArgs
from conftest import serve_checked, wait_idle

JSON = {"content-type": "application/json"}
TINY = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}


# ---- Host names (the shared server listens on 127.0.0.1 with the default settings) ---------

def test_a_rebinding_page_is_refused_even_with_its_own_origin(server):
    # Before: request_guard.py:_check_headers compared the Origin with the Host only, so a page on
    # attacker.example (resolved to 127.0.0.1) that sends both as its own name passed.
    page = {"host": "attacker.example", "origin": "http://attacker.example"}
    r = httpx.post(server + "/generate", json=TINY, headers=page)
    message = r.json()["error"]["message"]
    assert r.status_code == 403 and "attacker.example" in message and "--allowed-hosts" in message
    port = server.rsplit(":", 1)[1]
    for method, path in [("GET", "/get_server_info"), ("POST", "/flush_cache"), ("GET", "/v1/models")]:
        r = httpx.request(method, server + path, headers={"host": f"attacker.example:{port}"})
        assert r.status_code == 403, path


@pytest.mark.parametrize("host", ["localhost", "LocalHost.:8080", "127.0.0.1", "127.9.9.9:1", "[::1]:30000",
                                  "app.localhost"])
def test_loopback_names_are_answered(server, host):
    assert httpx.get(server + "/get_model_info", headers={"host": host}).status_code == 200


def test_head_health_answers_as_get(server):
    # Before: native_api.py:add_native_routes registered /health for GET only (405 on HEAD).
    r = httpx.head(server + "/health")
    assert r.status_code == 200 and not r.content


# ---- routes that act: POST, or a GET no cross-site page can send ------------------------------

@pytest.mark.parametrize("path", ["/flush_cache", "/health_generate", "/debug/check_memory"])
def test_a_plain_cross_site_get_does_not_act(server, path):
    # Before: native_api.py registered GET /flush_cache and GET /health_generate with no check, so
    # an <img src=".../flush_cache"> on any page flushed the cache (and any page could make the
    # scheduler walk its memory in a loop).
    r = httpx.get(server + path)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "POST" in message and "application/json" in message
    assert httpx.get(server + path, headers=JSON).status_code == 200  # SGLang's own health wait sends this
    assert httpx.post(server + "/flush_cache").status_code == 200  # SGLang's RuntimeEndpoint.flush_cache
    assert httpx.post(server + "/debug/check_memory").status_code == 200


def test_an_image_block_is_refused_by_name(server):
    # Before: anthropic_api.py:Block had no image block, so pydantic said "should be a valid string".
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]}
    for path, extra in (("/v1/messages", {"max_tokens": 4}), ("/v1/messages/count_tokens", {})):
        r = httpx.post(server + path, json=body | extra)
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and "image" in message and "text only" in message, message


# ---- settings refused at start ----------------------------------------------------------------

def test_an_empty_api_key_is_refused_at_start():
    # Before: server_args.py:ServerArgs took "" and request_guard.py:RequestGuard read it as no key.
    with pytest.raises(ValueError, match="--api-key is empty"):
        ServerArgs(api_key="")
    proc = subprocess.run([sys.executable, "-m", "baby_sgl.launch_server", "--api-key", " "],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--api-key is empty" in proc.stderr, proc.stderr


def test_allowed_hosts_are_read_as_a_list():
    from baby_sgl.launch_server import build_parser

    args = build_parser().parse_args(["--allowed-hosts", "a.example, b.example", "--allowed-hosts", "c.example"])
    assert ServerArgs.from_cli_args(args).allowed_hosts == ("a.example", "b.example", "c.example")
    assert ServerArgs.from_cli_args(build_parser().parse_args([])).allowed_hosts == ()


# ---- a server with --allowed-hosts, an API key, a 2-request queue and a long token ------------
KEY = "front-key"
AUTH = {"authorization": f"Bearer {KEY}"}
LONG_TOKEN = "#" * 64  # the longest token: texts up to 64 characters a token could fit the context


class PrepareGate:
    """Holds the templating of any message that says "held" on the pool that prepares requests,
    until the test releases it: the pool's work made as long as the test needs, whatever the CPU."""

    def __init__(self) -> None:
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()

    def wrap(self, apply_chat_template):
        def gated(messages, *args, **kwargs):
            if any(m.get("content") == "held" for m in messages):
                self.entered.release()
                assert self.release.wait(timeout=300), "the test never released the held requests"
            return apply_chat_template(messages, *args, **kwargs)
        return gated


GATE = PrepareGate()


@pytest.fixture(scope="module")
def front(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("long-token") / "model"
    shutil.copytree(tiny_llama, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens([LONG_TOKEN])
    tokenizer.save_pretrained(path)
    template = path / "plain.jinja"
    template.write_text("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: ")
    engine = Engine(str(path), dtype="float32", max_total_tokens=4096, chat_template=str(template))
    manager = engine.tokenizer_manager
    manager.apply_chat_template = GATE.wrap(manager.apply_chat_template)
    args = ServerArgs(api_key=KEY, allowed_hosts=("models.internal", "10.1.2.3"), max_queued_requests=2)
    with serve_checked(engine, args, headers=AUTH) as base:
        yield base


@pytest.mark.parametrize("host, status", [("models.internal", 200), ("Models.Internal:8443", 200),
                                          ("10.1.2.3:80", 200), ("localhost", 200),
                                          ("other.internal", 403), ("10.1.2.4", 403)])
def test_allowed_hosts_are_answered_and_no_others(front, host, status):
    assert httpx.get(front + "/get_model_info", headers=AUTH | {"host": host}).status_code == status


def test_with_the_key_an_acting_get_needs_no_json(front):
    assert httpx.get(front + "/flush_cache").status_code == 401
    assert httpx.get(front + "/flush_cache", headers=AUTH).status_code == 200


def test_a_prompt_far_past_the_context_is_refused_by_its_prefix(front):
    # Before: tokenizer_manager.py:prompt_ids and apply_chat_template tokenized any text under
    # max_input_len * the longest token (64 characters here) in full: count_tokens counted 40k tokens
    # of a 1023-token context.
    words = "ab " * 13_000  # 39k characters, 26k tokens (this tokenizer makes a token a byte)
    r = httpx.post(front + "/generate", json={"text": words, "sampling_params": {"max_new_tokens": 1}}, headers=AUTH)
    assert r.status_code == 400 and "first" in r.text and "the rest was not read" in r.text, r.text
    count = httpx.post(front + "/v1/messages/count_tokens", headers=AUTH,
                       json={"model": "m", "messages": [{"role": "user", "content": words}]})
    assert count.status_code == 400 and "the rest was not read" in count.json()["error"]["message"], count.text
    near = "ab " * 300  # within the context: counted as before
    ok = httpx.post(front + "/v1/messages/count_tokens", headers=AUTH,
                    json={"model": "m", "messages": [{"role": "user", "content": near}]})
    assert ok.status_code == 200 and ok.json()["input_tokens"] > 900


def test_requests_being_prepared_count_against_the_queue_limit(front):
    # Before: chat.py:prepare ran in asyncio.to_thread and async_bridge.py:_submit counted only the
    # engine's queue, so any number of requests could wait to be tokenized beyond --max-queued-requests.
    held = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "held"}]}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        try:
            answers = [pool.submit(httpx.post, front + "/v1/messages", json=held, headers=AUTH, timeout=300)
                       for _ in range(2)]
            for _ in answers:  # both on the pool, neither in the engine's queue yet
                assert GATE.entered.acquire(timeout=60), "a held request never reached the pool"
            r = httpx.post(front + "/generate", json=TINY, headers=AUTH, timeout=60)
            assert r.status_code == 503 and "queue is full" in r.text, r.text
        finally:
            GATE.release.set()  # a failure above must not leave the pool held
        assert [a.result().status_code for a in answers] == [200, 200]
    assert httpx.post(front + "/generate", json=TINY, headers=AUTH).status_code == 200
    wait_idle(front, headers=AUTH)


def test_memory_checks_take_at_most_a_tenth_of_the_time(monkeypatch):
    """Each check runs in the scheduler's thread (~0.1 s at 512k pages); callers looping on it
    held the scheduler between steps. On a clock the test moves: checks of 0.1 s asked for by
    five callers at once run one at a time, 0.9 s apart."""
    clock, starts = [100.0], []

    async def sleep(seconds):
        clock[0] += seconds

    def check():
        starts.append(clock[0])
        clock[0] += 0.1
        return {"ok": len(starts)}

    monkeypatch.setattr(native_api.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(native_api.asyncio, "sleep", sleep)
    async def in_thread(fn):
        return fn()

    monkeypatch.setattr(native_api.asyncio, "to_thread", in_thread)
    calls = native_api.SpacedCalls(check)

    async def five():
        return await asyncio.gather(*(calls.run() for _ in range(5)))

    assert asyncio.run(five()) == [{"ok": k} for k in range(1, 6)]
    assert [round(b - a, 6) for a, b in zip(starts, starts[1:])] == [1.0] * 4  # 0.1 s of work, 0.9 s idle
