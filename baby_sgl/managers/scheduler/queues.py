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
    """The queues are read freely but changed only through these methods, which keep `_by_rid` in
    step: rid -> the requests with that rid in waiting, running or chunked (a batch of prompts given
    one rid shares it). An abort finds its requests there, not by scanning every queue: a flood of
    aborts of unknown rids costs the scheduler thread a lookup each."""

    def __init__(self) -> None:
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.batch: ScheduleBatch | None = None
        self._by_rid: dict[str, list[Req]] = {}

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
        return list(self._by_rid.get(rid, ()))

    def add(self, req: Req) -> None:
        """A new request waits for admission."""
        self.waiting.append(req)
        self._index(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def num_active(self) -> int:
        return len(self.running) + (self.chunked is not None)

    def discard(self, req: Req) -> None:
        """Takes req out of whichever queue holds it (none: nothing happens)."""
        if req in self.waiting:
            self.waiting.remove(req)
            self._unindex(req)
        if req in self.running:
            self.running.remove(req)
            self._unindex(req)
        if self.chunked is req:
            self._set_chunked(None)

    def admitted(self, reqs: list[Req], chunked: Req | None) -> None:
        """reqs leave the waiting queue for a prefill pass; chunked is the one whose prompt goes on
        in later passes."""
        for req in reqs:
            if req in self.waiting:
                self.waiting.remove(req)
                self._unindex(req)
        self._set_chunked(chunked)

    def retracted(self, reqs: list[Req]) -> None:
        """reqs gave their KV back: they resume before newer arrivals."""
        was_running = set(self.running)
        self.running = [r for r in self.running if r not in reqs]
        self.waiting[:0] = reqs
        for req in reqs:
            if req not in was_running:  # normally all were: they move, and stay indexed
                self._index(req)

    def settle(self, mode: ForwardMode, still_running: list[Req]) -> None:
        """After a pass: an extend pass's requests that go on decoding join the running ones; a
        decode or mixed pass held every running request, so those that go on are the running ones."""
        if mode == ForwardMode.EXTEND:
            self.running.extend(still_running)
            for req in still_running:
                self._index(req)
            return
        before, after = set(self.running), set(still_running)
        for req in self.running:
            if req not in after:  # finished (or aborted) in the pass
                self._unindex(req)
        for req in still_running:
            if req not in before:  # a mixed pass's extended requests
                self._index(req)
        self.running = still_running

    def clear(self) -> list[Req]:
        """Empties every queue and forgets the batch; returns the requests they held."""
        reqs = self.in_flight()
        self.waiting, self.running, self.chunked, self.batch = [], [], None, None
        self._by_rid = {}
        return reqs

    def check(self) -> None:
        """Asserts that the rid index holds exactly the queued requests, each once."""
        queued: dict[str, list[int]] = {}
        for req in self.all():
            queued.setdefault(req.rid, []).append(id(req))
        indexed = {rid: sorted(map(id, reqs)) for rid, reqs in self._by_rid.items()}
        assert indexed == {rid: sorted(ids) for rid, ids in queued.items()}, "the rid index and the queues disagree"

    def _set_chunked(self, req: Req | None) -> None:
        if self.chunked is not None:
            self._unindex(self.chunked)
        self.chunked = req
        if req is not None:
            self._index(req)

    def _index(self, req: Req) -> None:
        self._by_rid.setdefault(req.rid, []).append(req)

    def _unindex(self, req: Req) -> None:
        same = self._by_rid[req.rid]
        same.remove(req)
        if not same:
            del self._by_rid[req.rid]
