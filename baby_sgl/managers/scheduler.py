"""The scheduler: an event loop that admits requests, forms extend and decode batches, runs them
and hands results back. It runs in its own thread; everything it owns is touched only there."""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from baby_sgl.detokenizer import detokenize_step
from baby_sgl.constrained.grammar import ConstraintError
from baby_sgl.errors import EngineDeadError
from baby_sgl.managers.io_struct import SessionParams
from baby_sgl.managers.memory_checker import check_memory
from baby_sgl.managers.messages import AbortReq, Call, Message, NewReq, Stop
from baby_sgl.managers.req import Req
from baby_sgl.managers.schedule_batch import ScheduleBatch
from baby_sgl.managers.schedule_policy import (CACHE_AWARE_POLICIES, AddResult, PrefillAdder, match_prefix,
                                               shares_uncached_prefix, sort_waiting)
from baby_sgl.managers.session_controller import SessionController
from baby_sgl.mem_cache.allocator import PagedTokenAllocator
from baby_sgl.mem_cache.base_prefix_cache import BasePrefixCache
from baby_sgl.mem_cache.chunk_cache import ChunkCache
from baby_sgl.mem_cache.radix_cache import RadixCache
from baby_sgl.model_executor.forward_batch import ForwardMode
from baby_sgl.model_executor.model_runner import ModelRunner
from baby_sgl.sampling.logprobs import record_input_logprobs
from baby_sgl.sampling.sampler import Sampler
from baby_sgl.sampling.sampling_params import stop_regex_matcher
from baby_sgl.server_args import EngineArgs
from baby_sgl.managers.activity import Activity
from baby_sgl.trace import Tracer

logger = logging.getLogger(__name__)

# How often a scheduler that has waiting requests but could not schedule any looks again.
_STALLED_POLL_S = 0.02
_IDLE_WAKE_S = 60.0  # an idle scheduler wakes at least this often, whatever session timeouts say
_CALL_POLL_S = 0.25  # how often a caller waiting on the scheduler checks that it is alive
_SHUTDOWN_JOIN_S = 5.0
# Fraction of their remaining max_new_tokens that running requests are assumed to still need:
# starts high, decays while decode goes well, is reset by a retraction (as SGLang does).
INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_DECAY = 0.7, 0.1, 0.002


@dataclass(frozen=True)
class Progress:
    """The scheduler as of its loop's last turn, readable from any thread: health checks must
    not wait for a loop that may be stuck, and the event loop must not touch its lists."""

    running: int
    waiting: int
    last_forward: float  # time.monotonic() when the last forward pass ended


