"""`baby-sgl serve --dp-size 2`: two engine processes behind SGLang's router (sglang-router) on
one port, driven through the router by real clients; SIGTERM on the front stops everything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from entrypoints.conftest import free_port


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.fixture(scope="module")
def dp_server(tiny_llama):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "baby_sgl.launch_server", "--model-path", tiny_llama, "--dtype",
                             "float32", "--dp-size", "2", "--port", str(port), "--max-total-tokens", "2048"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, "the front process exited while starting"
        try:
            if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the router did not come up"
        time.sleep(0.5)
    yield base, proc
    if proc.poll() is None:
        proc.kill()


def test_requests_through_the_router(dp_server):
    base, _ = dp_server
    body = {"text": "shared prefix for both workers", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    outs = [httpx.post(base + "/generate", json=body, timeout=60) for _ in range(3)]
    assert all(r.status_code == 200 for r in outs), [r.text for r in outs]
    assert len({r.json()["text"] for r in outs}) == 1  # greedy: the same answer whichever worker served it
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].message.content is not None
    done = client.completions.create(model="m", prompt="hello", max_tokens=3, temperature=0)
    assert done.usage.completion_tokens <= 3
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True) if c.choices)
    assert isinstance(streamed, str)


def test_sigterm_stops_router_and_workers(dp_server):
    _, proc = dp_server
    children = _children(proc.pid)
    assert len(children) == 3, children  # two workers and the router
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    time.sleep(0.5)
    alive = [pid for pid in children if os.path.exists(f"/proc/{pid}") and
             "Z" not in open(f"/proc/{pid}/stat").read().split()[2]]
    assert not alive, f"left behind: {alive}"
