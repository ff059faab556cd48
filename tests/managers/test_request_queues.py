"""RequestQueues on its own: where each request is, the moves between queues a scheduling round
makes, and the rid index an abort looks requests up in."""

from __future__ import annotations

from typing import Any

from baby_sgl.core.forward_batch import ForwardMode
from baby_sgl.core.req import Req
from baby_sgl.core.sampling_params import SamplingParams
from baby_sgl.managers.scheduler.queues import RequestQueues


def _reqs(*rids: str) -> list[Req]:
    return [Req(rid, [1, 2, 3], SamplingParams()) for rid in rids]


def _queued(q: RequestQueues, waiting: list[Req], running: list[Req], chunked: Req | None = None) -> None:
    """Puts requests where a scheduling round would: each arrives, then some are admitted."""
    for req in waiting + running + ([chunked] if chunked else []):
        q.add(req)
    q.admitted(running + ([chunked] if chunked else []), chunked)
    q.settle(ForwardMode.EXTEND, running)
    q.check()


def test_active_is_running_then_the_chunked_request():
    q = RequestQueues()
    a, b, c = _reqs("a", "b", "c")
    _queued(q, [a], [b], c)
    assert q.active() == [b, c] and q.all() == [a, b, c] and q.num_active() == 2 and q.has_work()


def test_find_returns_every_request_sharing_an_id():
    # A batch of prompts given one rid shares it: an abort of that rid ends all of them.
    q = RequestQueues()
    first, second, other = _reqs("x", "x", "y")
    _queued(q, [first], [other], second)
    assert q.find("x") == [first, second] and q.find("y") == [other] and q.find("nobody") == []


def test_admission_retraction_and_settling_move_requests_between_queues():
    q = RequestQueues()
    a, b, c = _reqs("a", "b", "c")
    for req in (a, b, c):
        q.add(req)
    q.admitted([a, b], chunked=b)
    assert q.waiting == [c] and q.chunked is b
    q.settle(ForwardMode.EXTEND, [a])  # b's prompt goes on in the next pass
    assert q.running == [a]
    q.retracted([a])  # it resumes before newer arrivals
    assert q.running == [] and q.waiting == [a, c]
    q.settle(ForwardMode.DECODE, [])
    q.discard(b)
    assert q.chunked is None and q.all() == [a, c]
    assert q.clear() == [a, c] and not q.has_work()


def test_the_rid_index_follows_every_move():
    # Each request is found by its rid while some queue holds it, and not once it has left:
    # admitted (the chunked one stays), finished in a pass, retracted, aborted, all cleared.
    q = RequestQueues()
    a, b, c, d1, d2 = _reqs("a", "b", "c", "d", "d")
    for req in (a, b, c, d1, d2):
        q.add(req)
    q.admitted([a, b, c], chunked=c)
    assert q.find("a") == [] and q.find("c") == [c]  # a and b are in the pass, in no queue
    q.check()
    q.settle(ForwardMode.EXTEND, [a, b])
    q.admitted([c, d1], chunked=None)  # c's last chunk, and d1
    q.settle(ForwardMode.MIXED, [a, c, d1])  # b finished, c and d1 go on decoding
    assert q.find("b") == [] and q.find("c") == [c] and {id(r) for r in q.find("d")} == {id(d1), id(d2)}
    q.check()
    q.retracted([c])
    q.discard(d1)  # aborted
    assert q.find("c") == [c] and q.find("d") == [d2]
    q.check()
    q.settle(ForwardMode.DECODE, [a])
    assert q.find("a") == [a] and q.all() == [c, d2, a]
    q.check()
    q.clear()
    assert q.find("a") == q.find("c") == q.find("d") == []
    q.check()


class _CountedReq(Req):
    """A request that counts how often its rid is read."""
    rid_reads = 0

    def __getattribute__(self, name: str) -> Any:
        if name == "rid":
            _CountedReq.rid_reads += 1
        return super().__getattribute__(name)


def test_an_abort_of_an_unknown_rid_reads_no_queued_request():
    # A flood of /abort_request with made-up rids must not cost the scheduler thread a scan of
    # every queued request each.
    q = RequestQueues()
    reqs = [_CountedReq(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(1000)]
    _queued(q, reqs[:600], reqs[600:999], reqs[999])
    _CountedReq.rid_reads = 0
    assert q.find("nobody") == [] and q.find("r700") == [reqs[700]]
    assert _CountedReq.rid_reads == 0
