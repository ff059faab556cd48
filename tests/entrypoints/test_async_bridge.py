"""The asyncio bridge between the HTTP server and the engine: a client that leaves while its
session turn is still being submitted (that happens off the event loop) leaves nothing behind, and
a long output that came in many pieces is joined at a cost linear in its length."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from baby_sgl import Engine
from baby_sgl.entrypoints.async_bridge import MAX_BUFFERED_PIECES, AsyncEngine
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


class _CountedText(str):
    """A piece's text that counts the characters copied by concatenating it with `+`."""
    copied = 0

    def __add__(self, other: str) -> _CountedText:
        joined = _CountedText(str(self) + str(other))
        _CountedText.copied += len(joined)
        return joined

    def __radd__(self, other: str) -> _CountedText:
        joined = _CountedText(str(other) + str(self))
        _CountedText.copied += len(joined)
        return joined


class _ManyPieces:
    """Just enough of an Engine for AsyncEngine.generate: each request is delivered at once as
    `pieces` pieces of ten characters and one token each, before the consumer reads any."""
    sampling_defaults: dict[str, Any] = {}

    def __init__(self, pieces: int) -> None:
        self.pieces = pieces

    def submit(self, rid: str, on_output: Any, **_: Any) -> list[Any]:
        for k in range(self.pieces):
            on_output({"text": _CountedText(f"{k % 10}" * 10), "output_ids": [k], "finished": k == self.pieces - 1,
                       "meta_info": {"id": rid, "completion_tokens": k + 1, "output_token_logprobs": [(-1.0, k, None)]}})
        return [SimpleNamespace(rid=rid, finished=True)]

    def is_alive(self) -> bool:
        return True

    def abort_request(self, rid: str) -> None:
        pass


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "slow-reader"])
def test_many_pieces_are_joined_in_linear_time(stream):
    # Not read while they come (a non-streamed call, or a streaming client behind), the pieces are
    # joined: the buffer joins those past its bound, a non-streamed call all of them. Joining by
    # `text + text` copied the whole text so far at every piece, O(n^2) for a long output.
    n = 2000
    bridge = AsyncEngine(_ManyPieces(n), Metrics("tiny"))  # type: ignore[arg-type]

    async def pieces() -> list[dict]:
        return [chunk async for _, chunk in bridge.generate([{"input_ids": [1]}], stream=stream, log_metrics=False)]

    _CountedText.copied = 0
    got = asyncio.run(pieces())
    assert len(got) == (MAX_BUFFERED_PIECES if stream else 1)
    text = "".join(p["text"] for p in got)
    assert text == "".join(f"{k % 10}" * 10 for k in range(n))
    assert [i for p in got for i in p["output_ids"]] == list(range(n))
    assert [e[1] for p in got for e in p["meta_info"]["output_token_logprobs"]] == list(range(n))
    assert got[-1]["finished"] and got[-1]["meta_info"]["completion_tokens"] == n
    assert _CountedText.copied <= len(text), f"joining copied {_CountedText.copied} characters for {len(text)}"
