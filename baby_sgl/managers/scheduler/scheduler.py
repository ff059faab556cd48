"""The scheduler: an event loop that admits requests, forms extend and decode batches, runs them
and hands results back. It runs in its own thread; everything it owns is touched only there.
This module holds the loop, its inbox and what other threads may call; the work is done by its
parts (this package): the request queues (queues.py), the KV memory (memory.py), admission
(prefill.py), the decode batch (decode.py), the output processor (output.py) and speculative
decoding (speculation.py)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from baby_sgl.core.finish_reason import FinishAbort
from baby_sgl.core.forward_batch import ForwardMode, ModelWorkerBatch
from baby_sgl.errors import EngineDeadError
from baby_sgl.managers.activity import Activity
from baby_sgl.managers.io_struct import OpenSessionReqInput, SessionParams
from baby_sgl.managers.messages import AbortReq, Call, Message, NewReq, Stop, Wake
from baby_sgl.managers.scheduler.decode import DecodePlanner
from baby_sgl.managers.scheduler.memory import KVMemory
from baby_sgl.managers.scheduler.output import OutputProcessor
from baby_sgl.managers.scheduler.prefill import PrefillPlanner
from baby_sgl.managers.scheduler.queues import RequestQueues
from baby_sgl.managers.scheduler.speculation import Speculation, make_drafter
from baby_sgl.managers.scheduler.view import take_snapshot
from baby_sgl.managers.session_controller import SessionController
from baby_sgl.managers.snapshots import Progress, Snapshots
from baby_sgl.mem_cache.allocator import PagedTokenAllocator
from baby_sgl.mem_cache.base_prefix_cache import BasePrefixCache
from baby_sgl.mem_cache.chunk_cache import ChunkCache
from baby_sgl.mem_cache.radix_cache import RadixCache
from baby_sgl.model_executor.model_runner import ModelRunner
from baby_sgl.sampling.logprobs import input_logprobs
from baby_sgl.sampling.sampler import Sampler
from baby_sgl.server_args import EngineArgs
from baby_sgl.trace import Tracer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from baby_sgl.core.req import Req
    from baby_sgl.managers.scheduler.batch import ScheduleBatch
    from baby_sgl.managers.scheduler.view import SchedulerSnapshot

logger = logging.getLogger(__name__)

# How often a scheduler that has waiting requests but could not schedule any looks again.
_STALLED_POLL_S = 0.02
_IDLE_WAKE_S = 60.0  # an idle scheduler wakes at least this often, whatever session timeouts say
_CALL_POLL_S = 0.25  # how often a caller waiting on the scheduler checks that it is alive
_SHUTDOWN_JOIN_S = 5.0

T = TypeVar("T")


class Scheduler:
    def __init__(self, args: EngineArgs, runner: ModelRunner, tokenizer: PreTrainedTokenizerBase, eos_token_ids: list[int],
                 max_total_tokens: int, context_len: int, max_input_len: int) -> None:
        self.args, self.runner = args, runner
        self.tracer = Tracer(args.trace_file) if args.trace_file else None
        self.activity = Activity()  # recent batches, evictions and counters, for the dashboard
        pool = runner.init_memory_pool(max_total_tokens, args.max_running_requests, context_len, args.kv_cache_dtype)
        allocator = PagedTokenAllocator(max_total_tokens, args.page_size, runner.device)
        tree_cache: BasePrefixCache[Any] = (ChunkCache(pool, allocator) if args.disable_radix_cache else
                                            RadixCache(pool, allocator, self.tracer,
                                                       on_evict=self.activity.record_eviction))
        self.memory = KVMemory(pool, allocator, tree_cache)
        self.sessions = SessionController(tree_cache, max_input_len, tokenizer.bos_token_id, args.max_sessions)
        self.queues = RequestQueues()
        self.stats = {"num_retractions": 0, "prompt_tokens": 0, "cached_tokens": 0, "generation_tokens": 0,
                      "forward_steps": 0, "mixed_steps": 0, "num_failed_reqs": 0,
                      "spec_draft_chances": 0, "spec_verify_steps": 0, "spec_draft_tokens": 0,
                      "spec_accepted_tokens": 0}
        self._build_parts(args, tokenizer, set(eos_token_ids), context_len)
        self.inbox: queue.Queue[Message] = queue.Queue()
        # Requests in the inbox (its calls and aborts are not queued requests).
        self._inbox_lock, self._inbox_reqs = threading.Lock(), 0
        self._stop = threading.Event()
        self._dead: BaseException | None = None  # what stopped the loop, if it stopped on its own
        self._death_callbacks: list[Callable[[BaseException], None]] = []
        self.last_forward = time.monotonic()  # when the last forward pass ended
        self.snapshots = Snapshots(Progress(0, 0, self.last_forward), self._load_info())
        self._thread = threading.Thread(target=self._loop, name="baby-sgl-scheduler", daemon=True)
        self._thread.start()

    def _build_parts(self, args: EngineArgs, tokenizer: PreTrainedTokenizerBase, eos_token_ids: set[int],
                     context_len: int) -> None:
        vocab_size = self.runner.cfg.vocab_size
        drafter = make_drafter(args.speculative_algorithm, args.speculative_ngram_min_match_window_size,
                               args.speculative_ngram_max_match_window_size, args.speculative_ngram_capacity,
                               share=not (args.disable_radix_cache or args.speculative_ngram_request_only))
        sampler = Sampler(vocab_size, sorted(eos_token_ids), args.random_seed)
        self.output = OutputProcessor(tokenizer, eos_token_ids, context_len, sampler, self.memory.tree_cache,
                                      self.sessions, drafter, self.queues, self.stats, self.activity)
        self.speculation = Speculation(drafter, args.speculative_num_draft_tokens, context_len, vocab_size,
                                       self.memory, self.output, self.stats)
        self.prefill = PrefillPlanner(args, self.memory, self.queues, self.sessions, self.output, self.runner.lora_pool)
        self.decode = DecodePlanner(args.schedule_conservativeness, self.memory, self.queues, self.sessions,
                                    self.speculation, self.output, self.stats, self.tracer)

    # ---- called from other threads -------------------------------------------------------
    def is_alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def failure(self) -> BaseException | None:
        """What stopped the loop, if it stopped on its own."""
        return self._dead

    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        """callback(error) is called, in the scheduler thread, if the loop fails beyond recovery."""
        self._death_callbacks.append(callback)

    def _check_alive(self) -> None:
        if not self.is_alive():
            raise EngineDeadError(f"the engine has stopped: {self._dead!r}" if self._dead else "the engine has stopped")

    def submit(self, req: Req) -> None:
        self._check_alive()
        with self._inbox_lock:
            self._inbox_reqs += 1
        self._put(NewReq(req))

    def submit_session_turn(self, req: Req, session_params: SessionParams) -> None:
        """Makes req a turn of its session and queues it, in one go in the scheduler thread, so
        two turns racing for one streaming session cannot both get in."""
        def attach() -> None:
            self.sessions.attach(req, session_params)
            self.queues.add(req)

        self.call(attach)

    def open_session(self, params: OpenSessionReqInput) -> str:
        return self.call(lambda: self.sessions.open(params))

    def close_session(self, session_id: str) -> None:
        self.call(lambda: self.sessions.close(session_id))

    def check_memory(self) -> dict[str, int]:
        """Asserts invariant 4 in the scheduler thread (see memory.py); returns the slot counts."""
        return self.call(self._check_memory)

    def flush(self) -> bool:
        """Empties the prefix cache (and the text drafts come from), unless requests are in
        flight: then nothing changes and the answer is False."""
        def flush() -> bool:
            if self.queues.has_work():
                return False
            self.memory.flush()
            self.speculation.clear()
            return True

        return self.call(flush)

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
        """The counters and gauges of `_load_info`, as fresh as this question (see snapshots.py),
        waiting in this thread."""
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

    def uses_lora(self, name: str) -> bool:
        """Whether a request queued or running uses the LoRA adapter (in the scheduler thread)."""
        return any(r.lora_id == name for r in self.queues.in_flight())

    def abort(self, rid: str) -> None:
        self._put(AbortReq(rid))

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
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
        return cast(T, value)  # what fn returned

    def shutdown(self) -> bool:
        """Stops the loop; True if it ended between passes (neither stuck in one nor stopped by
        a failure inside one), so whatever runs passes with it can be told to stop."""
        self._stop.set()
        self._put(Stop())
        self._thread.join(timeout=_SHUTDOWN_JOIN_S)
        if self.tracer:
            self.tracer.close()
        return not self._thread.is_alive()

    # ---- the loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - whatever it was, nobody may wait forever
            self._die(e)
        finally:
            self.snapshots.close(repr(self._dead) if self._dead else "shut down")

    def _run(self) -> None:
        stalled = False
        self._publish()  # every turn ends with one, before the next turn may sleep
        while not self._stop.is_set():
            try:
                # Idle: sleep until a message (or a session timeout). Stalled (requests wait but
                # none could be scheduled): poll at a low rate instead of spinning a core.
                self._drain_inbox(block=stalled or not self.queues.has_work(),
                                  max_wait=_STALLED_POLL_S if stalled else _IDLE_WAKE_S)
                if self._stop.is_set():
                    break
                stalled = not self.step() and self.queues.has_work()
            except Exception as e:  # a bug, not bad input: fail what was in flight, keep serving
                logger.exception("scheduler step failed")
                stalled = False
                self._fail_all(f"internal error: {e!r}")
            if self.args.debug_memory_check:
                try:
                    self._check_memory()
                except AssertionError as e:
                    logger.error("memory check failed after a step: %s", e)
                    self._fail_all(f"internal error: {e}")
            self._publish()

    def _check_memory(self) -> dict[str, int]:
        counts = self.memory.check(self.queues.active(), self.sessions, idle=not self.queues.has_work())
        self.queues.check()
        self.runner.check_ranks()  # tensor parallelism: every rank's slot table and pool agree with these
        return counts

    def _progress(self) -> Progress:
        return Progress(self.queues.num_active(), len(self.queues.waiting), self.last_forward)

    def _publish(self) -> None:
        """What other threads read without a call: progress and load every turn, the dashboard's
        snapshot when one is wanted and due."""
        self.snapshots.publish(self._progress(), self._load_info(),
                               settled=lambda: not self.queues.has_work() and self.inbox.empty(),
                               take_view=lambda: take_snapshot(self.memory, self.queues, self.sessions.held_reqs(),
                                                               self.activity))

    def _die(self, e: BaseException) -> None:
        """The loop itself failed: answer everyone who waits, then tell the owners (a server
        exits so that its supervisor can restart it)."""
        self._dead = e
        logger.critical("the scheduler thread stopped: %r", e, exc_info=e)
        reqs = self.queues.in_flight()
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
                self.output.emit(req)
        for callback in self._death_callbacks:
            try:
                callback(e)
            except Exception:
                logger.exception("on_death callback failed")

    def _load_info(self) -> dict[str, Any]:
        """Counters and gauges for /server_info and /metrics (in the scheduler thread; others
        read the copy published every turn: `load`)."""
        return {**self.stats, "num_running_reqs": self.queues.num_active(),
                "num_waiting_reqs": len(self.queues.waiting), **self.memory.load()}

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
                self.queues.add(msg.req)
                self.snapshots.progress = self._progress()
        elif isinstance(msg, AbortReq):
            for req in self.queues.find(msg.rid):
                req.to_abort = "aborted by request"
        elif isinstance(msg, Call):
            try:
                msg.done.put((True, msg.fn()))
            except Exception as e:
                msg.done.put((False, e))
        return not isinstance(msg, Stop)

    def step(self) -> bool:
        """One scheduling round; True if a forward pass ran."""
        self.sessions.expire()
        self._handle_aborts()
        self.queues.batch = None
        batch = self.prefill.next_batch(self.decode.new_token_ratio)
        if batch is None and self.queues.running:
            batch = self.decode.next_batch()
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
            for req in list(batch.reqs):
                self.output.fail(req, f"internal error in the forward pass: {e!r}")
            return True
        self.stats["forward_steps"] += 1
        self.stats["mixed_steps"] += batch.mode == ForwardMode.MIXED
        self.last_forward = time.monotonic()
        if batch.input_logprob_spans:
            self._record_input_logprobs(batch, logprob_hidden)
        if any(batch.drafts):
            still_running = self.speculation.process_verify(batch, logits)
        else:
            still_running = self.output.process_result(batch, logits)
        self.queues.settle(batch.mode, still_running)
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
        for req, message in [(r, r.to_abort) for r in self.queues.all() if r.to_abort]:
            self.queues.discard(req)
            self.output.finish(req, FinishAbort(message))

    def _fail_all(self, message: str) -> None:
        for req in self.queues.clear():
            if not req.finished:  # a finished one was released and its last piece sent already
                self.output.fail(req, message)

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
