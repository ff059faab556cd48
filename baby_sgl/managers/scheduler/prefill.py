"""Admission (a part of the Scheduler, run in its thread): the next prefill batch from the waiting
queue, in the policy's order (policy.py), within the memory left: the KV budget kept for the
running requests' next tokens, free request rows, the prefill and chunk token budgets. A prompt
larger than the chunk budget is split across passes (the chunked request). With
--enable-mixed-chunk the running requests decode in the same pass."""

from __future__ import annotations

import enum
import logging
import random
from typing import TYPE_CHECKING, Any

from baby_sgl.core.forward_batch import ForwardMode
from baby_sgl.managers.scheduler.batch import ScheduleBatch
from baby_sgl.managers.scheduler.policy import (CACHE_AWARE_POLICIES, MAX_CONSIDERED_PER_STEP, match_prefix,
                                                shares_uncached_prefix, sort_waiting, sorts_by_prefix)

if TYPE_CHECKING:
    from baby_sgl.core.req import Req
    from baby_sgl.lora.memory_pool import LoRAMemoryPool
    from baby_sgl.managers.scheduler.memory import KVMemory
    from baby_sgl.managers.scheduler.output import OutputProcessor
    from baby_sgl.managers.scheduler.queues import RequestQueues
    from baby_sgl.managers.session_controller import SessionController
    from baby_sgl.mem_cache.allocator import PagedTokenAllocator
    from baby_sgl.mem_cache.base_prefix_cache import BasePrefixCache
    from baby_sgl.server_args import EngineArgs

logger = logging.getLogger(__name__)

# Output tokens a running request is assumed to still need, at most, when reserving KV room.
_MAX_RESERVED_PER_REQ = 4096
_UNCHUNKED = 1 << 62  # the chunk budget of unchunked prefill: more tokens than any pass holds


