"""Backpressure's last resort, around every response (a plain ASGI middleware): each write must
be taken by the client within `--stream-send-timeout` seconds. The server waits for a client's
socket to drain before writing more, so a client that stops reading stops its stream (the
engine's pieces wait, joined, in a bounded buffer: async_bridge.py); one that reads nothing for
that long is cut off: the connection is closed, which ends its requests (the bridge watches for
departures) and frees their KV."""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)


class ClientStalled(Exception):
    """A write of the response waited longer than the send timeout."""


class SendDeadline:
    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        cut_off = False

        async def timed_send(message: Message) -> None:
            nonlocal cut_off
            try:
                async with asyncio.timeout(self.timeout):
                    await send(message)
            except TimeoutError:
                cut_off = True
                raise ClientStalled from None

        async def receive_unless_cut_off() -> Message:
            # The server's own closing waits for the client to take what was written, which it
            # may never do: the app is told at once that the client is gone.
            return {"type": "http.disconnect"} if cut_off else await receive()

        try:
            await self.app(scope, receive_unless_cut_off, timed_send)
        except ClientStalled:
            # Returning with the response unfinished makes the HTTP server close the connection.
            logger.warning("a client read nothing of its response to %s for %g s (--stream-send-timeout): "
                           "cut off", scope["path"], self.timeout)
