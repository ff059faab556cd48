"""The asyncio face of an Engine for the HTTP server.

Results come back from the scheduler thread through call_soon_threadsafe. Every request is
streamed from the engine, even when the client wants one response: the time of each piece is
what the inter-token latency metric measures. Metrics are recorded in the scheduler thread as
pieces are delivered, so requests whose client left still count. A consumer that goes away
(a client disconnect, a cancelled task) aborts its requests, so their KV is freed at the next
step. Pieces wait for their consumer in a bounded buffer (PieceBuffer): one that falls behind
gets fewer, larger pieces, never an ever longer queue."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from baby_sgl.core.finish_reason import FinishAbort, FinishReason
from baby_sgl.engine import Engine
from baby_sgl.entrypoints.metrics import Metrics
from baby_sgl.errors import EngineDeadError, ServerBusyError
from baby_sgl.core.req import Req
from baby_sgl.managers.tokenizer_manager import TokenizerManager
from baby_sgl.core.sampling_params import SamplingParams

# How often a waiting request checks that its client is still there (SGLang: every 4 s).
DISCONNECT_POLL_S = 0.5
# Pieces that may wait for one call's consumer before new ones are joined to them.
MAX_BUFFERED_PIECES = 64
# Threads that tokenize prompts and render chat templates: the work of a request before it is
# queued. More would only share the same cores.
PREPARE_THREADS = 4

# Aborts remembered for rids whose request is still being submitted (the oldest are forgotten).
MAX_EARLY_ABORTS = 1024

T = TypeVar("T")


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: Metrics, max_queued_requests: int | None = None) -> None:
        self.engine, self.metrics = engine, metrics
        self.max_queued = max_queued_requests
        # The rid a client gave -> its engine requests (n > 1 runs copies "rid-0", "rid-1", ...),
        # so /abort_request with that rid reaches all of them and a reused rid is refused.
        self.active: dict[str, list[Req]] = {}
        # The engine rids each client-given rid expands to (n > 1 makes copies "rid-0", ...), held
        # from submission to the end, so no two running requests share an engine rid.
        self._reserved: dict[str, list[str]] = {}
        self._lock = threading.Lock()  # submissions run in worker threads
        self._pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare")
        self._preparing = 0  # requests on or waiting for the pool
        self._prep_lock = threading.Lock()
        # Aborts of rids that had no request yet, while some submission was in progress: that
        # submission may be the one the abort meant (rid -> the ticket it got). Bounded, and
        # emptied whenever no submission is in progress.
        self._tickets = itertools.count()
        self._submitting: set[int] = set()
        self._early_aborts: OrderedDict[str, int] = OrderedDict()

    async def off_loop(self, requests: int, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the bounded pool, off the event loop: the tokenizing and templating of
        `requests` requests. While they wait or run there they count against
        --max-queued-requests, with the engine's queue, so a flood of long prompts gets 503s
        instead of a backlog that every later request waits behind."""
        self._reserve(requests)
        return await self._on_pool(requests, fn, *args)

    def _reserve(self, requests: int) -> None:
        """Counts `requests` as waiting from now until _done_preparing, or raises ValueError (more
        than can ever wait) or ServerBusyError (no room now)."""
        if self.max_queued is not None:
            if requests > self.max_queued:
                raise ValueError(f"this call holds {requests} requests; at most {self.max_queued} can wait at "
                                 f"once (--max-queued-requests)")
            if self.engine.num_queued() + self._preparing + requests > self.max_queued:
                raise ServerBusyError(f"the request queue is full ({self.max_queued} requests wait); "
                                      "try again later")
        with self._prep_lock:
            self._preparing += requests

    async def _on_pool(self, requests: int, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the pool for `requests` reserved requests, which stop counting the moment
        fn returns (or the job is cancelled unrun), not when this coroutine resumes: by then fn's
        requests are in the engine's queue, counted there."""
        try:
            job = self._pool.submit(fn, *args)
        except BaseException:
            self._done_preparing(requests)
            raise
        job.add_done_callback(lambda _: self._done_preparing(requests))
        return await asyncio.wrap_future(job)

    def _done_preparing(self, requests: int) -> None:
        with self._prep_lock:
            self._preparing -= requests

    def abort_all(self) -> None:
        """Aborts every request submitted through this bridge (the server stops)."""
        for rid in list(self.active):
            self.abort(rid)

    def abort(self, rid: str) -> None:
        with self._lock:
            reqs = self.active.get(rid)
            if not reqs and self._submitting:
                self._early_aborts[rid] = next(self._tickets)
                self._early_aborts.move_to_end(rid)
                if len(self._early_aborts) > MAX_EARLY_ABORTS:
                    self._early_aborts.popitem(last=False)
        for req in reqs or []:
            self.engine.abort_request(req.rid)
        if reqs is None:
            self.engine.abort_request(rid)  # maybe one copy of an n > 1 request

    async def generate(self, items: list[dict[str, Any]], stream: bool,
                       disconnected: Callable[[], Awaitable[bool]] | None = None, log_metrics: bool = True
                       ) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
        """Submits one engine request per item (a dict of `Engine.submit` arguments) and yields
        (index, chunk): every piece if `stream`, else only each request's whole result. An item
        with n > 1 yields its copies under consecutive indices. Raises ValueError, with nothing
        left running, if any item is invalid. `disconnected` is polled while waiting; when it
        says so the requests are aborted and the iteration ends."""
        loop = asyncio.get_running_loop()
        queue = PieceBuffer()
        last_piece: dict[str, float] = {}  # rid -> time of its previous piece; scheduler thread only

        def deliver(chunk: dict) -> None:  # called in the scheduler thread
            if log_metrics:
                self._observe(chunk, last_piece)
            try:
                loop.call_soon_threadsafe(queue.put, chunk)
            except RuntimeError:  # the server stopped; nobody is waiting for this any more
                pass

        # The requests (each item's n samples) count against --max-queued-requests from before
        # their grammars compile: a flood of distinct grammars waits for the compile threads too.
        params = [self._sampling_params(item) for item in items]
        requests = sum(1 if p is None else p.n for p in params)
        self._reserve(requests)
        ticket = self._open_submission()
        try:
            # Grammars compile on the engine's compile threads; awaiting them here holds no worker
            # thread, so a slow compile never queues other clients' submissions behind it.
            await self._compile_grammars(params)
        except BaseException:
            self._close_submission(ticket)
            self._done_preparing(requests)
            raise
        # Tokenizing (and a session turn's checks in the scheduler thread) run off the event
        # loop, so a long prompt never stalls other clients or /health. (Shielded below: it runs.)
        submitting = asyncio.ensure_future(self._on_pool(requests, self._submit, items, deliver, stream, ticket))
        # Closed however it ends: refused for a full queue before it ran, failed, or done.
        submitting.add_done_callback(lambda _: self._close_submission(ticket))
        try:
            submitted, keys = await asyncio.shield(submitting)
        except asyncio.CancelledError:
            # The client left while its request was being submitted: undo it once it is in.
            submitting.add_done_callback(self._undo_submission)
            raise
        index = {req.rid: i for i, req in enumerate(submitted)}
        partial: dict[int, JoinedPieces] = {}
        pending = len(submitted)
        watcher = asyncio.create_task(self._watch(disconnected, queue, submitted, keys)) if disconnected else None
        try:
            while pending:
                chunk = await queue.get()
                if chunk is None:  # the client left
                    return
                if chunk["finished"] and not self.engine.is_alive():
                    reason = FinishReason.from_json(chunk["meta_info"]["finish_reason"])
                    raise EngineDeadError(reason.message if isinstance(reason, FinishAbort) else "the engine stopped")
                i = index[chunk["meta_info"]["id"]]
                pending -= chunk["finished"]
                if stream:
                    yield i, chunk
                else:
                    if i in partial:
                        partial[i].add(chunk)
                    else:
                        partial[i] = JoinedPieces(chunk)
                    if chunk["finished"]:
                        yield i, partial.pop(i).take()
        finally:
            if watcher:
                watcher.cancel()
            for req in submitted:
                if not req.finished:
                    self.engine.abort_request(req.rid)
            self._forget(keys)

    async def _watch(self, disconnected: Callable[[], Awaitable[bool]], queue: PieceBuffer,
                     submitted: list[Req], keys: list[str]) -> None:
        """Polls on a clock, not between pieces: a busy stream must notice a departure too, and so
        must one whose response is stuck (a client cut off for not reading), which will never
        ask for another piece."""
        while not await disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        for req in submitted:
            if not req.finished:
                self.engine.abort_request(req.rid)
        self._forget(keys)
        queue.put(None)

    def _undo_submission(self, submitting: asyncio.Future) -> None:
        if submitting.cancelled() or submitting.exception() is not None:
            return  # nothing was left running
        submitted, keys = submitting.result()
        for req in submitted:
            self.engine.abort_request(req.rid)
        self._forget(keys)

    def _sampling_params(self, item: dict[str, Any]) -> SamplingParams | None:
        """The item's sampling parameters, or None where they are invalid (submission reports it)."""
        try:
            return SamplingParams.from_dict(item.get("sampling_params"), self.engine.sampling_defaults,
                                            item.get("server_grammar"))
        except ValueError:
            return None

    async def _compile_grammars(self, params: list[SamplingParams | None]) -> None:
        keys = {p.grammar for p in params if p is not None and p.grammar is not None}
        # Shielded: a compile may be shared with other requests, and a client leaving must not
        # cancel it for them.
        await asyncio.gather(*(asyncio.shield(asyncio.wrap_future(self.engine.grammars.submit(k))) for k in keys))

    def _open_submission(self) -> int:
        with self._lock:
            ticket = next(self._tickets)
            self._submitting.add(ticket)
            return ticket

    def _close_submission(self, ticket: int) -> None:
        with self._lock:
            self._submitting.discard(ticket)
            if not self._submitting:
                self._early_aborts.clear()

    def _register(self, key: str, reqs: list[Req], ticket: int) -> None:
        """The requests of one item are in: abortable by their rid from now on, and aborted now
        if an abort for their rid came while they were being submitted (the item's rid: all of
        them; a copy's rid: that copy, as `abort` does once they run)."""
        with self._lock:
            self.active[key] = reqs
            item_aborted = self._early_aborts.pop(key, -1) > ticket
            copies_aborted = [req for req in reqs if self._early_aborts.pop(req.rid, -1) > ticket]
        for req in reqs if item_aborted else copies_aborted:
            self.engine.abort_request(req.rid)

    def _submit(self, items: list[dict[str, Any]], deliver: Callable[[dict], None],
                stream: bool, ticket: int) -> tuple[list[Req], list[str]]:
        given = [item["rid"] for item in items if item.get("rid") is not None]
        planned = {item["rid"]: self._engine_rids(item) for item in items if item.get("rid") is not None}
        every = [r for rids in planned.values() for r in rids]
        with self._lock:  # check and reserve the rids at once: two submissions may race
            taken = {r for rids in self._reserved.values() for r in rids}
            clash = next((r for r in given if r in self.active or given.count(r) > 1), None)
            clash = clash or next((r for r in every if r in taken or every.count(r) > 1), None)
            if clash is not None:
                raise ValueError(f"duplicate request id {clash!r}: a request with this rid is running or in this call")
            for rid in given:
                self.active[rid] = []
            self._reserved.update(planned)
        submitted: list[Req] = []
        keys: list[str] = list(given)
        try:
            for item in items:
                # An item without a rid gets one as its key: an abort of it reaches all its
                # copies, one of a copy's own rid that copy alone.
                key = item.get("rid") or uuid.uuid4().hex
                reqs = self.engine.submit(**(item | {"rid": key}), stream=True, on_output=deliver,
                                          partial_logprobs=stream)
                submitted += reqs
                if key not in given:
                    keys.append(key)
                self._register(key, reqs, ticket)
        except Exception:
            for req in submitted:
                self.engine.abort_request(req.rid)
            self._forget(keys)
            raise
        return submitted, keys

    def _engine_rids(self, item: dict[str, Any]) -> list[str]:
        """The rids the engine will give this item's requests (n > 1 makes copies)."""
        params = SamplingParams.from_dict(item.get("sampling_params"), self.engine.sampling_defaults,
                                          item.get("server_grammar"))
        return TokenizerManager.copy_rids(item["rid"], params.n)

    def _forget(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                self.active.pop(key, None)
                self._reserved.pop(key, None)

    def _observe(self, chunk: dict, last_piece: dict[str, float]) -> None:
        """Inter-token latency as SGLang measures it: the time since the request's previous
        piece, shared by the tokens this piece brought."""
        rid, now, new = chunk["meta_info"]["id"], time.perf_counter(), len(chunk["output_ids"])
        if new and rid in last_piece:
            self.metrics.observe_inter_token_latency(now - last_piece[rid], new)
        if new:
            last_piece[rid] = now
        if chunk["finished"]:
            last_piece.pop(rid, None)
            self.metrics.observe_finished(chunk["meta_info"])


class PieceBuffer:
    """The pieces delivered to one call and not yet taken, on the event loop. At most
    MAX_BUFFERED_PIECES wait: past that a new piece is joined to its request's latest waiting
    one, so a consumer that falls behind holds its requests' outputs, never a piece per token.
    None (the client left) is always kept."""

    def __init__(self) -> None:
        self._pieces: deque[JoinedPieces | None] = deque()
        self._ready = asyncio.Event()

    def put(self, piece: dict | None) -> None:
        if piece is not None and len(self._pieces) >= MAX_BUFFERED_PIECES:
            rid = piece["meta_info"]["id"]
            for i in range(len(self._pieces) - 1, -1, -1):
                waiting = self._pieces[i]
                if waiting is not None and waiting.rid == rid:
                    waiting.add(piece)
                    return
        self._pieces.append(None if piece is None else JoinedPieces(piece))
        self._ready.set()

    async def get(self) -> dict | None:
        while not self._pieces:
            self._ready.clear()
            await self._ready.wait()
        waiting = self._pieces.popleft()
        return None if waiting is None else waiting.take()


# The meta_info lists that hold one entry per output token: a piece carries its own tokens' entries.
OUTPUT_LOGPROB_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


class JoinedPieces:
    """Consecutive pieces of one request becoming one, built in the first (a piece no one else
    holds). Ids and output logprob entries are appended as pieces come; the texts are kept as
    parts and joined once, in `take`: adding a piece costs its own size, so joining a long output
    that came a token a step costs its length, not its square. The result has the latest
    meta_info with the output logprob entries of all (the prompt's, sent once, kept from any)."""

    def __init__(self, first: dict) -> None:
        self.rid: str = first["meta_info"]["id"]
        self._piece = first
        self._texts: list[str] = [first["text"]]

    def add(self, later: dict) -> None:
        piece = self._piece
        meta = piece["meta_info"] | later["meta_info"]
        for key in OUTPUT_LOGPROB_KEYS:
            if key in piece["meta_info"] and key in later["meta_info"]:
                meta[key] = piece["meta_info"][key]
                meta[key] += later["meta_info"][key]
        piece["output_ids"] += later["output_ids"]
        piece.update(meta_info=meta, finished=later["finished"])
        self._texts.append(later["text"])

    def take(self) -> dict:
        """The joined piece; pieces added later join it (its text kept as their first part)."""
        if len(self._texts) > 1:
            self._texts = ["".join(self._texts)]
        self._piece["text"] = self._texts[0]
        return self._piece
