"""What the scheduler publishes (managers/snapshots.py) under the interleavings a busy machine
makes: a sender preempted between its message and what it tells the readers."""

from __future__ import annotations

import threading

from helpers import wait_until

_PREEMPTED_S = 2.0  # how long the sender below stays preempted, at most


def test_a_message_taken_before_its_sender_resumes_leaves_readers_answered(engine, monkeypatch):
    # Before: Scheduler._put called `snapshots.unsettle()` after `inbox.put`: a scheduler that took
    # the message and published (settled: idle, inbox empty) before the sender resumed was then
    # marked unsettled, and every reader waited for its next turn, which an idle scheduler takes
    # after _IDLE_WAKE_S (60 s).
    sched = engine.scheduler
    wait_until(lambda: not sched.has_work(), "the engine to be idle")
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
