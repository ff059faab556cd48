"""The server as a supervisor sees it: a real `baby-sgl serve` process stops on SIGTERM within
a few seconds whatever its clients do, and exits non-zero when its engine dies."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from conftest import start_server

LONG = {"max_new_tokens": 16000, "ignore_eos": True}  # runs for seconds on tiny_llama_long


def start(model: str, script: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    return start_server(model, "--max-total-tokens", "32768", "--request-body-timeout", "60", script=script)


def _stream_forever(base: str, outcome: list) -> None:
    try:
        with httpx.stream("POST", base + "/generate", json={"text": "go", "sampling_params": LONG, "stream": True},
                          timeout=60) as r:
            for _ in r.iter_lines():
                pass
        outcome.append("ended")
    except httpx.HTTPError as e:
        outcome.append(type(e).__name__)


def test_sigterm_stops_the_server_within_seconds(tiny_llama_long):
    proc, base = start(tiny_llama_long)
    try:
        outcome: list = []
        threading.Thread(target=_stream_forever, args=(base, outcome), daemon=True).start()
        host, port = base.removeprefix("http://").split(":")
        slow = socket.create_connection((host, int(port)))  # a body that never finishes arriving
        slow.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")
        time.sleep(1.0)
        start_t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=15)
        took = time.monotonic() - start_t
        slow.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code in (0, -signal.SIGTERM) and took < 10, (code, took)  # uvicorn re-raises the signal


def test_a_dead_engine_fails_clients_and_exits_nonzero(tiny_llama_long):
    script = [sys.executable, str(Path(__file__).with_name("dying_server.py"))]
    proc, base = start(tiny_llama_long, script)
    try:
        outcome: list = []
        waiter = threading.Thread(target=_stream_forever, args=(base, outcome), daemon=True)
        waiter.start()
        time.sleep(0.5)
        r = httpx.post(base + "/generate", json={"text": "x", "rid": "die"}, timeout=30)
        assert r.status_code == 503 and "stopped" in r.json()["error"]["message"]
        try:  # until the process is gone, health says it is unhealthy
            assert httpx.get(base + "/health", timeout=5).status_code == 503
        except httpx.ConnectError:
            pass
        code = proc.wait(timeout=15)
        waiter.join(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 1
    assert outcome and outcome[0] != "ended", outcome  # the waiting stream saw an error, not a clean end
    assert not waiter.is_alive()
