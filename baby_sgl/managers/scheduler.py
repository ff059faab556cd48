"""The scheduler: an event loop that admits requests, forms extend and decode batches, runs them
and hands results back. It runs in its own thread; everything it owns is touched only there.
This module holds the loop, its inbox and what other threads may call; forming batches is in
scheduler_batches.py, handling a pass's results (sampling, stops, streaming) in
scheduler_output.py."""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from baby_sgl.errors import EngineDeadError
from baby_sgl.managers.io_struct import SessionParams
from baby_sgl.managers.memory_checker import check_memory
from baby_sgl.managers.messages import AbortReq, Call, Message, NewReq, Stop, Wake
from baby_sgl.core.finish_reason import FinishAbort
from baby_sgl.core.req import Req
from baby_sgl.managers.schedule_batch import ScheduleBatch
from baby_sgl.managers.scheduler_batches import INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, BatchFormation
from baby_sgl.managers.scheduler_output import OutputProcessing
from baby_sgl.managers.scheduler_spec import Speculation, make_drafter
from baby_sgl.managers.schedule_policy import CACHE_AWARE_POLICIES
from baby_sgl.managers.session_controller import SessionController
from baby_sgl.managers.snapshots import Progress, Snapshots
from baby_sgl.mem_cache.allocator import PagedTokenAllocator
from baby_sgl.mem_cache.base_prefix_cache import BasePrefixCache
from baby_sgl.mem_cache.chunk_cache import ChunkCache
from baby_sgl.mem_cache.radix_cache import RadixCache
from baby_sgl.core.forward_batch import ForwardMode, ModelWorkerBatch
from baby_sgl.model_executor.model_runner import ModelRunner
from baby_sgl.sampling.logprobs import input_logprobs
from baby_sgl.sampling.sampler import Sampler
from baby_sgl.server_args import EngineArgs
from baby_sgl.managers.activity import Activity
from baby_sgl.managers.scheduler_view import take_snapshot
from baby_sgl.trace import Tracer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from baby_sgl.managers.scheduler_view import SchedulerSnapshot

logger = logging.getLogger(__name__)

# How often a scheduler that has waiting requests but could not schedule any looks again.
_STALLED_POLL_S = 0.02
_IDLE_WAKE_S = 60.0  # an idle scheduler wakes at least this often, whatever session timeouts say
_CALL_POLL_S = 0.25  # how often a caller waiting on the scheduler checks that it is alive
_SHUTDOWN_JOIN_S = 5.0


