"""A real server on a loopback port, started once for all the entrypoint tests; after every
test the server must come back to idle with the KV memory invariant intact."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn

from baby_sgl import Engine
from baby_sgl.distributed.processes import free_port
from baby_sgl.entrypoints.http_server import create_app
from baby_sgl.server_args import ServerArgs
from helpers import wait_until


def start_server(model: str, *flags: str, script: list[str] | None = None, ready: str = "/health",
                 timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """`baby-sgl serve` (or script) on model with these flags on a free loopback port; returns
    (process, base URL) once GET ready answers 200. Fails if it exits or is not up in time,
    with the end of what it wrote to stderr (kept in a file: a pipe nobody reads would stall a
    server that logs much)."""
    port = free_port()
    cmd = (script or [sys.executable, "-m", "baby_sgl.launch_server"]) + ["--model-path", model, "--port", str(port),
                                                                           *flags]
    with tempfile.TemporaryFile() as log:  # the children keep their own descriptors of it
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        base = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, "the server exited while starting"
            try:
                return httpx.get(base + ready, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until(up, f"the server to answer {ready}", timeout=timeout, interval=0.1)
        except AssertionError as e:
            proc.kill()
            end = os.fstat(log.fileno()).st_size  # read where it is, not at the offset the children share
            tail = os.pread(log.fileno(), 4000, max(0, end - 4000)).decode(errors="replace")
            raise AssertionError(f"{e}; the end of its stderr:\n{tail}") from None
    return proc, base


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def all_gone(pids: list[int]) -> bool:
    """None of these processes runs any more (exited zombies count as gone)."""
    return not [p for p in pids if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]]


def wait_idle(base: str, timeout: float = 10.0, headers: dict | None = None) -> dict:
    """Waits until no request runs or waits (aborts land at the scheduler's next step), then
    returns the memory check's counts; fails if either never happens."""
    def idle() -> bool:
        info = httpx.get(base + "/server_info", headers=headers).json()
        return info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0

    wait_until(idle, "no request to run or wait", timeout=timeout, interval=0.05)
    # A GET that acts: sent as SGLang's clients send them (a JSON content type), or with the key.
    r = httpx.get(base + "/debug/check_memory", headers={"Content-Type": "application/json"} | (headers or {}))
    assert r.status_code == 200, r.text
    return r.json()


def server_counter(base: str, name: str) -> float:
    """A counter of the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        if family.name == name:
            return family.samples[0].value
    raise AssertionError(f"no counter {name}")


def aborted_requests(base: str) -> float:
    """The server's count of requests that ended by abort."""
    return server_counter(base, "sglang:num_aborted_requests")


@contextlib.contextmanager
def serve_in_thread(engine: Engine, server_args: ServerArgs | None = None) -> Iterator[str]:
    """The app over engine, served on a free loopback port; yields its base URL. The engine is
    shut down afterwards."""
    port = free_port()
    # A response some test left unread (a stream) would hold shutdown for the join's 10 s.
    srv = uvicorn.Server(uvicorn.Config(create_app(engine, server_args), host="127.0.0.1", port=port,
                                        log_level="error", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(base + "/health").status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, "the server to answer /health", interval=0.05)
    try:
        yield base
    finally:
        srv.should_exit = True
        # Past the graceful second, a stream some test left open can still hold uvicorn's loop
        # (the session server at the suite's end waited out 10 s here): the engine stops anyway.
        thread.join(timeout=3)
        engine.shutdown()


@contextlib.contextmanager
def serve_checked(engine: Engine, server_args: ServerArgs | None = None,
                  headers: dict | None = None) -> Iterator[str]:
    """serve_in_thread, whose server must come back to idle with its memory intact once the tests
    that used it are done (wait_idle, sending headers)."""
    with serve_in_thread(engine, server_args) as base:
        yield base
        wait_idle(base, headers=headers)


@contextlib.contextmanager
def thinking_server(model: str, template_dir, generation_prompt: str = "assistant: ") -> Iterator[str]:
    """A server with --reasoning-parser qwen3 over a template that opens the thinking block when
    enable_thinking is set (as Qwen3's closes it when it is not), after generation_prompt."""
    template = template_dir / "think.jinja"
    template.write_text("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        + generation_prompt + "{% if enable_thinking %}<think>{% endif %}")
    with serve_in_thread(Engine(model, dtype="float32", chat_template=str(template)),
                         ServerArgs(reasoning_parser="qwen3")) as base:
        yield base


@pytest.fixture(scope="session")
def server(tiny_llama):
    engine = Engine(tiny_llama, dtype="float32", max_total_tokens=8192, max_running_requests=48)
    with serve_in_thread(engine) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    """The official OpenAI client on the shared server."""
    return openai.OpenAI(base_url=server + "/v1", api_key="none")


@pytest.fixture(autouse=True)
def memory_clean(server):
    yield
    wait_idle(server)


@pytest.fixture
def idle_counts(server):
    """Waits for the server to be idle and returns its memory check's counts."""
    return lambda: wait_idle(server)
