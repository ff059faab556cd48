"""Runs engine requests from asyncio: results come back from the scheduler thread through
call_soon_threadsafe, and a consumer that goes away (client disconnect) aborts its requests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from baby_sgl.engine import Engine


async def stream_requests(engine: Engine, items: list[dict[str, Any]], stream: bool,
                          on_finished: Callable[[dict], None] | None = None) -> AsyncIterator[tuple[int, dict]]:
    """Submits one engine request per item (a dict of `Engine.submit` arguments) and yields
    (index, chunk); an item with n > 1 yields its copies under consecutive indices. Raises
    ValueError (nothing left running) if any item is invalid."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def deliver(chunk: dict) -> None:  # called in the scheduler thread
        loop.call_soon_threadsafe(queue.put_nowait, chunk)

    submitted = []
    try:
        for item in items:
            submitted += engine.submit(**item, stream=stream, on_output=deliver)
    except ValueError:
        for req in submitted:
            engine.abort_request(req.rid)
        raise
    index = {req.rid: i for i, req in enumerate(submitted)}
    pending = len(submitted)
    try:
        while pending:
            chunk = await queue.get()
            if chunk["finished"]:
                pending -= 1
                if on_finished:
                    on_finished(chunk["meta_info"])
            yield index[chunk["meta_info"]["id"]], chunk
    finally:
        for req in submitted:
            if not req.finished:
                engine.abort_request(req.rid)