class Scheduler(BatchFormation, OutputProcessing, Speculation):
    def __init__(self, args: EngineArgs, runner: ModelRunner, tokenizer: PreTrainedTokenizerBase, eos_token_ids: list[int],
                 max_total_tokens: int, context_len: int, max_input_len: int) -> None:
        self.args, self.runner, self.tokenizer = args, runner, tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.context_len = context_len
        self.tracer = Tracer(args.trace_file) if args.trace_file else None
        self.activity = Activity()  # recent batches, evictions and counters, for the dashboard
        self.req_to_token_pool = runner.init_memory_pool(max_total_tokens, args.max_running_requests, context_len,
                                                           args.kv_cache_dtype)
        self.allocator = PagedTokenAllocator(max_total_tokens, args.page_size, runner.device)
        self.tree_cache: BasePrefixCache[Any] = (ChunkCache(self.req_to_token_pool, self.allocator)
                                            if args.disable_radix_cache else
                                            RadixCache(self.req_to_token_pool, self.allocator, self.tracer,
                                                       on_evict=self.activity.record_eviction))
        self.sessions = SessionController(self.tree_cache, max_input_len, tokenizer.bos_token_id, args.max_sessions)
        self.sampler = Sampler(runner.cfg.vocab_size, sorted(self.eos_token_ids), args.random_seed)
        self.drafter = make_drafter(args.speculative_algorithm, args.speculative_ngram_min_match_window_size,
                                    args.speculative_ngram_max_match_window_size, args.speculative_ngram_capacity,
                                    share=not (args.disable_radix_cache or args.speculative_ngram_request_only))
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        cache_aware = args.schedule_policy in CACHE_AWARE_POLICIES
        self.schedule_policy = "fcfs" if cache_aware and args.disable_radix_cache else args.schedule_policy
        self.rng = random.Random(args.random_seed)  # the random policy's, seeded: same arrivals, same order
        self.chunked_req: Req | None = None
        self.cur_batch: ScheduleBatch | None = None
        c = args.schedule_conservativeness
        self.init_ratio, self.min_ratio = min(INIT_NEW_TOKEN_RATIO * c, 1.0), min(MIN_NEW_TOKEN_RATIO * c, 1.0)
        self.new_token_ratio = self.init_ratio
        # As SGLang: mixing needs chunked prefill, whose chunk size bounds each mixed step.
        chunk = args.chunked_prefill_size
        assert chunk is not None, "the engine resolves chunked_prefill_size before the scheduler starts"
        self.chunk_size = chunk if chunk > 0 else None  # None: unchunked
        self.mixed_chunk = args.enable_mixed_chunk and chunk > 0
        self.stats = {"num_retractions": 0, "prompt_tokens": 0, "cached_tokens": 0, "generation_tokens": 0,
                      "forward_steps": 0, "mixed_steps": 0, "num_failed_reqs": 0,
                      "spec_draft_chances": 0, "spec_verify_steps": 0, "spec_draft_tokens": 0,
                      "spec_accepted_tokens": 0}
        self.inbox: queue.Queue[Message] = queue.Queue()
        # Requests in the inbox (its calls and aborts are not queued requests).
        self._inbox_lock, self._inbox_reqs = threading.Lock(), 0
        self._stop = threading.Event()
        self.error: BaseException | None = None  # the last failure the loop survived
        self.dead: BaseException | None = None  # what stopped the loop, if it stopped on its own
        self.on_death: list[Callable[[BaseException], None]] = []
        self.last_forward = time.monotonic()  # when the last forward pass ended
        self.snapshots = Snapshots(Progress(0, 0, self.last_forward), self.load_info())
        self.thread = threading.Thread(target=self._loop, name="baby-sgl-scheduler", daemon=True)
        self.thread.start()

    # ---- called from other threads -------------------------------------------------------
    def is_alive(self) -> bool:
        return self.dead is None and self.thread.is_alive()

    def _check_alive(self) -> None:
        if not self.is_alive():
            raise EngineDeadError(f"the engine has stopped: {self.dead!r}" if self.dead else "the engine has stopped")

    def submit(self, req: Req) -> None:
        self._check_alive()
        with self._inbox_lock:
            self._inbox_reqs += 1
        self._put(NewReq(req))

    def _put(self, msg: Message) -> None:
        self.snapshots.sending(lambda: self.inbox.put(msg))

    @property
    def progress(self) -> Progress:
        return self.snapshots.progress

    def num_queued(self) -> int:
        """Requests not yet admitted: waiting (as of the loop's last turn, or of its request's
        arrival, see `_handle`), or still in the inbox; any thread."""
        with self._inbox_lock:
            return self.progress.waiting + self._inbox_reqs

    def load(self) -> dict[str, Any]:
        """load_info as fresh as this question (see snapshots.py), waiting in this thread."""
        return self.snapshots.wait(self.snapshots.load_probe())

    async def load_async(self) -> dict[str, Any]:
        """`load`, waiting on the running event loop."""
        return await self.snapshots.wait_async(self.snapshots.load_probe())

    def view_snapshot(self) -> SchedulerSnapshot:
        """The dashboard's snapshot, as fresh as this question, waiting in this thread."""
        return self.snapshots.wait(self._want_view())

    async def view_snapshot_async(self) -> SchedulerSnapshot:
        return await self.snapshots.wait_async(self._want_view())

    def _want_view(self) -> Callable[[], SchedulerSnapshot | None]:
        """Asks for a dashboard snapshot at the next turn its rate allows; returns the probe."""
        probe, wake = self.snapshots.view_probe()
        if wake:
            self._put(Wake())  # an idle loop sleeps until a message comes
        return probe

    def add_session_req(self, req: Req, session_params: SessionParams) -> None:
        """In the scheduler thread (through `call`): makes req a turn of its session and queues
        it, in one go, so two turns racing for one streaming session cannot both get in."""
        self.sessions.attach(req, session_params)
        self.waiting.append(req)

    def abort(self, rid: str) -> None:
        self._put(AbortReq(rid))

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Runs fn in the scheduler thread between steps and returns its result. Raises
        EngineDeadError, rather than waiting forever, if the scheduler stops meanwhile."""
        self._check_alive()
        done: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self._put(Call(fn, done))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                ok, value = done.get(timeout=_CALL_POLL_S)
                break
            except queue.Empty:
                self._check_alive()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError("the scheduler did not answer in time") from None
        if not ok:
            raise value
        return value

    def shutdown(self) -> None:
        self._stop.set()
        self._put(Stop())
        self.thread.join(timeout=_SHUTDOWN_JOIN_S)
        if self.tracer:
            self.tracer.close()

    # ---- the loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - whatever it was, nobody may wait forever
            self._die(e)
        finally:
            self.snapshots.close(repr(self.dead) if self.dead else "shut down")

    def _run(self) -> None:
        stalled = False
        self._publish()  # every turn ends with one, before the next turn may sleep
        while not self._stop.is_set():
            try:
                # Idle: sleep until a message (or a session timeout). Stalled (requests wait but
                # none could be scheduled): poll at a low rate instead of spinning a core.
                self._drain_inbox(block=stalled or not self.has_work(),
                                  max_wait=_STALLED_POLL_S if stalled else _IDLE_WAKE_S)
                if self._stop.is_set():
                    break
                stalled = not self.step() and self.has_work()
            except Exception as e:  # a bug, not bad input: fail what was in flight, keep serving
                logger.exception("scheduler step failed")
                self.error, stalled = e, False
                self._fail_all(f"internal error: {e!r}")
            if self.args.debug_memory_check:
                try:
                    check_memory(self)
                except AssertionError as e:
                    logger.error("memory check failed after a step: %s", e)
                    self.error = e
                    self._fail_all(f"internal error: {e}")
            self._publish()

    def _progress(self) -> Progress:
        return Progress(len(self.running) + (self.chunked_req is not None), len(self.waiting), self.last_forward)

    def _publish(self) -> None:
        """What other threads read without a call: progress and load every turn, the dashboard's
        snapshot when one is wanted and due."""
        self.snapshots.publish(self._progress(), self.load_info(),
                               settled=lambda: not self.has_work() and self.inbox.empty(),
                               take_view=lambda: take_snapshot(self))

    def _die(self, e: BaseException) -> None:
        """The loop itself failed: answer everyone who waits, then tell the owners (a server
        exits so that its supervisor can restart it)."""
        self.dead = e
        logger.critical("the scheduler thread stopped: %r", e, exc_info=e)
        reqs = self._in_flight()
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(msg, NewReq):
                reqs.append(msg.req)
            elif isinstance(msg, Call):
                msg.done.put((False, EngineDeadError(f"the engine has stopped: {e!r}")))
        for req in reqs:
            if not req.finished:
                req.finished_reason = FinishAbort(f"the engine has stopped: {e!r}")
                self._emit(req)
        for callback in self.on_death:
            try:
                callback(e)
            except Exception:
                logger.exception("on_death callback failed")

    def load_info(self) -> dict[str, Any]:
        """Counters and gauges for /server_info and /metrics (in the scheduler thread; others
        read the copy published every turn: `load`)."""
        used = self.allocator.size - self.allocator.available_size() - self.tree_cache.evictable_size()
        return {**self.stats, "num_running_reqs": len(self.running) + (self.chunked_req is not None),
                "num_waiting_reqs": len(self.waiting), "kv_used_tokens": used,
                "kv_cached_tokens": self.tree_cache.evictable_size(), "kv_total_tokens": self.allocator.size}

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req)

    def active_reqs(self) -> list[Req]:
        """The requests holding KV now: the running ones and the one whose prompt is mid-chunk."""
        return self.running + ([self.chunked_req] if self.chunked_req is not None else [])

    def _drain_inbox(self, block: bool, max_wait: float) -> None:
        """Handles the messages in the inbox when it is looked at, and no more: messages that
        keep coming wait for the next turn, so a step always runs in between (a flood of calls
        cannot starve the requests). Blocks for the first one if `block`."""
        if block:
            waits = (max_wait, self.sessions.expire(), self.snapshots.view_due_in())  # wake to expire sessions too
            try:
                msg = self.inbox.get(timeout=min(w for w in waits if w is not None))
            except queue.Empty:
                return
            if not self._handle(msg):
                return
        for _ in range(self.inbox.qsize()):
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            if not self._handle(msg):
                return

    def _handle(self, msg: Message) -> bool:
        """One message; False for Stop."""
        if isinstance(msg, NewReq):
            # From the inbox's count to the published waiting count at once (num_queued reads
            # both under this lock): a request counted nowhere could pass the queue limit.
            with self._inbox_lock:
                self._inbox_reqs -= 1
                self.waiting.append(msg.req)
                self.snapshots.progress = self._progress()
        elif isinstance(msg, AbortReq):
            self._mark_abort(msg.rid)
        elif isinstance(msg, Call):
            try:
                msg.done.put((True, msg.fn()))
            except Exception as e:
                msg.done.put((False, e))
        return not isinstance(msg, Stop)

    def _mark_abort(self, rid: str) -> None:
        for req in self.waiting + self.running + ([self.chunked_req] if self.chunked_req else []):
            if req.rid == rid:
                req.to_abort = "aborted by request"

    def step(self) -> bool:
        """One scheduling round; True if a forward pass ran."""
        self.sessions.expire()
        self._handle_aborts()
        self.cur_batch = None
        batch = self._get_new_batch_prefill()
        if batch is not None and self.running and self.mixed_chunk:
            self._mix_running(batch)
        elif batch is None and self.running:
            batch = self._get_decode_batch()
        if batch is None:
            return False
        mwb = batch.get_model_worker_batch()
        self.activity.record_batch(batch)
        if self.tracer:
            self._trace_batch(batch, mwb)
        try:
            logits, logprob_hidden = self.runner.forward(mwb)
        except Exception as e:  # shared by the batch: its requests end, the others go on
            logger.exception("forward pass failed")
            self.error = e
            self._fail_batch(batch.reqs, f"internal error in the forward pass: {e!r}")
            return True
        self.stats["forward_steps"] += 1
        self.stats["mixed_steps"] += batch.mode == ForwardMode.MIXED
        self.last_forward = time.monotonic()
        if batch.input_logprob_spans:
            self._record_input_logprobs(batch, logprob_hidden)
        if any(batch.drafts):
            self._process_verify(batch, logits)
        else:
            self._process_result(batch, logits)
        self.activity.record_step(self.stats)
        return True

    def _record_input_logprobs(self, batch: ScheduleBatch, hidden: torch.Tensor | None) -> None:
        """Prompt logprobs of the pass; if scoring fails, the requests that asked for them fail."""
        spans = batch.input_logprob_spans
        try:
            scored = input_logprobs(self.runner.compute_logits, hidden, spans)
        except Exception as e:
            logger.exception("prompt logprobs failed")
            for span in spans:
                span.req.to_abort = f"internal error while computing prompt logprobs: {e!r}"
            return
        for span, entries in zip(spans, scored):
            span.req.logprobs.add_input(span.head, entries)

    # ---- aborts and failures -------------------------------------------------------------
    def _handle_aborts(self) -> None:
        for req, message in [(r, r.to_abort) for r in self.waiting if r.to_abort]:
            self.waiting.remove(req)
            self._finish(req, FinishAbort(message))
        chunked = self.chunked_req
        if chunked is not None and chunked.to_abort:
            self.chunked_req = None
            self._finish(chunked, FinishAbort(chunked.to_abort))
        for req, message in [(r, r.to_abort) for r in self.running if r.to_abort]:
            self.running.remove(req)
            self._finish(req, FinishAbort(message))

    def _fail_req(self, req: Req, message: str) -> None:
        """Ends one request with an error; whatever it held is released."""
        self.stats["num_failed_reqs"] += 1
        if self.chunked_req is req:
            self.chunked_req = None
        self._finish(req, FinishAbort(message))  # releasing is idempotent

    def _fail_batch(self, reqs: list[Req], message: str) -> None:
        failed = list(reqs)
        self.running = [r for r in self.running if r not in failed]
        for req in failed:
            self._fail_req(req, message)

    def _in_flight(self) -> list[Req]:
        """Every request the scheduler holds: waiting, running, chunked, or in the current batch."""
        reqs = self.waiting + self.running + ([self.chunked_req] if self.chunked_req else [])
        return reqs + [r for r in (self.cur_batch.reqs if self.cur_batch else []) if r not in reqs]

    def _fail_all(self, message: str) -> None:
        reqs = self._in_flight()
        self.waiting, self.running, self.chunked_req, self.cur_batch = [], [], None, None
        for req in reqs:
            if not req.finished:  # a finished one was released and its last piece sent already
                self._fail_req(req, message)

    def _trace_batch(self, batch: ScheduleBatch, mwb: ModelWorkerBatch) -> None:
        assert self.tracer is not None and batch.out_cache_loc is not None
        self.tracer.event(
            "batch",
            mode=batch.mode.name,
            rids=[r.rid for r in batch.reqs],
            prefix_lens=batch.prefix_lens,
            extend_lens=mwb.extend_seq_lens,
            positions=[[a, b - 1] for a, b in zip(batch.prefix_lens, batch.seq_lens)],
            kv_slots=batch.out_cache_loc.tolist(),
            cache_hits=[r.cached_tokens for r in batch.reqs],
        )
