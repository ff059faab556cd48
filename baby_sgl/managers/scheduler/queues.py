"""Where each request the scheduler holds is: waiting for admission, running (decoding), or the one
whose prompt is being prefilled a chunk at a time; a request is in at most one of them. Also the
batch of the pass being formed or run, whose requests may have left the queues meanwhile."""

from __future__ import annotations

from typing import TYPE_CHECKING

from baby_sgl.core.forward_batch import ForwardMode

if TYPE_CHECKING:
    from baby_sgl.core.req import Req
    from baby_sgl.managers.scheduler.batch import ScheduleBatch


class RequestQueues:
    def __init__(self) -> None:
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.batch: ScheduleBatch | None = None

    def active(self) -> list[Req]:
        """The requests holding KV now: the running ones and the one whose prompt is mid-chunk."""
        return self.running + ([self.chunked] if self.chunked is not None else [])

    def all(self) -> list[Req]:
        return self.waiting + self.active()

    def in_flight(self) -> list[Req]:
        """Every request held: queued, or in the batch of the pass being formed or run."""
        reqs = self.all()
        return reqs + [r for r in (self.batch.reqs if self.batch else []) if r not in reqs]

    def find(self, rid: str) -> list[Req]:
        """The requests with this id (the prompts of a batch given one rid share it)."""
        return [r for r in self.all() if r.rid == rid]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def num_active(self) -> int:
        return len(self.running) + (self.chunked is not None)

    def discard(self, req: Req) -> None:
        """Takes req out of whichever queue holds it (none: nothing happens)."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None

    def admitted(self, reqs: list[Req], chunked: Req | None) -> None:
        """reqs leave the waiting queue for a prefill pass; chunked is the one whose prompt goes on
        in later passes."""
        for req in reqs:
            if req in self.waiting:
                self.waiting.remove(req)
        self.chunked = chunked

    def retracted(self, reqs: list[Req]) -> None:
        """reqs gave their KV back: they resume before newer arrivals."""
        self.running = [r for r in self.running if r not in reqs]
        self.waiting[:0] = reqs

    def settle(self, mode: ForwardMode, still_running: list[Req]) -> None:
        """After a pass: an extend pass's requests that go on decoding join the running ones; a
        decode or mixed pass held every running request, so those that go on are the running ones."""
        if mode == ForwardMode.EXTEND:
            self.running.extend(still_running)
        else:
            self.running = still_running

    def clear(self) -> list[Req]:
        """Empties every queue and forgets the batch; returns the requests they held."""
        reqs = self.in_flight()
        self.waiting, self.running, self.chunked, self.batch = [], [], None, None
        return reqs
