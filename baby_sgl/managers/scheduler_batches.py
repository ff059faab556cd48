"""How the scheduler forms each pass's batch (a part of Scheduler, run in its thread): the next
prefill batch from the waiting queue (prefix matching, the policy's order, admission within the
memory left, chunking), the running requests mixed into it (--enable-mixed-chunk), or a decode
batch of the running requests, retracting some when the KV pool is short."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from baby_sgl.managers.schedule_batch import ScheduleBatch
from baby_sgl.managers.scheduler_state import SchedulerState
from baby_sgl.managers.schedule_policy import (MAX_CONSIDERED_PER_STEP, AddResult, PrefillAdder, match_prefix,
                                               shares_uncached_prefix, sort_waiting, sorts_by_prefix)
from baby_sgl.core.finish_reason import FinishAbort
from baby_sgl.core.forward_batch import ForwardMode

if TYPE_CHECKING:
    from baby_sgl.core.req import Req

logger = logging.getLogger(__name__)

# Fraction of their remaining max_new_tokens that running requests are assumed to still need:
# starts high, decays while decode goes well, is reset by a retraction (as SGLang does).
INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_DECAY = 0.7, 0.1, 0.002


class BatchFormation(SchedulerState):
    """Scheduler's batch forming; the state it reads and writes is the Scheduler's."""

    def _new_schedule_batch(self, reqs: list[Req], mode: ForwardMode) -> ScheduleBatch:
        self.cur_batch = ScheduleBatch(reqs, mode, self.req_to_token_pool, self.allocator, self.tree_cache)
        return self.cur_batch

    def _get_new_batch_prefill(self) -> ScheduleBatch | None:
        while True:
            batch, short_of_memory = self._try_prefill()
            # Nothing fits and nothing runs: idle streaming sessions give their KV back, one at
            # a time, before anyone waits on them forever.
            if batch is not None or not short_of_memory or self.running \
                    or not self.sessions.release_idle_row(self.waiting):
                return batch

    def _try_prefill(self) -> tuple[ScheduleBatch | None, bool]:
        """The next prefill batch, or None and whether memory (KV or request rows) was short."""
        if not self.waiting and self.chunked_req is None:
            return None, False
        adder = PrefillAdder(self.tree_cache, self.allocator, self.running, self.new_token_ratio,
                             self.args.max_prefill_tokens, self.chunk_size, self.sessions,
                             mixed_decode_tokens=len(self.running) if self.mixed_chunk else 0)
        if self.chunked_req is not None and not adder.add_chunked_req(self.chunked_req):
            return None, False
        short_of_memory = False
        if adder.new_chunked_req is None:
            if sorts_by_prefix(self.schedule_policy, len(self.waiting)):
                self._match_waiting(self.waiting)
            sort_waiting(self.waiting, self.schedule_policy, self.rng, self.tree_cache.root)
            room = self.args.max_running_requests - len(self.running) - len(adder.can_run)
            free_rows = len(self.req_to_token_pool.free_slots)
            share = not self.args.disable_radix_cache
            for req in self.waiting[:MAX_CONSIDERED_PER_STEP]:
                if room <= 0:
                    break
                needs_row = req.session is None or req.session.held is None  # else it resumes its session's row
                if needs_row and free_rows <= 0:
                    short_of_memory = True  # idle sessions hold the rows
                    continue
                if not self._match_waiting([req]) or (share and shares_uncached_prefix(req, adder.can_run)):
                    continue
                if adder.add_one_req(req) == AddResult.NO_ROOM:
                    short_of_memory = not adder.can_run
                    break
                room, free_rows = room - 1, free_rows - needs_row
        if not adder.can_run:
            return None, short_of_memory
        for req in adder.can_run:
            if req in self.waiting:
                self.waiting.remove(req)
        self.chunked_req = adder.new_chunked_req
        batch = self._new_schedule_batch(adder.can_run, ForwardMode.EXTEND)
        batch.prepare_for_extend()
        return batch, False

    def _match_waiting(self, reqs: list[Req]) -> bool:
        """Finds these waiting requests' cached prefixes; one that fails ends alone. False if
        any failed."""
        ok = True
        for req in list(reqs):
            try:
                match_prefix(req, self.tree_cache, self.sessions)
            except Exception as e:
                logger.exception("request %s failed", req.rid)
                self.waiting.remove(req)
                self._fail_req(req, f"internal error while handling this request: {e!r}")
                ok = False
        return ok

    def _mix_running(self, batch: ScheduleBatch) -> None:
        """--enable-mixed-chunk: the running requests decode in the same pass as the prefill, so
        a long prompt arriving does not stall their streams. Admission kept room for their next
        token; if the pool is short anyway they wait for this step (retraction is left to decode
        batches)."""
        decoding = ScheduleBatch(list(self.running), ForwardMode.DECODE, self.req_to_token_pool, self.allocator,
                                 self.tree_cache)
        if decoding.can_decode():
            decoding.prepare_for_decode()
            batch.mix_with_running(decoding)

    def _get_decode_batch(self) -> ScheduleBatch | None:
        batch = self._new_schedule_batch(self.running, ForwardMode.DECODE)
        while not batch.can_decode() and self.sessions.release_idle_row(self.waiting):
            pass  # idle sessions' KV goes before any running request is retracted
        if not batch.can_decode():
            retracted = batch.retract_decode()
            self.stats["num_retractions"] += len(retracted)
            self.new_token_ratio = self.init_ratio
            for req in retracted:
                if self.tracer:
                    self.tracer.event("retract", rid=req.rid, output_len=len(req.output_ids))
            self.waiting[:0] = retracted  # resume before newer arrivals
            self.running = batch.reqs
            if not batch.can_decode():  # one request alone outgrew the pool
                self._finish(batch.reqs[0], FinishAbort("KV cache pool is too small for this request"))
                self.running = []
                return None
        else:
            self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, self.min_ratio)
        self._plan_drafts(batch)
        batch.prepare_for_decode()
        return batch
