"""Aborts by rid reach the same requests whether they arrive while the request is being submitted
or once it runs: a copy's rid ("rid-0" of an n > 1 request) ends that copy alone."""

from __future__ import annotations

import asyncio

from baby_sgl.entrypoints.async_bridge import AsyncEngine
from baby_sgl.entrypoints.metrics import Metrics
from helpers import GREEDY, hold_submissions


def test_an_early_abort_of_one_copy_spares_the_others(engine, monkeypatch):
    # Before: AsyncEngine._register aborted every request of the item (`for req in reqs`) when an
    # abort had come for any of their rids, so "copies-0" ended "copies-1" too (an abort of
    # "copies-0" once both run ends that copy alone).
    aengine = AsyncEngine(engine, Metrics("tiny"))
    submitting, aborted = hold_submissions(engine, monkeypatch)
    item = {"prompt": "two copies", "sampling_params": {"max_new_tokens": 64, "n": 2, **GREEDY}, "rid": "copies"}

    async def run() -> dict[str, dict]:
        async def collect() -> dict[str, dict]:
            return {out["meta_info"]["id"]: out["meta_info"] async for _, out in aengine.generate([item], stream=False)}

        result = asyncio.ensure_future(collect())
        await asyncio.to_thread(submitting.wait, 30)
        aengine.abort("copies-0")
        aborted.set()
        return await result

    metas = asyncio.run(run())
    assert metas["copies-0"]["finish_reason"]["type"] == "abort"
    assert metas["copies-1"]["finish_reason"]["type"] == "length" and metas["copies-1"]["completion_tokens"] == 64
