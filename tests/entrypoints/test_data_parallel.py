"""`baby-sgl serve --dp-size 2`: two engine processes behind SGLang's router (sglang-router) on
one port, driven through the router by real clients: the cache_aware policy keeps a shared-prefix
workload's cache hits (against round_robin and a single server), a killed worker is routed
around, SIGTERM on the front stops everything. The workers' memory is checked directly."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess

import httpx
import openai
import pytest

from helpers import wait_until
from entrypoints.conftest import all_gone, child_pids, free_port, start_server, wait_idle
from baby_sgl.entrypoints.data_parallel import router_executable


@pytest.fixture(scope="module")
def dp_server(tiny_llama_long):  # its long requests must still run when a worker is killed
    proc, base = start_server(tiny_llama_long, "--dtype", "float32", "--dp-size", "2", "--max-total-tokens", "32768",
                              ready="/v1/models", timeout=180)
    yield base, proc
    if proc.poll() is None:  # a test stopped early: stop it as a supervisor would
        proc.terminate()
        proc.wait(timeout=60)


def _workers(base: str) -> list[str]:
    return [w["url"] for w in httpx.get(base + "/workers", timeout=10).json()["workers"]]


def _wait_ready(base: str, healthy: int, timeout: float = 60) -> None:
    """Until the router counts this many healthy workers (and no more)."""
    def counted() -> bool:
        try:
            return httpx.get(base + "/readiness", timeout=5).json().get("healthy_workers") == healthy
        except (httpx.HTTPError, ValueError):
            return False

    wait_until(counted, f"the router to count {healthy} healthy workers", timeout=timeout, interval=0.2)


def _check_workers_idle(base: str) -> None:
    for url in _workers(base):
        wait_idle(url, timeout=30)  # the memory invariant, asserted in each worker's scheduler


def test_requests_through_the_router(dp_server):
    base, _ = dp_server
    body = {"text": "shared prefix for both workers", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    outs = [httpx.post(base + "/generate", json=body, timeout=60) for _ in range(3)]
    assert all(r.status_code == 200 for r in outs), [r.text for r in outs]
    assert len({r.json()["text"] for r in outs}) == 1  # greedy: the same answer whichever worker served it
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    kw = dict(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
              extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(**kw)
    assert chat.usage.completion_tokens == 4 and chat.choices[0].finish_reason == "length"
    # greedy: the streamed reply is the same text, whichever worker serves it
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == chat.choices[0].message.content
    done = client.completions.create(model="m", prompt="hello", max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 3 and done.choices[0].finish_reason == "length"
    # each worker reports its own rank in SGLang's load report
    ranks = sorted(httpx.get(url + "/get_load", timeout=10).json()[0]["dp_rank"] for url in _workers(base))
    assert ranks == [0, 1]
    _check_workers_idle(base)


# A shared-prefix workload: groups of requests whose prompts share a long prefix (one character is
# one token for the tiny model's byte-level tokenizer) and differ in a short question.
GROUPS, PER_GROUP = 4, 4


def _prompt(group: int, i: int) -> str:
    prefix = f"Group {group} shares this system prompt. " + "Context about the topic at hand. " * 4
    return prefix + f"Question {i}: what follows {i * 7 + group}?"


def _hit_rate(base: str, spread_by_load: bool = False) -> float:
    """Sends the workload, first one request of each group at once, then the others one group
    after another; returns cached / prompt tokens. spread_by_load: the first requests generate long
    enough to be still running when the next arrives, so a load-aware router spreads the groups
    (the prompts, and so the hit rate a router can reach, are the same either way)."""
    httpx.post(base + "/flush_cache", timeout=30).raise_for_status()

    def send(group: int, i: int) -> dict:
        new = 3000 if i == 0 and spread_by_load else 2
        body = {"text": _prompt(group, i), "sampling_params": {"max_new_tokens": new, "temperature": 0,
                                                               "ignore_eos": True}}
        r = httpx.post(base + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]

    with concurrent.futures.ThreadPoolExecutor(GROUPS) as pool:
        metas = list(pool.map(send, range(GROUPS), [0] * GROUPS))
    metas += [send(g, i) for g in range(GROUPS) for i in range(1, PER_GROUP)]
    assert len(metas) == GROUPS * PER_GROUP
    cached = sum(m["cached_tokens"] for m in metas)
    return cached / sum(m["prompt_tokens"] for m in metas)


def _prompt_tokens(url: str) -> int:
    return httpx.get(url + "/server_info", timeout=10).json()["prompt_tokens"]


def test_cache_aware_routing_keeps_prefix_hits(dp_server, tmp_path):
    """The same workload through the cache_aware router, through a round_robin router over the
    same two workers, and straight to one worker (a single server)."""
    base, _ = dp_server
    urls = _workers(base)
    before = [_prompt_tokens(u) for u in urls]
    cache_aware = _hit_rate(base, spread_by_load=True)
    spread = [_prompt_tokens(u) - b for u, b in zip(urls, before)]
    port = free_port()
    rr = subprocess.Popen([router_executable(), "launch", "--worker-urls", *urls, "--policy", "round_robin",
                           "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                           "--prometheus-port", str(free_port()), "--log-level", "error"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        rr_base = f"http://127.0.0.1:{port}"
        _wait_ready(rr_base, 2)
        round_robin = _hit_rate(rr_base)
    finally:
        rr.terminate()
        rr.wait(timeout=30)
    single = _hit_rate(urls[0])
    print(f"\ncache hit rate: single server {single:.3f}, cache_aware {cache_aware:.3f} "
          f"(prompt tokens per worker {spread}), round_robin {round_robin:.3f}")
    assert all(n > 0 for n in spread), spread  # the groups were spread over both workers
    assert cache_aware >= 0.95 * single
    assert round_robin < cache_aware - 0.05
    _check_workers_idle(base)


def _worker_pid(front_pid: int, url: str) -> int:
    port = url.rsplit(":", 1)[1]
    for pid in child_pids(front_pid):
        argv = open(f"/proc/{pid}/cmdline").read().split("\0")
        if "--port" in argv and argv[argv.index("--port") + 1] == port:
            return pid
    raise AssertionError(f"no worker process listens on {url}")


def _sse_lines(r: httpx.Response):
    """The stream's lines, split at newlines only (SSE's rule): httpx's iter_lines also splits at
    characters such as U+0085 or U+2028, which a long random output sends unescaped in its text."""
    buf = b""
    for chunk in r.iter_bytes():
        *lines, buf = (buf + chunk).split(b"\n")
        yield from (line.decode() for line in lines)


def _long_request(base: str, text: str, stream: bool) -> dict:
    """A long /generate; returns what the client saw: the last event or the answer, or the error."""
    body = {"text": text, "stream": stream, "sampling_params": {"max_new_tokens": 6000, "ignore_eos": True}}
    last = None
    try:
        with httpx.stream("POST", base + "/generate", json=body, timeout=60) as r:
            if not stream:
                r.read()
                return {"status": 200, "last": r.json()} if r.status_code == 200 else \
                    {"status": r.status_code, "error": r.text}
            if r.status_code != 200:
                return {"status": r.status_code, "error": r.read().decode()}
            for line in _sse_lines(r):
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = json.loads(line[6:])
    except httpx.HTTPError as e:
        return {"status": 200, "error": f"{type(e).__name__}: {e}", "last": last}
    except json.JSONDecodeError:  # the body ended inside an event
        return {"status": 200, "error": f"incomplete chunked read: a cut event {line!r:.60}", "last": last}
    return {"status": 200, "last": last}


def test_killed_worker_is_routed_around(dp_server):
    """kill -9 of a worker while both serve requests, streamed and not: the dead worker's
    streams are cut (the client's read fails) and its other requests get the router's 500, the
    other worker's requests finish, the router stops sending to the dead one within seconds,
    nothing hangs, and the survivor's memory is intact."""
    base, front = dp_server
    urls = _workers(base)
    # Prompts with nothing in common, sent one at a time: the router places each on the less
    # loaded worker; where each landed is read from the workers' load reports.
    kinds = [("alpha beta", True), ("quick brown fox", False), ("lorem ipsum", False), ("zebra crossing", True)]
    placed = {url: [] for url in urls}
    with concurrent.futures.ThreadPoolExecutor(len(kinds)) as pool:
        for text, stream in kinds:
            before = {u: _prompt_tokens(u) for u in urls}
            future = pool.submit(_long_request, base, text, stream)
            landed = wait_until(lambda before=before: [u for u in urls if _prompt_tokens(u) > before[u]],
                                "the request to reach a worker")
            assert not future.done(), future.result()
            placed[landed[0]].append((stream, future))
        victim = next(u for u in urls if {s for s, _ in placed[u]} == {True, False})
        survivor = next(u for u in urls if u != victim)
        os.kill(_worker_pid(front.pid, victim), signal.SIGKILL)
        outcomes = {u: [(stream, f.result(timeout=120)) for stream, f in placed[u]] for u in urls}  # nothing hangs
    for stream, o in outcomes[victim]:
        if stream:  # the router ends the chunked body early
            assert o["status"] == 200 and "incomplete chunked read" in o["error"], o
        else:  # the router's 500 names the failed upstream call
            assert o["status"] == 500 and "call_upstream_request_error" in o["error"], o
    for _, o in outcomes[survivor]:
        assert "error" not in o and o["last"]["meta_info"]["finish_reason"]["type"] == "length", o
    _wait_ready(base, 1, timeout=30)  # the health check took the dead worker out
    assert [w["url"] for w in httpx.get(base + "/workers").json()["workers"] if w["is_healthy"]] == [survivor]
    body = {"text": "after the kill", "sampling_params": {"max_new_tokens": 4}}
    after = [httpx.post(base + "/generate", json=body, timeout=60) for _ in range(4)]
    assert [r.status_code for r in after] == [200] * 4, [r.text for r in after]
    wait_idle(survivor, timeout=30)


def test_no_child_outlives_a_killed_front(tiny_llama):
    """kill -9 of the front process (it cannot stop anything itself): the workers and the router
    are told by the kernel and stop."""
    proc, base = start_server(tiny_llama, "--dtype", "float32", "--dp-size", "2", "--max-total-tokens", "1024",
                              ready="/v1/models", timeout=180)
    try:
        _wait_ready(base, 2, timeout=180)
        children = child_pids(proc.pid)
        assert len(children) == 3
    finally:
        proc.kill()
        proc.wait()
    wait_until(lambda: all_gone(children), "the workers and the router to exit with the front process", interval=0.5)


def test_sigterm_stops_router_and_workers(dp_server):
    _, proc = dp_server
    children = child_pids(proc.pid)
    assert len(children) == 3, children  # two workers and the router
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    wait_until(lambda: all_gone(children), "the router and workers to exit", timeout=10)