class Scheduler:
    def __init__(self, args: EngineArgs, runner: ModelRunner, tokenizer, eos_token_ids: list[int],
                 max_total_tokens: int, context_len: int, max_input_len: int) -> None:
        self.args, self.runner, self.tokenizer = args, runner, tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.context_len = context_len
        self.tracer = Tracer(args.trace_file) if args.trace_file else None
        self.activity = Activity()  # recent batches, evictions and counters, for the dashboard
        runner.init_memory_pool(max_total_tokens, args.max_running_requests, context_len)
        self.req_to_token_pool = runner.req_to_token_pool
        self.allocator = PagedTokenAllocator(max_total_tokens, args.page_size, runner.device)
        self.tree_cache: BasePrefixCache = (ChunkCache(self.req_to_token_pool, self.allocator)
                                            if args.disable_radix_cache else
                                            RadixCache(self.req_to_token_pool, self.allocator, self.tracer,
                                                       on_evict=self.activity.record_eviction))
        self.sessions = SessionController(self.tree_cache, max_input_len, tokenizer.bos_token_id, args.max_sessions)
        self.sampler = Sampler(runner.cfg.vocab_size, sorted(self.eos_token_ids), args.random_seed)
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
        self.chunk_size = args.chunked_prefill_size if args.chunked_prefill_size > 0 else None  # None: unchunked
        self.mixed_chunk = args.enable_mixed_chunk and args.chunked_prefill_size > 0
        self.stats = {"num_retractions": 0, "prompt_tokens": 0, "cached_tokens": 0, "generation_tokens": 0,
                      "forward_steps": 0, "mixed_steps": 0, "num_failed_reqs": 0}
        self.inbox: queue.Queue[Message] = queue.Queue()
        self._stop = threading.Event()
        self.error: BaseException | None = None  # the last failure the loop survived
        self.dead: BaseException | None = None  # what stopped the loop, if it stopped on its own
        self.on_death: list[Callable[[BaseException], None]] = []
        self.last_forward = time.monotonic()  # when the last forward pass ended
        self.progress = Progress(0, 0, self.last_forward)
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
        self.inbox.put(NewReq(req))

    def num_queued(self) -> int:
        """Requests not yet admitted: waiting, or still in the inbox (any thread; as of the loop's
        last turn)."""
        return self.progress.waiting + self.inbox.qsize()

    def add_session_req(self, req: Req, session_params: SessionParams) -> None:
        """In the scheduler thread (through `call`): makes req a turn of its session and queues
        it, in one go, so two turns racing for one streaming session cannot both get in."""
        self.sessions.attach(req, session_params)
        self.waiting.append(req)

    def abort(self, rid: str) -> None:
        self.inbox.put(AbortReq(rid))

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Runs fn in the scheduler thread between steps and returns its result. Raises
        EngineDeadError, rather than waiting forever, if the scheduler stops meanwhile."""
        self._check_alive()
        done: queue.Queue = queue.Queue()
        self.inbox.put(Call(fn, done))
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
        self.inbox.put(Stop())
        self.thread.join(timeout=_SHUTDOWN_JOIN_S)
        if self.tracer:
            self.tracer.close()

    # ---- the loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - whatever it was, nobody may wait forever
            self._die(e)

    def _run(self) -> None:
        stalled = False
        while not self._stop.is_set():
            try:
                # Idle: sleep until a message (or a session timeout). Stalled (requests wait but
                # none could be scheduled): poll at a low rate instead of spinning a core.
                self._drain_inbox(block=stalled or not self.has_work(),
                                  max_wait=_STALLED_POLL_S if stalled else _IDLE_WAKE_S)
                self._publish()
                if self._stop.is_set():
                    break
                stalled = not self.step() and self.has_work()
                self._publish()
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

    def _publish(self) -> None:
        """What other threads may read without a call (one object, replaced whole)."""
        self.progress = Progress(len(self.running) + (self.chunked_req is not None), len(self.waiting),
                                 self.last_forward)

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
                req.finished_reason = {"type": "abort", "message": f"the engine has stopped: {e!r}"}
                self._emit(req)
        for callback in self.on_death:
            try:
                callback(e)
            except Exception:
                logger.exception("on_death callback failed")

    def load_info(self) -> dict[str, Any]:
        """Counters and gauges for /server_info and /metrics (call through `call`)."""
        used = self.allocator.size - self.allocator.available_size() - self.tree_cache.evictable_size()
        return {**self.stats, "num_running_reqs": len(self.running) + (self.chunked_req is not None),
                "num_waiting_reqs": len(self.waiting), "kv_used_tokens": used,
                "kv_cached_tokens": self.tree_cache.evictable_size(), "kv_total_tokens": self.allocator.size}

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req)

    def _drain_inbox(self, block: bool, max_wait: float) -> None:
        while True:
            wait = None
            if block:
                expiry = self.sessions.expire()  # wake up to expire idle sessions
                wait = max_wait if expiry is None else min(expiry, max_wait)
            try:
                msg = self.inbox.get(block=block, timeout=wait)
            except queue.Empty:
                return
            block = False
            if isinstance(msg, NewReq):
                self.waiting.append(msg.req)
            elif isinstance(msg, AbortReq):
                self._mark_abort(msg.rid)
            elif isinstance(msg, Call):
                try:
                    msg.done.put((True, msg.fn()))
                except Exception as e:
                    msg.done.put((False, e))
            elif isinstance(msg, Stop):
                return

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
        self._process_result(batch, logits)
        self.activity.record_step(self.stats)
        return True

    def _record_input_logprobs(self, batch: ScheduleBatch, hidden: torch.Tensor) -> None:
        """Prompt logprobs of the pass; if scoring fails, the requests that asked for them fail."""
        try:
            record_input_logprobs(self.runner.compute_logits, hidden, batch.input_logprob_spans)
        except Exception as e:
            logger.exception("prompt logprobs failed")
            for span in batch.input_logprob_spans:
                span.req.to_abort = f"internal error while computing prompt logprobs: {e!r}"

    # ---- forming batches -----------------------------------------------------------------
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
            self._match_waiting()
            sort_waiting(self.waiting, self.schedule_policy, self.rng, self.tree_cache.root)
            room = self.args.max_running_requests - len(self.running) - len(adder.can_run)
            free_rows = len(self.req_to_token_pool.free_slots)
            share = not self.args.disable_radix_cache
            for req in list(self.waiting):
                if share and shares_uncached_prefix(req, adder.can_run):
                    continue
                if room <= 0:
                    break
                needs_row = req.session is None or req.session.held is None  # else it resumes its session's row
                if needs_row and free_rows <= 0:
                    short_of_memory = True  # idle sessions hold the rows
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

    def _match_waiting(self) -> None:
        """Finds each waiting request's cached prefix; one that fails ends alone."""
        for req in list(self.waiting):
            try:
                match_prefix(req, self.tree_cache, self.sessions)
            except Exception as e:
                logger.exception("request %s failed", req.rid)
                self.waiting.remove(req)
                self._fail_req(req, f"internal error while handling this request: {e!r}")

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
                self._finish(batch.reqs[0], {"type": "abort", "message": "KV cache pool is too small for this request"})
                self.running = []
                return None
        else:
            self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, self.min_ratio)
        batch.prepare_for_decode()
        return batch

    # ---- results -------------------------------------------------------------------------
    def _process_result(self, batch: ScheduleBatch, logits: torch.Tensor) -> None:
        """Each request's share of the pass, one at a time: an error in one (sampling, the
        detokenizer, a stop check, its session) ends that request alone."""
        tokens = self._sample(logits, batch.reqs)
        still_running = []
        num_extend = 0 if batch.mode == ForwardMode.DECODE else len(batch.reqs) - batch.num_decode_reqs
        for i, (req, seq_len, token) in enumerate(zip(batch.reqs, batch.seq_lens, tokens)):
            req.kv_len = seq_len
            try:
                if isinstance(token, Exception):
                    raise token
                if self._advance(req, i < num_extend, token):
                    still_running.append(req)
            except ConstraintError as e:  # the request's own constraint, not our error
                logger.warning("request %s: %s", req.rid, e)
                self._finish(req, {"type": "abort", "message": str(e)})
            except Exception as e:
                logger.exception("request %s failed", req.rid)
                self._fail_req(req, f"internal error while handling this request: {e!r}")
        if batch.mode == ForwardMode.EXTEND:
            self.running.extend(still_running)
        else:  # a decode or mixed batch held every running request
            self.running = still_running

    def _needs_token(self, req: Req) -> bool:
        return not req.is_chunked and not req.to_abort and req.sampling_params.max_new_tokens > 0

    def _sample(self, logits: torch.Tensor, reqs: list[Req]) -> list[int | Exception | None]:
        """The next token of every request that gets one (None for the others). Sampling is
        batched; if the batch fails, each row is sampled alone so one bad row fails one request."""
        rows = [i for i, r in enumerate(reqs) if self._needs_token(r)]
        out: list[int | Exception | None] = [None] * len(reqs)
        if not rows:
            return out
        try:
            batch_logits = logits if len(rows) == len(reqs) else logits[rows]
            for i, token in zip(rows, self.sampler(batch_logits, [reqs[i] for i in rows])):
                out[i] = token
            return out
        except Exception:
            logger.exception("batched sampling failed; sampling row by row")
        for i in rows:
            try:
                out[i] = self.sampler(logits[i : i + 1], [reqs[i]])[0]
            except Exception as e:
                out[i] = e
        return out

    def _advance(self, req: Req, extended: bool, token: int | None) -> bool:
        """Applies one pass to one request (`extended`: the pass computed part of its prompt
        rather than one decode step); True if it keeps decoding."""
        if req.is_chunked:  # more of its prompt to come; it stays the chunked request
            self.tree_cache.cache_unfinished_req(req)
            return False
        if req.to_abort:
            self._finish(req, {"type": "abort", "message": req.to_abort})
            return False
        ts = req.time_stats
        if ts.first_token is None:  # prefill complete: its first token; its prompt counted once
            ts.first_token = time.perf_counter()
            self.stats["prompt_tokens"] += len(req.origin_input_ids)
            self.stats["cached_tokens"] += req.cached_tokens
            self.activity.record_ttft(ts.first_token - ts.created)
        if token is None:  # max_new_tokens == 0: prefill only, the prompt stays in the cache
            self._finish(req, {"type": "length", "length": 0})
            return False
        self._append_token(req, token)
        if req.finished:
            self._release(req)
        elif extended:
            self.tree_cache.cache_unfinished_req(req)
        self._emit(req)
        return not req.finished

    def _append_token(self, req: Req, token: int) -> None:
        if req.grammar is not None:  # raises ConstraintError if the token breaks the constraint
            req.grammar.accept_token(token)
        req.output_ids.append(token)
        self.stats["generation_tokens"] += 1
        p = req.sampling_params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            req.finished_reason = {"type": "stop", "matched": token}
        elif len(req.output_ids) >= p.max_new_tokens or req.seqlen >= self.context_len:
            req.finished_reason = {"type": "length", "length": len(req.output_ids)}
        elif req.grammar is not None and req.grammar.is_terminated():
            req.finished_reason = {"type": "stop", "matched": token}
        text_before = len(req.text)
        detokenize_step(self.tokenizer, req, final=req.finished)
        if not req.finished and p.stop:
            self._check_stop_strings(req, max(0, text_before - max(map(len, p.stop)) + 1))
        if not req.finished and p.stop_regex:
            self._check_stop_regex(req)

    def _check_stop_strings(self, req: Req, start: int) -> None:
        """Looks for a stop string in the text that could contain one only now."""
        hits = [(pos, s) for s in req.sampling_params.stop if (pos := req.text.find(s, start)) >= 0]
        if hits:
            pos, matched = min(hits)
            if not req.sampling_params.no_stop_trim:
                req.text = req.text[:pos]
            req.finished_reason = {"type": "stop", "matched": matched}

    @staticmethod
    def _check_stop_regex(req: Req) -> None:
        """As SGLang: a search over the output text, which is kept whole (RE2: linear time)."""
        for pattern in req.sampling_params.stop_regex:
            if stop_regex_matcher(pattern).search(req.text):
                req.finished_reason = {"type": "stop", "matched": pattern}
                return

    def _finish(self, req: Req, reason: dict) -> None:
        req.finished_reason = reason
        self._release(req)
        self._emit(req)

    def _release(self, req: Req) -> None:
        """A finished request's KV goes back through the cache layer, unless its streaming
        session keeps the row for the next turn."""
        if not self.sessions.keep_row(req):
            self.tree_cache.release_req(req)
        self.sessions.turn_ended(req)

    def _emit(self, req: Req) -> None:
        """Sends the new text and ids to whoever waits for this request (stream) or the whole
        result when it finishes."""
        interval = req.sampling_params.stream_interval
        if req.finished:
            req.time_stats.finished = time.perf_counter()
        elif not req.stream:
            return
        elif interval and req.sent_ids_len and len(req.output_ids) - req.sent_ids_len < interval:
            return  # stream_interval: a piece every `interval` tokens (the first at once)
        text_end = len(req.text)
        if not req.finished and req.sampling_params.stop:
            # Hold back what could still become the start of a stop string.
            text_end = max(req.sent_text_len, text_end - max(map(len, req.sampling_params.stop)) + 1)
        out = {
            "rid": req.rid,
            "text": req.text[req.sent_text_len : text_end],
            "output_ids": req.output_ids[req.sent_ids_len :],
            "finished": req.finished,
            "finish_reason": req.finished_reason,
            "req": req,
        }
        req.sent_text_len, req.sent_ids_len = text_end, len(req.output_ids)
        if req.on_output is None:
            return
        try:
            req.on_output(out)
        except Exception as e:  # the consumer's code, not ours: end its request, nothing else
            logger.exception("output callback of request %s failed", req.rid)
            if not req.finished:
                req.to_abort = f"its output callback failed: {e!r}"

    # ---- aborts and failures -------------------------------------------------------------
    def _handle_aborts(self) -> None:
        for req in [r for r in self.waiting if r.to_abort]:
            self.waiting.remove(req)
            self._finish(req, {"type": "abort", "message": req.to_abort})
        if self.chunked_req is not None and self.chunked_req.to_abort:
            req, self.chunked_req = self.chunked_req, None
            self._finish(req, {"type": "abort", "message": req.to_abort})
        for req in [r for r in self.running if r.to_abort]:
            self.running.remove(req)
            self._finish(req, {"type": "abort", "message": req.to_abort})

    def _fail_req(self, req: Req, message: str) -> None:
        """Ends one request with an error; whatever it held is released."""
        self.stats["num_failed_reqs"] += 1
        if self.chunked_req is req:
            self.chunked_req = None
        self._finish(req, {"type": "abort", "message": message})  # releasing is idempotent

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

    def _trace_batch(self, batch: ScheduleBatch, mwb) -> None:
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
