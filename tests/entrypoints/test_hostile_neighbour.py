"""The hostile neighbour: an innocent 16-token /generate beside each hostile load must stay within
3x of its latency alone. One server (a process of its own, so the hostile clients here do not share
its interpreter) serves every scenario; a scenario is one function in SCENARIOS that starts its load
(threads, bounded in count and time), yields once the load is on, and stops it when resumed."""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from baby_sgl import Engine
from baby_sgl.server_args import ServerArgs
from entrypoints.conftest import serve_in_thread, start_server, wait_idle
from helpers import GREEDY, wait_until

pytestmark = pytest.mark.serial  # latencies alone and beside a load, moments apart

RATIO = 3.0  # the innocent beside a hostile load, at most this many times its latency alone
FLOOR_S = 0.25  # "alone" is at least this: below it a scheduler's jitter is not a neighbour's doing
HOSTILE_S = 60.0  # no load runs longer than this, whatever happens
INNOCENT = {"text": "an innocent request", "sampling_params": {"max_new_tokens": 16, **GREEDY}}

Scenario = Callable[[str], contextlib.AbstractContextManager[None]]


@pytest.fixture(scope="module")
def neighbourhood(tiny_llama):
    proc, base = start_server(tiny_llama, "--dtype", "float32", "--max-running-requests", "2")
    try:
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def innocent(base: str) -> float:
    start = time.monotonic()
    r = httpx.post(base + "/generate", json=INNOCENT, timeout=HOSTILE_S)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 16, r.text[:300]
    return time.monotonic() - start


def median_of(base: str, runs: int = 5) -> float:
    return statistics.median(innocent(base) for _ in range(runs))


@contextlib.contextmanager
def clients_in_a_loop(base: str, send: Callable[[httpx.Client], httpx.Response], expect: int, what: str,
                      clients: int) -> Iterator[None]:
    """clients threads each send a request as soon as the last is answered, every answer `expect`;
    yields once every one was answered."""
    stop, answered, wrong = threading.Event(), [0] * clients, []
    deadline = time.monotonic() + HOSTILE_S

    def loop(i: int) -> None:
        with httpx.Client(base_url=base, timeout=HOSTILE_S) as c:
            while not stop.is_set() and time.monotonic() < deadline:
                r = send(c)
                if r.status_code != expect:
                    wrong.append(r.status_code)
                answered[i] += 1

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: all(answered), f"every client of {what} to be answered once", timeout=HOSTILE_S)
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=HOSTILE_S)
    assert not wrong, f"{what} answered {wrong[:5]}"


def pollers(base: str, path: str, clients: int = 16) -> contextlib.AbstractContextManager[None]:
    """clients threads GET path as fast as they are answered."""
    return clients_in_a_loop(base, lambda c: c.get(path), 200, path, clients)


def refused_in_a_loop(base: str, body: dict, clients: int = 4) -> contextlib.AbstractContextManager[None]:
    """clients threads POST body to /generate as fast as they are answered, each answer a 400."""
    return clients_in_a_loop(base, lambda c: c.post("/generate", json=body), 400, "/generate", clients)


def dashboard_pollers(base: str) -> contextlib.AbstractContextManager[None]:
    # Before: each poll was a Scheduler.call, and Scheduler._drain_inbox answered calls until the
    # inbox was empty, which 16 pollers kept it from ever being: the innocent never finished.
    return pollers(base, "/dashboard/state")


def metrics_pollers(base: str) -> contextlib.AbstractContextManager[None]:
    return pollers(base, "/metrics")


def costly_stop_regexes(base: str) -> contextlib.AbstractContextManager[None]:
    # Before: core/sampling_params.py compiled any 32 patterns and scheduler_output.py searched
    # them over the whole output after every token; each such request stalled the scheduler.
    body = {"text": "x", "sampling_params": {"max_new_tokens": 256, "n": 16, "ignore_eos": True,
                                             "stop_regex": [".{1000}" * 36 + "z"] * 32}}
    return refused_in_a_loop(base, body)


# Prompts far past the context and quadratic logprob streams cost the tiny model's server too little
# to slow its neighbour even before their fixes: test_front_door.py and test_stream_backpressure.py
# hold their regression tests.
SCENARIOS: list[Scenario] = [dashboard_pollers, metrics_pollers, costly_stop_regexes]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
def test_an_innocent_request_beside_a_hostile_one(neighbourhood, scenario):
    innocent(neighbourhood)  # warm
    alone = max(median_of(neighbourhood), FLOOR_S)
    with scenario(neighbourhood):
        beside = median_of(neighbourhood, runs=3)
    assert beside <= RATIO * alone, f"{beside:.3f} s beside {scenario.__name__}, {alone:.3f} s alone"
    wait_idle(neighbourhood)


def test_request_ids_on_the_dashboard_only_with_the_key(neighbourhood, tiny_llama):
    """A full rid is all /abort_request needs: without an API key the dashboard shortens them."""
    # Before: scheduler_view.py's _req_view and Activity.last_hit gave every reader the whole rid.
    rid = "someone-elses-request-0001"
    httpx.post(neighbourhood + "/generate", json={**INNOCENT, "rid": rid}, timeout=HOSTILE_S).raise_for_status()
    shown = httpx.get(neighbourhood + "/dashboard/state").json()["activity"]["last_hit"]["rid"]
    assert shown != rid and rid.startswith(shown.rstrip("…")), shown
    wait_idle(neighbourhood)
    engine = Engine(tiny_llama, dtype="float32", max_total_tokens=1024)
    with serve_in_thread(engine, ServerArgs(api_key="sekret")) as base:
        auth = {"Authorization": "Bearer sekret"}
        httpx.post(base + "/generate", json={**INNOCENT, "rid": rid}, headers=auth).raise_for_status()
        assert httpx.get(base + "/dashboard/state", headers=auth).json()["activity"]["last_hit"]["rid"] == rid
        wait_idle(base, headers=auth)
