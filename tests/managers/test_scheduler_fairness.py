"""No client can starve or bloat the scheduler: its loop answers only the messages present when
it looks (a step always runs in between), server info and the dashboard come from what it
publishes (no work in its thread per read), waiting requests are matched against the radix tree
only when the tree changed, an abort that overtakes its request's submission still ends it, and a
finished request keeps neither its drafting state nor, in a session, more than its tokens."""

from __future__ import annotations

import asyncio
import gc
import queue
import threading
import time
import tracemalloc

import pytest

from baby_sgl import Engine
from baby_sgl.entrypoints.async_bridge import AsyncEngine
from baby_sgl.entrypoints.metrics import Metrics
from baby_sgl.managers.scheduler import scheduler as scheduler_module
from baby_sgl.managers.messages import Call
from baby_sgl.managers.snapshots import VIEW_INTERVAL_S
from baby_sgl.mem_cache.radix_cache import RadixCache
from helpers import GREEDY, hold_submissions, wait_until


@pytest.fixture(scope="module")
def one_at_a_time(tiny_llama):
    """One request runs at a time: the others wait in the queue."""
    with Engine(tiny_llama, dtype="float32", max_total_tokens=8192, max_running_requests=1) as engine:
        yield engine


# ---- the loop ----------------------------------------------------------------------------------
def test_calls_that_keep_coming_cannot_starve_a_request(engine):
    # Before: Scheduler._drain_inbox answered `Call`s `while True` until the inbox was empty, so a
    # call that is always followed by another (16 pollers of /dashboard/state) kept step() from
    # ever running and this request never finished.
    sched, stop = engine.scheduler, threading.Event()

    def poll_again() -> None:  # each answer brings the next question, as a tight polling loop does
        if not stop.is_set():
            sched.inbox.put(Call(poll_again, queue.Queue()))

    sched.inbox.put(Call(poll_again, queue.Queue()))
    done = threading.Event()
    worker = threading.Thread(target=lambda: (engine.generate("innocent", {"max_new_tokens": 16, **GREEDY}),
                                              done.set()), daemon=True)
    worker.start()
    try:
        wait_until(done.is_set, "the request to finish beside a call that never stops coming", timeout=30)
    finally:
        stop.set()
        worker.join(timeout=30)


def test_reads_are_fresh_and_cost_the_scheduler_one_snapshot_per_interval(engine, monkeypatch):
    """Server info is read from what the scheduler publishes every turn, yet counts what finished
    before the question; dashboard readers share snapshots taken at most every VIEW_INTERVAL_S."""
    taken = []
    real = scheduler_module.take_snapshot
    monkeypatch.setattr(scheduler_module, "take_snapshot", lambda *parts: taken.append(1) or real(*parts))
    before = engine.get_server_info()["generation_tokens"]
    engine.generate("fresh", {"max_new_tokens": 5, **GREEDY})
    info = engine.get_server_info()
    assert info["generation_tokens"] == before + 5 and info["num_running_reqs"] == 0
    stop, reads = threading.Event(), []

    def poll() -> None:
        while not stop.is_set():
            reads.append(engine.scheduler_view(max_nodes=5))

    pollers = [threading.Thread(target=poll) for _ in range(8)]
    start = time.monotonic()
    for p in pollers:
        p.start()
    engine.generate(["busy 1", "busy 2"], {"max_new_tokens": 200, **GREEDY})
    stop.set()
    for p in pollers:
        p.join()
    elapsed = time.monotonic() - start
    assert len(taken) <= 2 + elapsed / VIEW_INTERVAL_S and len(reads) >= 2 * len(taken), (len(taken), len(reads))
    assert engine.scheduler_view()["running"]["count"] == 0
    taken.clear()
    for _ in range(5):  # an idle scheduler's snapshot serves every later reader
        engine.scheduler_view()
    assert len(taken) <= 1


# ---- N2: the waiting queue is matched only when the tree changed ------------------------------
def _count_matches(engine: Engine, monkeypatch) -> list[int]:
    calls: list[int] = []
    real = RadixCache.match_prefix
    monkeypatch.setattr(RadixCache, "match_prefix", lambda tree, key, *extra: calls.append(1) or real(tree, key, *extra))
    return calls


def test_a_long_waiting_queue_is_not_matched_at_every_step(one_at_a_time, monkeypatch):
    # Before: BatchFormation._try_prefill called _match_waiting(), which matched every waiting
    # request against the tree at every step: 40 requests x ~32 steps here.
    calls = _count_matches(one_at_a_time, monkeypatch)
    prompt = "a shared system prompt that every variant repeats " * 4
    prompts = [prompt + f"variant {i}" for i in range(40)]
    outs = one_at_a_time.generate(prompts, {"max_new_tokens": 32, **GREEDY})
    assert len(outs) == 40 and all(o["meta_info"]["completion_tokens"] == 32 for o in outs)
    assert len(calls) <= 2 * len(prompts), len(calls)


