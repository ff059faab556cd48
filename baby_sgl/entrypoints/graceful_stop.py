"""The server's graceful stop (SIGTERM, or Ctrl-C): from the signal on, a new request gets 503
(and /health says so, so a load balancer looks elsewhere); the requests being answered get
`--graceful-shutdown-timeout` seconds to finish; then the rest are aborted, which ends each with
an answer (an abort finish reason, or the end of its stream), and the server exits. A request is
counted from its first byte to the last byte of its answer, streamed or not, so the stop waits
for what clients are actually receiving."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from baby_sgl.entrypoints.async_bridge import AsyncEngine
from baby_sgl.entrypoints.responses import error_response

logger = logging.getLogger(__name__)

POLL_S = 0.05
# After the abort, the time the aborted requests get to send their last answer.
ABORTED_ANSWER_S = 5.0


@dataclass
class StopState:
    stopping: bool = False
    answering: int = 0  # requests between their first byte and the last byte of their answer


class StopGuard:
    """The outermost middleware: counts the requests being answered, and refuses new ones once
    the server stops."""

    def __init__(self, app: ASGIApp, state: StopState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.state.stopping:
            refusal = error_response("the server is shutting down; try another server or later", 503,
                                     headers={"Connection": "close"}, path=scope["path"])
            await refusal(scope, receive, send)
            return
        self.state.answering += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.answering -= 1


async def stop_gracefully(state: StopState, aengine: AsyncEngine, timeout: float) -> None:
    """Refuses new requests, waits up to timeout seconds for the open ones to be answered, then
    aborts the engine's requests until every open one has been answered (or ABORTED_ANSWER_S)."""
    state.stopping = True
    logger.warning("stopping: %d requests open, %g s for them to finish", state.answering, timeout)
    deadline = time.monotonic() + timeout
    while state.answering and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    if not state.answering:
        return
    logger.warning("stopping: aborting the %d requests still open", state.answering)
    deadline = time.monotonic() + ABORTED_ANSWER_S
    while state.answering and time.monotonic() < deadline:
        aengine.abort_all()  # again each time: a request still being submitted joins later
        await asyncio.sleep(POLL_S)
