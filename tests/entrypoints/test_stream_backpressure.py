"""Backpressure on every stream: a client that reads slowly gets a whole, consistent stream; one
that stops reading for --stream-send-timeout seconds is cut off, its request aborted and its KV
freed, while other clients are served; a stream's bytes grow with its output, not its square.
And big request bodies: token-id prompts past the context are refused by their length, and
megabytes of a chat's tool-call arguments are parsed off the event loop."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from baby_sgl import Engine
from baby_sgl.server_args import ServerArgs
from conftest import aborted_requests, serve_checked, server_counter, wait_idle
from helpers import wait_until

SEND_TIMEOUT_S = 1.0
# Entries of every token's logprobs: a few kilobytes of SSE per token, so a client that does not
# read fills the socket's buffers within a few hundred tokens.
HEAVY_LOGPROBS = {"return_logprob": True, "top_logprobs_num": 20, "token_ids_logprob": list(range(256))}
# Seconds on tiny_llama_long, and with HEAVY_LOGPROBS (277 entries a token) within the 3M logprob
# entries a call may ask for.
LONG = {"max_new_tokens": 10000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def impatient_server(tiny_llama_long):
    engine = Engine(tiny_llama_long, dtype="float32", max_total_tokens=65536)
    with serve_checked(engine, ServerArgs(stream_send_timeout=SEND_TIMEOUT_S)) as base:
        yield base


def send_request(base: str, path: str, body: dict) -> socket.socket:
    """A POST on a raw socket with a small receive buffer, its response left unread (HTTP/1.0:
    the response is the bytes up to the server's close)."""
    url = urlsplit(base)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((url.hostname, url.port))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.0\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_to_end(sock: socket.socket) -> bytes:
    sock.settimeout(30)
    parts = []
    while chunk := sock.recv(1 << 16):
        parts.append(chunk)
    sock.close()
    return b"".join(parts)


def sse_payloads(raw: bytes) -> list[str]:
    body = raw.partition(b"\r\n\r\n")[2].decode("utf-8", "replace")
    return [line[6:] for line in body.split("\n") if line.startswith("data: ")]


def running(base: str) -> int:
    return httpx.get(base + "/server_info").json()["num_running_reqs"]


@pytest.mark.parametrize("path, body", [
    ("/generate", {"text": "go on", "stream": True, "sampling_params": LONG} | HEAVY_LOGPROBS),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go on"}], "stream": True, "logprobs": True,
                              "top_logprobs": 20, "max_tokens": LONG["max_new_tokens"], "temperature": 0,
                              "ignore_eos": True}),
])
def test_a_client_that_stops_reading_is_cut_off_and_its_request_aborted(impatient_server, path, body):
    # Failed before: nothing bounded how long a write of a response may wait (uvicorn waits for the
    # socket to drain; http_server.create_app had no send deadline), so the request ran to its end.
    base = impatient_server
    before = aborted_requests(base)
    stalled = send_request(base, path, body)
    wait_until(lambda: running(base) >= 1, "the stalled request to run")
    # Another client is served meanwhile, in full.
    with httpx.stream("POST", base + "/generate", json={"text": "hi", "stream": True, "sampling_params": {
            "max_new_tokens": 8, "ignore_eos": True}}, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["meta_info"]["completion_tokens"] == 8
    assert httpx.get(base + "/health").status_code == 200
    wait_until(lambda: aborted_requests(base) == before + 1, "the stalled request to be aborted", timeout=120)
    wait_idle(base)  # its KV is freed and the memory check is clean
    payloads = sse_payloads(read_to_end(stalled))  # what was buffered, then the server's close
    assert payloads and "[DONE]" not in payloads
    last = json.loads(payloads[-1])
    assert (last.get("meta_info") or last["choices"][0])["finish_reason"] is None


def test_a_slow_reader_gets_the_whole_stream_joined(server):
    """A client that reads nothing until its request has finished (the pieces piled up behind it
    and were joined) still gets every token once: the events' logprob entries, joined, are the
    output's, and each event's own entries are those of the tokens it adds."""
    # Failed before: TokenizerManager.logprobs put every entry so far into each piece
    # (`out = {k: list(v) ...}`), so an event's entries were not those of the tokens it adds.
    body = {"text": "st", "stream": True, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True,
                                                               "temperature": 0}} | HEAVY_LOGPROBS
    done = server_counter(server, "sglang:generation_tokens")
    sock = send_request(server, "/generate", body)
    wait_until(lambda: server_counter(server, "sglang:generation_tokens") == done + 900, "the request to finish")
    payloads = sse_payloads(read_to_end(sock))
    assert payloads[-1] == "[DONE]"
    events = [json.loads(p) for p in payloads[:-1]]
    joined, sent = [], 0
    for e in events:
        meta = e["meta_info"]
        own = meta["output_token_logprobs"]
        assert [t for _, t, _ in own] == e["output_ids"][sent:]  # cumulative ids, this event's entries
        assert len(meta["output_top_logprobs"]) == len(meta["output_token_ids_logprobs"]) == len(own)
        joined += own
        sent = len(e["output_ids"])
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"] == sent
    assert len(joined) == 900 and [t for _, t, _ in joined] == events[-1]["output_ids"]


def _stream_bytes(base: str, new_tokens: int) -> int:
    body = {"text": "st", "stream": True, "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True,
                                                               "temperature": 0}} | HEAVY_LOGPROBS
    with httpx.stream("POST", base + "/generate", json=body, timeout=120) as r:
        return sum(len(b) for b in r.iter_bytes())


def test_logprob_stream_bytes_grow_linearly(server):
    # Failed before: TokenizerManager.logprobs copied every logprob entry so far into each piece
    # (`out = {k: list(v) ...}`), so each event repeated all earlier ones: 2x the tokens, ~4x the bytes.
    n = 200
    assert _stream_bytes(server, 2 * n) < 2.5 * _stream_bytes(server, n)


def test_token_ids_past_the_context_are_refused_before_the_body_is_validated(server):
    # Failed before: protocol.TokenIds admitted 2**24 ids, every one validated on the event loop
    # before the engine refused the prompt's length.
    for path, body in (("/generate", {"input_ids": [5] * 3_000_000}),
                       ("/v1/completions", {"prompt": [[5, 6], [5] * 3_000_000]})):
        r = httpx.post(server + path, json=body, timeout=60)
        name = "input_ids" if path == "/generate" else "prompt"
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (f"prompt is too long: {name} holds 3000000 token ids, more than "
                                                f"the context length 1024")


@pytest.mark.serial  # /health's latency against the parse's time
def test_megabytes_of_tool_call_arguments_are_parsed_off_the_event_loop(server):
    # Failed before: openai_api.chat_completions built the turn (`body.chat_request(constraint)`,
    # which parses every call's arguments) on the event loop, so /health waited for it.
    arguments = json.dumps({"values": [1] * 4_500_000})  # 13.5 MB, under --max-request-bytes
    body = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]}
    health: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        start = time.perf_counter()
        chat = pool.submit(httpx.post, server + "/v1/chat/completions", json=body, timeout=120)
        while not chat.done():
            t = time.perf_counter()
            assert httpx.get(server + "/health", timeout=120).status_code == 200
            health.append(time.perf_counter() - t)
        took = time.perf_counter() - start
    r = chat.result()
    assert r.status_code == 400 and "prompt is too long" in r.json()["error"]["message"]
    # Before, one /health waited out the whole parse (nearly all of `took`); now the parsing thread
    # only competes for the GIL, which once stretched a probe to a third of `took` on 2 busy cores.
    assert max(health) < 0.6 * took
