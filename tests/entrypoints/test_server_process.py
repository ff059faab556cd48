"""The server as a supervisor sees it: a real `baby-sgl serve` process stops on SIGTERM within
a few seconds whatever its clients do, and exits non-zero when its engine dies."""

from __future__ import annotations

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


def start(model: str, script: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    return start_server(model, "--max-total-tokens", "32768", "--request-body-timeout", "60", script=script)


def _stream_forever(base: str, outcome: list) -> None:
    """A LONG streamed request; outcome gets "finished" if it ran to its end, "ended" if the
    stream stopped without a last event, or the name of the client's error."""
    finished = False
    try:
        with httpx.stream("POST", base + "/generate", json={"text": "go", "sampling_params": LONG, "stream": True},
                          timeout=60) as r:
            for line in r.iter_lines():
                finished = finished or '"finish_reason": {' in line
        outcome.append("finished" if finished else "ended")
    except httpx.HTTPError as e:
        outcome.append(type(e).__name__)


def _running(base: str) -> int:
    return httpx.get(base + "/server_info", timeout=10).json()["num_running_reqs"]


def test_sigterm_stops_the_server_within_seconds(tiny_llama_long):
    proc, base = start(tiny_llama_long)
    try:
        outcome: list = []
        threading.Thread(target=_stream_forever, args=(base, outcome), daemon=True).start()
        host, port = base.removeprefix("http://").split(":")
        slow = socket.create_connection((host, int(port)))  # a body that never finishes arriving
        slow.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")
        wait_until(lambda: _running(base) == 1, "the streamed request to run")
        proc.send_signal(signal.SIGTERM)
        # It exits with the stream unfinished and the body still missing (the server would wait
        # 60 s for it): the shutdown waited for neither.
        code = proc.wait(timeout=45)
        slow.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code in (0, -signal.SIGTERM), code  # uvicorn re-raises the signal
    wait_until(lambda: outcome, "the streaming client to see the end")
    assert outcome[0] != "finished", outcome


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
