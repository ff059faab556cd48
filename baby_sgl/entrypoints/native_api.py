"""SGLang's native API (/generate, /health, /get_server_info, sessions, ...) as routes of the app
(http_server.py). Calls that wait for the engine (cache flush, memory check) go through a worker
thread, so the event loop, and with it /health, never waits on engine work; server info and
metrics come from what the scheduler publishes every turn, awaited on the event loop."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Generic, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from baby_sgl.core.finish_reason import FinishAbort, FinishReason
from baby_sgl.engine import Engine
from baby_sgl.entrypoints.async_bridge import AsyncEngine, JoinedPieces
from baby_sgl.entrypoints.metrics import Metrics
from baby_sgl.entrypoints.protocol import (AbortRequest, CloseSessionRequest, ConcateAndAppendRequest, GenerateRequest,
                                          OpenSessionRequest)
from baby_sgl.entrypoints.responses import Chunks, error_response, first_item, sse, sse_stream
from baby_sgl.managers.io_struct import LogprobOptions
from baby_sgl.managers.snapshots import VIEW_COST_FACTOR
from baby_sgl.managers.tokenizer_manager import split_batch

T = TypeVar("T")
HEALTH_GENERATE_TIMEOUT_S = 20.0  # as SGLang: an engine that cannot make one token is unhealthy


def _native_items(body: GenerateRequest) -> tuple[list[dict], bool]:
    prompts, params, rids, single = split_batch(body.text, body.input_ids, body.sampling_params, body.rid, "text")
    key = "prompt" if body.text is not None else "input_ids"
    logprobs = {name: getattr(body, name) for name in LogprobOptions.model_fields}
    items = [{key: p, "sampling_params": sp, "rid": r, **logprobs} for p, sp, r in zip(prompts, params, rids)]
    if body.lora_path is not None:
        if isinstance(body.lora_path, list) and len(body.lora_path) != len(items):
            raise ValueError(f"lora_path: {len(body.lora_path)} adapters for {len(items)} prompts")
        for i, item in enumerate(items):
            item["lora_path"] = body.lora_path[i] if isinstance(body.lora_path, list) else body.lora_path
    if body.session_params is not None:
        if len(items) != 1:
            raise ValueError("a session turn is one request: give one text or one input_ids list")
        items[0]["session_params"] = body.session_params
    return items, single


class SpacedCalls(Generic[T]):
    """fn in a worker thread for any number of callers: one call at a time, each starting at least
    (VIEW_COST_FACTOR - 1) times the last one's duration after it ended. fn runs in the
    scheduler's thread (the memory check walks the free list and the radix tree: ~0.1 s at 512k
    pages), so callers looping on it cannot hold more than a tenth of the scheduler's time."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        self._lock = asyncio.Lock()
        self._next_at = 0.0

    async def run(self) -> T:
        async with self._lock:
            if (wait := self._next_at - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            start = time.monotonic()
            try:
                return await asyncio.to_thread(self.fn)
            finally:
                end = time.monotonic()
                self._next_at = end + (VIEW_COST_FACTOR - 1) * (end - start)


def add_native_routes(app: FastAPI, incremental_streaming_output: bool = False) -> None:
    engine: Engine = app.state.engine
    aengine: AsyncEngine = app.state.async_engine
    metrics: Metrics = app.state.metrics

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: probes that want the status alone
    async def health() -> Response:
        if not engine.is_alive():
            return error_response("the engine has stopped", 503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if not engine.is_alive():
            return error_response("the engine has stopped", 503)
        progress = engine.progress()
        if (progress.running or engine.num_queued()) and \
                time.monotonic() - progress.last_forward < HEALTH_GENERATE_TIMEOUT_S:
            return Response(status_code=200)  # busy and making progress: a probe would only queue behind

        async def one_token() -> dict:
            item = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1}}
            return [chunk async for _, chunk in aengine.generate([item], stream=False, log_metrics=False)][0]

        try:
            out = await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return error_response("the engine did not produce a token in time", 503)
        reason = FinishReason.from_json(out["meta_info"]["finish_reason"])
        if isinstance(reason, FinishAbort):
            return error_response(f"the engine failed: {reason.message}", 503)
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict:
        return {"model_path": engine.model_path, "tokenizer_path": engine.tokenizer_path, "is_generation": True,
                "context_length": engine.context_len}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict:
        info = await engine.get_server_info_async()
        return info | app.state.server_settings | getattr(app.state, "listen", {})  # where this server really listens

    @app.get("/get_load")
    async def get_load() -> list[dict]:
        """SGLang's load report, one entry per data-parallel rank (this process is one, --dp-rank):
        what the router's power_of_two policy and /get_loads read."""
        load = await engine.get_server_info_async()
        return [{"dp_rank": app.state.server_settings["dp_rank"], "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                 "num_waiting_reqs": load["num_waiting_reqs"], "num_tokens": load["kv_used_tokens"]}]

    @app.get("/flush_cache")
    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        if not await asyncio.to_thread(engine.flush_cache):
            return error_response("cannot flush the cache while requests are running", 400)
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest) -> Response:
        aengine.abort(body.rid)
        return Response(status_code=200)

    @app.post("/open_session")
    async def open_session(body: OpenSessionRequest) -> str:
        """Returns the session id, as SGLang does (a JSON string)."""
        return await asyncio.to_thread(engine.open_session, **body.model_dump())

    @app.post("/close_session")
    async def close_session(body: CloseSessionRequest) -> Response:
        await asyncio.to_thread(engine.close_session, body.session_id)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        info = await engine.get_server_info_async()
        return Response(metrics.render(info), media_type="text/plain; version=0.0.4")

    memory_checks = SpacedCalls(engine.check_memory)

    @app.api_route("/debug/check_memory", methods=["GET", "POST"])
    async def check_memory() -> JSONResponse:
        try:
            return JSONResponse(await memory_checks.run())
        except AssertionError as e:
            return error_response(f"memory check failed: {e}", 500)

    @app.put("/generate")
    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        items, single = _native_items(body)
        chunks = aengine.generate(items, body.stream, request.is_disconnected, log_metrics=body.log_metrics)
        with_prompt = body.return_prompt_token_ids
        if body.stream:
            first = await first_item(chunks)  # raises ValueError -> 400 before the stream starts
            return StreamingResponse(_native_sse(first, chunks, with_prompt, incremental_streaming_output), media_type="text/event-stream")
        results = {i: chunk async for i, chunk in chunks}
        if await request.is_disconnected():
            return Response(status_code=499)  # nobody to answer; the requests were aborted
        out = [_public(results[i], with_prompt) for i in sorted(results)]
        answer = out[0] if single and len(out) == 1 else out
        # Off the event loop: prompt logprobs can make a body of many megabytes.
        return Response(await asyncio.to_thread(json.dumps, answer, ensure_ascii=False, allow_nan=False),
                        media_type="application/json")

    @app.post("/concate_and_append_request")
    async def concate_and_append(body: ConcateAndAppendRequest) -> Response:
        """SGLang's frontend calls this when `fork(...).join("concate_and_append")` ends: it has
        appended the branches' texts to the parent's text itself, and asks the server to splice
        the branches' KV into the parent's. We do not splice: KV computed for a branch sits at the
        branch's positions, so spliced KV would change the model's outputs. The parent's next
        request prefills the joined text instead, its shared prefix served by the radix cache."""
        return Response(status_code=200)


def _public(result: dict, with_prompt_ids: bool) -> dict:
    out = {k: v for k, v in result.items() if k not in ("finished", "prompt_token_ids")}
    return out | ({"prompt_token_ids": result["prompt_token_ids"]} if with_prompt_ids else {})


def _native_sse(first: tuple[int, dict[str, Any]] | None, chunks: Chunks, with_prompt_ids: bool,
                incremental: bool) -> AsyncIterator[str]:
    """SGLang's /generate stream. Each event carries the text and output_ids so far (with
    --incremental-streaming-output, only what is new since the last event) and, in meta_info,
    the logprob entries of its own tokens only (the prompt's once), as SGLang's frontend expects
    and joins them: the stream's bytes grow with its output, not with its square. completion_tokens
    and output_token_logprobs_length stay totals. An event whose text would be unchanged (a token
    that ends inside a character, a stop string held back) is held until the text grows or the
    request ends: SGLang's frontend refuses an event without new text, and the next one carries
    what was held."""
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    held: dict[int, JoinedPieces] = {}  # pieces not sent yet

    def event(i: int, chunk: dict) -> str | None:
        joined = held.pop(i, None)
        if joined is None:
            joined = JoinedPieces(chunk)
        else:
            joined.add(chunk)
        piece = joined.take()
        if not piece["text"] and not piece["finished"]:
            held[i] = joined
            return None
        text, out_ids = piece["text"], piece["output_ids"]
        if not incremental:
            texts[i] = text = texts.get(i, "") + text
            out_ids = ids.setdefault(i, [])
            out_ids += piece["output_ids"]
        out = {"text": text, "output_ids": out_ids, "meta_info": piece["meta_info"], "index": i}
        return sse(out | ({"prompt_token_ids": chunk["prompt_token_ids"]} if with_prompt_ids else {}))

    return sse_stream(first, chunks, event)
