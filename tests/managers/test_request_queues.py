"""RequestQueues on its own: where each request is, and the moves between queues a scheduling round
makes."""

from __future__ import annotations

from baby_sgl.core.forward_batch import ForwardMode
from baby_sgl.core.req import Req
from baby_sgl.core.sampling_params import SamplingParams
from baby_sgl.managers.scheduler.queues import RequestQueues


def _reqs(*rids: str) -> list[Req]:
    return [Req(rid, [1, 2, 3], SamplingParams()) for rid in rids]


def test_active_is_running_then_the_chunked_request():
    q = RequestQueues()
    a, b, c = _reqs("a", "b", "c")
    q.waiting, q.running, q.chunked = [a], [b], c
    assert q.active() == [b, c] and q.all() == [a, b, c] and q.num_active() == 2 and q.has_work()


def test_find_returns_every_request_sharing_an_id():
    # A batch of prompts given one rid shares it: an abort of that rid ends all of them.
    q = RequestQueues()
    first, second, other = _reqs("x", "x", "y")
    q.waiting, q.running, q.chunked = [first], [other], second
    assert q.find("x") == [first, second] and q.find("nobody") == []


def test_admission_retraction_and_settling_move_requests_between_queues():
    q = RequestQueues()
    a, b, c = _reqs("a", "b", "c")
    q.waiting = [a, b, c]
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
