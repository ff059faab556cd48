"""What the scheduler publishes for other threads to read without running anything in its thread:
its progress and load counters at every turn of its loop, and the dashboard's snapshot at a
bounded rate when someone wants one. Any number of pollers (/metrics, /server_info, the
dashboard) then cost the scheduler nothing per poll: a reader waits, in its thread or on its
event loop, for a state at least as new as its question, and all readers share each one.

Freshness: a reader that asks at turn t gets the state published after t, or the current one if
the scheduler is settled (idle, nothing in its inbox: its state stands until a message comes),
so what a client did before asking (a finished request, a flushed cache) is always counted."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from baby_sgl.errors import EngineDeadError

VIEW_INTERVAL_S = 0.2  # the dashboard snapshot is taken at most this often
# ... and at most 1/this of the scheduler's time goes to taking it (or to a memory check asked over
# HTTP: entrypoints/native_api.py's SpacedCalls)
VIEW_COST_FACTOR = 10
_DEAD_POLL_S = 0.25  # how often a waiting reader checks that the scheduler still runs

T = TypeVar("T")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Progress:
    """The scheduler as of its loop's last turn, readable from any thread: health checks must
    not wait for a loop that may be stuck, and the event loop must not touch its lists."""

    running: int
    waiting: int
    last_forward: float  # time.monotonic() when the last forward pass ended


@dataclass(frozen=True)
class Stamped(Generic[T]):
    turn: int  # the scheduler's turn it was taken at
    value: T


class Snapshots:
    def __init__(self, progress: Progress, load: dict[str, Any]) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._loop_waiters: dict[asyncio.AbstractEventLoop, asyncio.Future[None]] = {}
        self.progress = progress  # the latest, for readers that must never wait
        self._turn = 0
        self._settled = False
        self._load = Stamped(0, load)
        self._view: Stamped[Any] | None = None
        self._view_wanted = False
        self._next_view_at = 0.0
        self._closed: str | None = None

    # ---- the scheduler thread ----------------------------------------------------------------
    def publish(self, progress: Progress, load: dict[str, Any], settled: Callable[[], bool],
                take_view: Callable[[], Any] | None) -> None:
        """A new turn's state; take_view is called for the dashboard's snapshot when one is due.
        settled() says the state stands until a message comes (checked under the lock, which a
        sender holds from its put until it has marked the state unsettled: see `sending`)."""
        view: Any = None
        now = time.monotonic()
        if take_view is not None and self._view_wanted and now >= self._next_view_at:
            try:
                view = take_view()
            except Exception as e:  # a bug in the view: its readers get the error, the scheduler goes on
                logger.exception("taking the dashboard snapshot failed")
                view = e
            took = time.monotonic() - now
            self._next_view_at = now + max(VIEW_INTERVAL_S, VIEW_COST_FACTOR * took)
        with self._lock:
            self._turn += 1
            self.progress, self._load = progress, Stamped(self._turn, load)
            if view is not None:
                self._view, self._view_wanted = Stamped(self._turn, view), False
            self._settled = settled()
            self._wake()

    def view_due_in(self) -> float | None:
        """Seconds until a wanted dashboard snapshot may be taken (None: none is wanted)."""
        return max(0.0, self._next_view_at - time.monotonic()) if self._view_wanted else None

    def close(self, reason: str) -> None:
        """The scheduler stopped: every reader waiting now or later gets EngineDeadError."""
        with self._lock:
            self._closed = reason
            self._wake()

    def _wake(self) -> None:
        self._changed.notify_all()
        waiters, self._loop_waiters = self._loop_waiters, {}
        for loop, future in waiters.items():
            try:
                loop.call_soon_threadsafe(_resolve, future)
            except RuntimeError:  # that loop has closed; nobody waits there any more
                pass

    # ---- other threads -------------------------------------------------------------------------
    def sending(self, put: Callable[[], None]) -> None:
        """put() a message in the scheduler's inbox: readers wait for the turn that takes it. Both
        under the lock, so no turn publishes in between: a scheduler that took the message and
        published `settled` before this sender marked it unsettled would leave readers waiting
        for a turn that an idle scheduler does not take."""
        with self._lock:
            put()
            self._settled = False

    def load_probe(self) -> Callable[[], dict[str, Any] | None]:
        """A probe that gives the load once it is fresh for a question asked now."""
        with self._lock:
            asked = self._turn
        return lambda: self._load.value if self._fresh(self._load.turn, asked) else None

    def view_probe(self) -> tuple[Callable[[], Any | None], bool]:
        """A probe that gives the dashboard's snapshot once it is fresh for a question asked now,
        and whether the caller must wake the scheduler to take one (once per wanted snapshot)."""
        with self._lock:
            asked = self._turn

            def probe() -> Any | None:
                view = self._view
                if view is None or not self._fresh(view.turn, asked):
                    return None
                if isinstance(view.value, Exception):
                    raise view.value
                return view.value

            if probe() is not None:
                return probe, False
            first, self._view_wanted = not self._view_wanted, True
            return probe, first

    def _fresh(self, turn: int, asked: int) -> bool:
        if self._closed is not None:
            raise EngineDeadError(f"the engine has stopped: {self._closed}")
        return turn > asked or (self._settled and turn == self._turn)

    # ---- waiting ---------------------------------------------------------------------------------
    def wait(self, probe: Callable[[], T | None]) -> T:
        """probe's value once it has one, waiting in this thread."""
        with self._lock:
            while (value := probe()) is None:
                self._changed.wait(_DEAD_POLL_S)
            return value

    async def wait_async(self, probe: Callable[[], T | None]) -> T:
        """probe's value once it has one, waiting on the running event loop (no thread held)."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if (value := probe()) is not None:
                    return value
                future = self._loop_waiters.get(loop)
                if future is None:
                    future = self._loop_waiters[loop] = loop.create_future()
            try:  # shielded: the waiters on this loop share the future
                await asyncio.wait_for(asyncio.shield(future), _DEAD_POLL_S)
            except asyncio.TimeoutError:
                pass


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
