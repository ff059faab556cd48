"""The decode batch (a part of the Scheduler, run in its thread): one token for every running
request (and its drafts, under speculative decoding). When the KV pool cannot hold them, idle
streaming sessions give their rows back first, then the requests with the least output are
retracted (their KV released, their pages kept in the tree) to be prefilled again later."""

from __future__ import annotations

from typing import TYPE_CHECKING

from baby_sgl.core.finish_reason import FinishAbort
from baby_sgl.core.forward_batch import ForwardMode
from baby_sgl.managers.scheduler.batch import ScheduleBatch

if TYPE_CHECKING:
    from baby_sgl.managers.scheduler.memory import KVMemory
    from baby_sgl.managers.scheduler.output import OutputProcessor
    from baby_sgl.managers.scheduler.queues import RequestQueues
    from baby_sgl.managers.scheduler.speculation import Speculation
    from baby_sgl.managers.session_controller import SessionController
    from baby_sgl.trace import Tracer

# Fraction of their remaining max_new_tokens that running requests are assumed to still need:
# starts high, decays while decode goes well, is reset by a retraction (as SGLang does).
INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_DECAY = 0.7, 0.1, 0.002


class DecodePlanner:
    def __init__(self, conservativeness: float, memory: KVMemory, queues: RequestQueues, sessions: SessionController,
                 speculation: Speculation, output: OutputProcessor, stats: dict[str, int],
                 tracer: Tracer | None) -> None:
        self.memory, self.queues, self.sessions = memory, queues, sessions
        self.speculation, self.output, self.stats, self.tracer = speculation, output, stats, tracer
        self.init_ratio = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        self.min_ratio = min(MIN_NEW_TOKEN_RATIO * conservativeness, 1.0)
        self.new_token_ratio = self.init_ratio  # what admission reserves for the running requests

    def next_batch(self) -> ScheduleBatch | None:
        """The decode pass of the running requests, retracting some if the pool is short; None if
        not even one of them fits."""
        batch = self.queues.batch = ScheduleBatch(list(self.queues.running), ForwardMode.DECODE, self.memory)
        while not batch.can_decode() and self.sessions.release_idle_row(self.queues.waiting):
            pass  # idle sessions' KV goes before any running request is retracted
        if not batch.can_decode():
            self._retract(batch)
            if not batch.can_decode():  # one request alone outgrew the pool
                self.queues.discard(batch.reqs[0])
                self.output.finish(batch.reqs[0], FinishAbort("KV cache pool is too small for this request"))
                return None
        else:
            self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, self.min_ratio)
        self.speculation.plan_drafts(batch)
        batch.prepare_for_decode()
        return batch

    def _retract(self, batch: ScheduleBatch) -> None:
        retracted = batch.retract_decode()
        self.stats["num_retractions"] += len(retracted)
        self.new_token_ratio = self.init_ratio
        for req in retracted:
            if self.tracer:
                self.tracer.event("retract", rid=req.rid, output_len=len(req.output_ids))
        self.queues.retracted(retracted)
