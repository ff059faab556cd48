"""What the scheduler publishes (managers/snapshots.py, and the queue's length) under the
interleavings a busy machine makes: a sender preempted between its message and what it tells the
readers, a reader that looks while the scheduler is handling its inbox."""

from __future__ import annotations

import threading

import pytest

from baby_sgl import Engine
from helpers import GREEDY, wait_until

_PREEMPTED_S = 2.0  # how long the sender below stays preempted, at most


@pytest.fixture(scope="module")
def one_at_a_time(tiny_llama):
    """One request runs at a time: the others wait in the queue."""
    with Engine(tiny_llama, dtype="float32", max_total_tokens=8192, max_running_requests=1) as engine:
        yield engine
        engine.check_memory()


def test_a_message_taken_before_its_sender_resumes_leaves_readers_answered(engine, monkeypatch):
    # Before: Scheduler._put called `snapshots.unsettle()` after `inbox.put`: a scheduler that took
    # the message and published (settled: idle, inbox empty) before the sender resumed was then
    # marked unsettled, and every reader waited for its next turn, which an idle scheduler takes
    # after _IDLE_WAKE_S (60 s).
    sched = engine.scheduler
    wait_until(lambda: engine.progress().running == engine.progress().waiting == 0, "the engine to be idle")
    taken = threading.Event()  # the scheduler published with the inbox empty
    real_publish, real_put = sched.snapshots.publish, sched.inbox.put

    def publish(*args, **kwargs) -> None:
        real_publish(*args, **kwargs)
        if sched.inbox.empty():
            taken.set()

    def put_then_preempted(msg, *args, **kwargs) -> None:
        taken.clear()
        real_put(msg, *args, **kwargs)
        taken.wait(_PREEMPTED_S)  # the sender resumes only once the scheduler has taken it and published

    monkeypatch.setattr(sched.snapshots, "publish", publish)
    monkeypatch.setattr(sched.inbox, "put", put_then_preempted)
    engine.abort_request("no request has this rid")
    monkeypatch.undo()

    answered = threading.Event()
    reader = threading.Thread(target=lambda: (engine.get_server_info(), answered.set()), daemon=True)
    reader.start()
    # generous against the reader's own cost (milliseconds), far below the idle scheduler's 60 s
    assert answered.wait(20), "server info waited for a turn an idle scheduler does not take"
    reader.join()


def test_a_request_leaving_the_inbox_is_counted_as_queued_throughout(one_at_a_time, monkeypatch):
    # Before: Scheduler._handle took a request off the inbox count (`self._inbox_reqs -= 1`) and
    # the waiting count was published only after the whole inbox was handled: in between, the
    # request counted nowhere, and a request at the --max-queued-requests limit could be let in.
    engine = one_at_a_time
    sched = engine.scheduler
    seen: list[int] = []  # num_queued as other threads saw it, right after the inbox was handled
    real_step = sched.step

    def look_then_step() -> bool:  # a step follows the inbox's handling at once
        if not seen and sched.queues.waiting:
            seen.append(engine.num_queued())
        return real_step()

    monkeypatch.setattr(sched, "step", look_then_step)
    running = engine.submit("runs first", {"max_new_tokens": 300, **GREEDY})
    wait_until(lambda: sched.progress.running, "the first request to run")
    waiting = engine.submit("waits", {"max_new_tokens": 1, **GREEDY})
    wait_until(lambda: seen, "the second request to leave the inbox")
    for req in running + waiting:
        engine.abort_request(req.rid)
    assert seen == [1]