class PrefillPlanner:
    def __init__(self, args: EngineArgs, memory: KVMemory, queues: RequestQueues, sessions: SessionController,
                 output: OutputProcessor, lora_pool: LoRAMemoryPool | None = None) -> None:
        self.memory, self.queues, self.sessions, self.output = memory, queues, sessions, output
        self.lora_pool = lora_pool
        cache_aware = args.schedule_policy in CACHE_AWARE_POLICIES
        self.policy = "fcfs" if cache_aware and args.disable_radix_cache else args.schedule_policy
        self.rng = random.Random(args.random_seed)  # the random policy's, seeded: same arrivals, same order
        self.share_prefixes = not args.disable_radix_cache
        self.max_running_requests, self.max_prefill_tokens = args.max_running_requests, args.max_prefill_tokens
        # As SGLang: mixing needs chunked prefill, whose chunk size bounds each mixed step.
        chunk = args.chunked_prefill_size
        assert chunk is not None, "the engine resolves chunked_prefill_size before the scheduler starts"
        self.chunk_size = chunk if chunk > 0 else None  # None: unchunked
        self.mixed_chunk = args.enable_mixed_chunk and chunk > 0

    def next_batch(self, new_token_ratio: float) -> ScheduleBatch | None:
        """The next prefill pass (new_token_ratio: the share of their remaining max_new_tokens
        that running requests are assumed to still need), with the running requests mixed in
        under --enable-mixed-chunk; None if no waiting request can start."""
        while True:
            batch, short_of_memory = self._try_prefill(new_token_ratio)
            # Nothing fits and nothing runs: idle streaming sessions give their KV back, one at
            # a time, before anyone waits on them forever.
            if batch is not None or not short_of_memory or self.queues.running \
                    or not self.sessions.release_idle_row(self.queues.waiting):
                break
        if batch is not None and self.queues.running and self.mixed_chunk:
            self._mix_running(batch)
        return batch

    def _try_prefill(self, new_token_ratio: float) -> tuple[ScheduleBatch | None, bool]:
        """The next prefill batch, or None and whether memory (KV or request rows) was short."""
        q = self.queues
        if not q.waiting and q.chunked is None:
            return None, False
        adder = PrefillAdder(self.memory.tree_cache, self.memory.allocator, q.running, new_token_ratio,
                             self.max_prefill_tokens, self.chunk_size, self.sessions,
                             mixed_decode_tokens=len(q.running) if self.mixed_chunk else 0)
        if q.chunked is not None and not adder.add_chunked_req(q.chunked):
            return None, False
        short_of_memory = False
        if adder.new_chunked_req is None:
            short_of_memory = self._admit_waiting(adder)
        if not adder.can_run:
            return None, short_of_memory
        q.admitted(adder.can_run, adder.new_chunked_req)
        batch = q.batch = ScheduleBatch(adder.can_run, ForwardMode.EXTEND, self.memory)
        batch.prepare_for_extend()
        return batch, False

    def _admit_waiting(self, adder: PrefillAdder) -> bool:
        """Adds waiting requests in the policy's order while they fit; True if memory (KV or
        request rows) was short."""
        waiting = self.queues.waiting
        if sorts_by_prefix(self.policy, len(waiting)):
            self._match_waiting(waiting)
        sort_waiting(waiting, self.policy, self.rng, self.memory.tree_cache.root)
        room = self.max_running_requests - len(self.queues.running) - len(adder.can_run)
        free_rows, short_of_memory = self.memory.free_rows(), False
        adapters = {r.lora_id for r in self.queues.running + adder.can_run if r.lora_id is not None}
        for req in waiting[:MAX_CONSIDERED_PER_STEP]:
            if room <= 0:
                break
            if self._adapter_unloaded(req):
                continue
            if not self._adapter_fits(req, adapters):
                break  # the requests behind wait too, so the running ones drain until it fits: none starves
            needs_row = req.session is None or req.session.held is None  # else it resumes its session's row
            if needs_row and free_rows <= 0:
                short_of_memory = True  # idle sessions hold the rows
                continue
            if not self._match_waiting([req]) or (self.share_prefixes and shares_uncached_prefix(req, adder.can_run)):
                continue
            if adder.add_one_req(req) == AddResult.NO_ROOM:
                return not adder.can_run
            room, free_rows = room - 1, free_rows - needs_row
            if req.lora_id is not None:
                adapters.add(req.lora_id)
        return short_of_memory

    def _adapter_fits(self, req: Req, adapters: set[str]) -> bool:
        """Whether the request's LoRA adapter may join a batch using `adapters` (at most
        --max-loras-per-batch)."""
        return req.lora_id is None or self.lora_pool is None or self.lora_pool.fits(adapters | {req.lora_id})

    def _adapter_unloaded(self, req: Req) -> bool:
        """A request whose LoRA adapter was unloaded between its check and its arrival ends here."""
        if req.lora_id is None or self.lora_pool is None or req.lora_id in self.lora_pool.adapters:
            return False
        self.output.fail(req, f"LoRA adapter {req.lora_id!r} was unloaded")
        return True

    def _match_waiting(self, reqs: list[Req]) -> bool:
        """Finds these waiting requests' cached prefixes; one that fails ends alone. False if
        any failed."""
        ok = True
        for req in list(reqs):
            try:
                match_prefix(req, self.memory.tree_cache, self.sessions)
            except Exception as e:
                logger.exception("request %s failed", req.rid)
                self.output.fail(req, f"internal error while handling this request: {e!r}")
                ok = False
        return ok

    def _mix_running(self, batch: ScheduleBatch) -> None:
        """--enable-mixed-chunk: the running requests decode in the same pass as the prefill, so
        a long prompt arriving does not stall their streams. Admission kept room for their next
        token; if the pool is short anyway they wait for this step (retraction is left to decode
        batches)."""
        decoding = ScheduleBatch(list(self.queues.running), ForwardMode.DECODE, self.memory)
        if decoding.can_decode():
            decoding.prepare_for_decode()
            batch.mix_with_running(decoding)


