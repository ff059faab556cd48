"""Aborts by rid reach the same requests whether they arrive while the request is being submitted
or once it runs: a copy's rid ("rid-0" of an n > 1 request) ends that copy alone, whether the
client named the request or not."""

from __future__ import annotations

import asyncio

import pytest

from baby_sgl import Engine
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


@pytest.fixture(scope="module")
def long_engine(tiny_llama_long):
    """Requests that run for seconds, so an abort lands while they run."""
    with Engine(tiny_llama_long, dtype="float32", max_total_tokens=65536) as engine:
        yield engine
        engine.check_memory()


def test_an_abort_of_one_copy_of_a_request_without_rid_spares_the_others(long_engine):
    # Before: AsyncEngine._submit keyed an item without a rid by its first copy's rid (`key =
    # item.get("rid") or reqs[0].rid`), so an abort of copy 0 by its id ended every copy.
    aengine = AsyncEngine(long_engine, Metrics("tiny"))
    item = {"prompt": "copies without a rid", "sampling_params": {"max_new_tokens": 16000, "n": 2, **GREEDY}}

    async def run() -> bool:
        """Whether copy 1 went on after copy 0 was aborted."""
        ids: dict[int, str] = {}
        copy_0_ended, went_on = False, None
        async for i, piece in aengine.generate([item], stream=True):
            if i not in ids:
                ids[i] = piece["meta_info"]["id"]
                if len(ids) == 2:
                    aengine.abort(ids[0])
            elif i == 0 and piece["finished"]:
                assert piece["meta_info"]["finish_reason"]["type"] == "abort"
                copy_0_ended = True
            elif i == 1 and copy_0_ended and went_on is None:
                went_on = not piece["finished"]
                aengine.abort(ids[1])  # seen: no need to run it to its end
        return bool(went_on)

    assert asyncio.run(run())
