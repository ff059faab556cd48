"""The server as a supervisor sees it: a real `baby-sgl serve` process stops on SIGTERM (new
requests refused, open ones answered within --graceful-shutdown-timeout, exit code 0) whatever
its clients do, and exits non-zero when its engine dies."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from conftest import start_server
from helpers import wait_until

LONG = {"max_new_tokens": 16000, "ignore_eos": True}  # runs for seconds on tiny_llama_long


def start(model: str, script: list[str] | None = None, *flags: str) -> tuple[subprocess.Popen, str]:
    return start_server(model, "--max-total-tokens", "32768", "--request-body-timeout", "60", *flags, script=script)


def _stream_forever(base: str, outcome: list, max_new_tokens: int = LONG["max_new_tokens"]) -> None:
    """A long streamed request; outcome gets the type of its finish reason ("length", "abort") if
    its stream ended with a last event, "ended" if it stopped without one, or the client's error."""
    reason = "ended"
    params = LONG | {"max_new_tokens": max_new_tokens}
    try:
        with httpx.stream("POST", base + "/generate", json={"text": "go", "sampling_params": params, "stream": True},
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    reason = (json.loads(line[6:])["meta_info"]["finish_reason"] or {}).get("type", reason)
        outcome.append(reason)
    except httpx.HTTPError as e:
        outcome.append(type(e).__name__)


def _running(base: str) -> int:
    return httpx.get(base + "/server_info", timeout=10).json()["num_running_reqs"]


def _stopping(base: str) -> bool:
    r = httpx.get(base + "/health", timeout=10)
    assert r.status_code in (200, 503), r.text
    return r.status_code == 503 and "shutting down" in r.json()["error"]["message"]


def test_sigterm_refuses_new_requests_and_answers_the_open_ones(tiny_llama_long):
    # Before: launch_server.py:launch_server gave uvicorn 3 s (GRACEFUL_SHUTDOWN_S), then cut the
    # open streams without a last event, kept answering new requests meanwhile, and exited by the
    # re-raised signal (-15).
    proc, base = start(tiny_llama_long, None, "--graceful-shutdown-timeout", "2")
    try:
        outcome: list = []
        threading.Thread(target=_stream_forever, args=(base, outcome, 32000), daemon=True).start()
        host, port = base.removeprefix("http://").split(":")
        slow = socket.create_connection((host, int(port)))  # a body that never finishes arriving
        slow.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")
        wait_until(lambda: _running(base) == 1, "the streamed request to run")
        proc.send_signal(signal.SIGTERM)
        # The stream and the body keep the server stopping for seconds: meanwhile new requests get 503.
        wait_until(lambda: _stopping(base), "a new request to be refused with 503")
        refused = httpx.post(base + "/generate", json={"text": "late", "sampling_params": {"max_new_tokens": 1}})
        assert refused.status_code == 503
        # It exits with the body still missing (the server would wait 60 s for it).
        code = proc.wait(timeout=45)
        slow.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0
    wait_until(lambda: outcome, "the streaming client to see the end")
    assert outcome == ["abort"]  # 32000 tokens do not fit in 2 s: aborted, and told so in a last event


def test_sigterm_lets_a_running_request_finish(tiny_llama_long):
    proc, base = start(tiny_llama_long, None, "--graceful-shutdown-timeout", "300")
    try:
        outcome: list = []
        # 4000 tokens still run for seconds after the signal (16000 made this test take ~28 s).
        threading.Thread(target=_stream_forever, args=(base, outcome, 4000), daemon=True).start()
        wait_until(lambda: _running(base) == 1, "the streamed request to run")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)  # once the request is answered, not after the 300 s
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0
    wait_until(lambda: outcome, "the streaming client to see the end")
    assert outcome == ["length"]


def test_a_dead_engine_fails_clients_and_exits_nonzero(tiny_llama_long):
    script = [sys.executable, str(Path(__file__).with_name("dying_server.py"))]
    proc, base = start(tiny_llama_long, script)
    try:
        outcome: list = []
        waiter = threading.Thread(target=_stream_forever, args=(base, outcome), daemon=True)
        waiter.start()
        wait_until(lambda: _running(base) == 1, "the streamed request to run")
        r = httpx.post(base + "/generate", json={"text": "x", "rid": "die"}, timeout=30)
        assert r.status_code == 503 and "stopped" in r.json()["error"]["message"]
        try:  # until the process is gone, health says it is unhealthy
            assert httpx.get(base + "/health", timeout=5).status_code == 503
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            pass  # gone, or going: a connection the closing listener had queued is reset unanswered
        code = proc.wait(timeout=15)
        waiter.join(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 1
    assert outcome and outcome[0] != "ended", outcome  # the waiting stream saw an error, not a clean end
    assert not waiter.is_alive()