class AddResult(enum.Enum):
    CONTINUE = enum.auto()
    NO_ROOM = enum.auto()  # out of KV slots, prefill tokens or chunk budget: stop adding


def reserved_tokens(req: Req, ratio: float) -> int:
    remaining = req.sampling_params.max_new_tokens - len(req.output_ids)
    return int(min(remaining, _MAX_RESERVED_PER_REQ) * ratio)


class PrefillAdder:
    def __init__(self, tree_cache: BasePrefixCache[Any], allocator: PagedTokenAllocator, running: list[Req], new_token_ratio: float,
                 max_prefill_tokens: int, chunked_prefill_size: int | None, sessions: SessionController,
                 mixed_decode_tokens: int = 0) -> None:
        self.tree_cache, self.allocator, self.ratio = tree_cache, allocator, new_token_ratio
        self.sessions = sessions
        self.page_size = allocator.page_size
        # KV room kept for the decode steps of requests already running.
        self.reserved = sum(reserved_tokens(r, new_token_ratio) + self.page_size for r in running)
        self.idle = not running
        # A mixed pass also carries one token per running request: they count against the budgets.
        self.rem_input_tokens = max_prefill_tokens - mixed_decode_tokens
        self.rem_chunk_tokens = (chunked_prefill_size or _UNCHUNKED) - mixed_decode_tokens
        self.can_run: list[Req] = []
        self.new_chunked_req: Req | None = None

    @property
    def rem_total_tokens(self) -> int:
        return self.allocator.available_size() + self.tree_cache.evictable_size() - self.reserved

    def add_chunked_req(self, req: Req) -> bool:
        """Next chunk of a request whose prefill is split across steps, if KV room allows."""
        extend = min(req.seqlen - req.kv.kv_len, self._chunk_room())
        if extend + self.page_size > self.rem_total_tokens:
            return False
        self._add(req, extend)
        return True

    def add_one_req(self, req: Req) -> AddResult:
        extend = req.seqlen - len(req.prefix())
        if self.can_run and extend > self.rem_input_tokens:
            return AddResult.NO_ROOM
        # Lock first: the matched prefix must survive this step's evictions, so it no longer
        # counts as room that eviction could free.
        self.tree_cache.inc_lock_ref(req.kv.last_node)
        # An idle engine takes its first request whenever the prompt fits: were its future output
        # reserved too, a long max_new_tokens in a small pool would wait forever.
        reserve = 0 if self.idle and not self.can_run else reserved_tokens(req, self.ratio)
        if extend + reserve + self.page_size > self.rem_total_tokens:
            self.tree_cache.dec_lock_ref(req.kv.last_node)
            return AddResult.NO_ROOM
        req.cached_tokens = max(req.cached_tokens, len(req.prefix()))
        self.sessions.hand_over(req)  # a streaming turn resumes in its session's row
        self._add(req, min(extend, self._chunk_room()))
        return AddResult.NO_ROOM if req.kv.is_chunked or self.rem_chunk_tokens <= 0 else AddResult.CONTINUE

    def _chunk_room(self) -> int:
        # A chunk ends on a page boundary so the tree can take all of it between chunks.
        return max(self.rem_chunk_tokens // self.page_size * self.page_size, self.page_size)

    def _add(self, req: Req, extend: int) -> None:
        start = req.kv.kv_len if req.kv.req_pool_idx is not None else len(req.prefix())
        req.kv.extend_input_len = extend
        req.kv.is_chunked = start + extend < req.seqlen
        if req.kv.is_chunked:
            self.new_chunked_req = req
        self.can_run.append(req)
        self.reserved += extend + reserved_tokens(req, self.ratio) + self.page_size
        self.rem_input_tokens -= extend
        self.rem_chunk_tokens -= extend
