"""The asyncio bridge between the HTTP server and the engine: a client that leaves while its
session turn is still being submitted (that happens off the event loop) leaves nothing behind."""

from __future__ import annotations

import asyncio

import pytest

from baby_sgl import Engine
from baby_sgl.entrypoints.async_bridge import AsyncEngine
from baby_sgl.entrypoints.metrics import Metrics
from helpers import wait_until, wait_until_async


def test_turn_cancelled_during_submission_is_aborted_and_forgotten(tiny_llama):
    with Engine(tiny_llama, dtype="float32", max_total_tokens=2048) as engine:
        bridge = AsyncEngine(engine, Metrics("tiny"))
        sid = engine.open_session(1000)
        item = {"input_ids": [5 + i for i in range(20)], "rid": "turn-1", "session_params": {"id": sid},
                "sampling_params": {"max_new_tokens": 500, "ignore_eos": True, "temperature": 0}}

        async def leave_during_submission() -> None:
            pieces = bridge.generate([item], stream=True)
            first = asyncio.ensure_future(pieces.__anext__())
            await asyncio.sleep(0)  # the handler now waits for the submission thread
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            # A server's loop keeps running: let the submission thread finish and its
            # completion reach the loop before looking.
            await asyncio.get_running_loop().shutdown_default_executor()
            await wait_until_async(lambda: not bridge.active, "the cancelled turn's rid to be released", timeout=10)

        asyncio.run(leave_during_submission())
        assert not bridge.active, "the rid of a cancelled turn stayed registered"
        wait_until(lambda: engine.get_server_info()["num_running_reqs"] == 0, "the cancelled turn to end")
        info = engine.get_server_info()
        assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
        engine.close_session(sid)
        engine.check_memory()