def test_a_cache_aware_queue_is_matched_again_only_when_the_tree_changed(tiny_llama, monkeypatch):
    # Before: lpm matched the whole queue at every step (BatchFormation._match_waiting), ~9 x 64
    # steps for these; now once per tree change (an insertion when a request's prefill ends or it
    # finishes) for each request that waits.
    with Engine(tiny_llama, dtype="float32", max_total_tokens=8192, max_running_requests=1,
                schedule_policy="lpm") as engine:
        calls = _count_matches(engine, monkeypatch)
        prompts = [f"question number {i} about the cache" for i in range(10)]
        engine.generate(prompts, {"max_new_tokens": 64, **GREEDY})
        waits = sum(range(len(prompts)))  # request i waits while i others run
        assert len(calls) <= 3 * waits + len(prompts), len(calls)
        engine.check_memory()


# ---- N8: an abort that overtakes its request's submission -------------------------------------
def test_an_abort_sent_while_the_request_is_submitted_ends_it(engine, monkeypatch):
    # Before: AsyncEngine.abort found the rid reserved with no requests yet (`for req in
    # self.active.get(rid, [])`) and sent nothing, so the request ran to its end.
    aengine = AsyncEngine(engine, Metrics("tiny"))
    submitting, aborted = hold_submissions(engine, monkeypatch)

    async def run() -> dict:
        item = {"prompt": "slow to submit", "sampling_params": {"max_new_tokens": 200, **GREEDY}, "rid": "early"}
        result = asyncio.ensure_future(_collect(aengine, item))
        await asyncio.to_thread(submitting.wait, 30)
        aengine.abort("early")
        aborted.set()
        return await result

    out = asyncio.run(run())
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["meta_info"]["completion_tokens"] < 200


def test_an_abort_for_no_request_spares_a_later_request_with_that_rid(engine):
    aengine = AsyncEngine(engine, Metrics("tiny"))
    aengine.abort("later")  # nothing is being submitted: there is nothing it could have meant
    item = {"prompt": "later", "sampling_params": {"max_new_tokens": 8, **GREEDY}, "rid": "later"}
    out = asyncio.run(_collect(aengine, item))
    assert out["meta_info"]["finish_reason"]["type"] == "length"


async def _collect(aengine: AsyncEngine, item: dict) -> dict:
    return [chunk async for _, chunk in aengine.generate([item], stream=False)][0]


# ---- N1: what a finished request keeps ---------------------------------------------------------
@pytest.fixture(scope="module")
def ngram(tiny_llama):
    """Drafts from each request's own text only: the index of the prefix cache's text is shared by
    all requests, and bounded by --speculative-ngram-capacity."""
    with Engine(tiny_llama, dtype="float32", max_total_tokens=8192, speculative_algorithm="NGRAM",
                speculative_ngram_request_only=True) as engine:
        yield engine


def test_a_finished_request_drops_its_drafting_state(ngram):
    # Before: Speculation._plan_drafts set the drafting state (now req.spec.drafts) and nothing cleared it.
    done = threading.Event()
    reqs = ngram.submit("repeat repeat repeat repeat", {"max_new_tokens": 32, **GREEDY},
                        on_output=lambda out: out["finished"] and done.set())
    assert done.wait(60)
    assert ngram.get_server_info()["spec_draft_chances"] > 0  # drafts were planned for it
    assert reqs[0].spec.drafts is None
    ngram.check_memory()


def test_finished_session_turns_keep_only_their_tokens(ngram):
    # Before: SessionController.attach kept every turn's Req whole (session.reqs[req.rid] = req):
    # its top-20 output logprobs (~130 bytes a token each) and its drafting state, turn after turn.
    sid = ngram.open_session(capacity_of_str_len=1 << 20)
    last = None

    def turn(i: int) -> None:
        nonlocal last
        out = ngram.generate(f" turn {i}.", {"max_new_tokens": 48, **GREEDY}, return_logprob=True,
                             top_logprobs_num=20, session_params={"id": sid, "rid": last})
        last = out["meta_info"]["id"]

    tracemalloc.start()
    try:
        for i in range(3):  # what one turn holds while the next starts is traced from here on
            turn(i)
        gc.collect()
        before = tracemalloc.take_snapshot()
        turns = 12
        for i in range(3, 3 + turns):
            turn(i)
        gc.collect()
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    ngram.close_session(sid)
    assert grown / turns < 16_000, f"{grown / turns:.0f} bytes kept per finished turn"
    ngram.check_memory()
