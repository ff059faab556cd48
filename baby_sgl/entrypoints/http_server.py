"""The HTTP server: SGLang's native API (/generate, /health, ...) plus the OpenAI-compatible
routes from openai_api.py, over one Engine. Engine calls that wait on the scheduler run in a
worker thread so the event loop (and /health) stays responsive."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from baby_sgl.engine import Engine
from baby_sgl.entrypoints.async_bridge import stream_requests
from baby_sgl.entrypoints.metrics import Metrics
from baby_sgl.entrypoints.protocol import AbortRequest, GenerateRequest

logger = logging.getLogger(__name__)


def error_response(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "internal_error"
    if status == 404:
        kind = "not_found_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def create_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="baby-sgl")
    app.state.engine, app.state.metrics = engine, Metrics()
    app.state.model_name = os.path.basename(engine.model_path.rstrip("/"))
    _install_error_handlers(app)
    _add_native_routes(app)
    from baby_sgl.entrypoints.openai_api import add_openai_routes

    add_openai_routes(app)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        what = "malformed JSON" if first.get("type") == "json_invalid" else first.get("msg", "invalid request")
        return error_response(f"{what}" + (f" (field: {where})" if where else ""), 400, where or None)

    @app.exception_handler(ValueError)
    async def bad_value(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(str(exc), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)


def _native_items(body: GenerateRequest) -> tuple[list[dict], bool]:
    if (body.text is None) == (body.input_ids is None):
        raise ValueError("give exactly one of text or input_ids")
    if body.logprob_start_len not in (-1, None):
        raise ValueError("prompt logprobs (logprob_start_len >= 0) are not supported; output logprobs are")
    if body.session_params:
        raise ValueError("session_params are not supported by this server yet")
    single = isinstance(body.text, str) or (body.input_ids is not None and
                                            (not body.input_ids or isinstance(body.input_ids[0], int)))
    prompts = ([body.text] if single else body.text) if body.text is not None else \
        ([body.input_ids] if single else body.input_ids)
    params = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params] * len(prompts)
    rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(prompts)
    if len(params) != len(prompts) or len(rids) != len(prompts):
        raise ValueError("sampling_params and rid lists must have one entry per prompt")
    key = "prompt" if body.text is not None else "input_ids"
    items = [{key: p, "sampling_params": sp, "rid": r, "return_logprob": body.return_logprob,
              "top_logprobs_num": body.top_logprobs_num} for p, sp, r in zip(prompts, params, rids)]
    return items, single


def _add_native_routes(app: FastAPI) -> None:
    engine: Engine = app.state.engine
    metrics: Metrics = app.state.metrics

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        async for _ in stream_requests(engine, [{"input_ids": [0], "sampling_params": {"max_new_tokens": 1}}], False):
            pass
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict:
        return {"model_path": engine.model_path, "tokenizer_path": engine.model_path, "is_generation": True,
                "context_length": engine.context_len}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict:
        return await asyncio.to_thread(engine.get_server_info)

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        ok = await asyncio.to_thread(engine.flush_cache)
        if not ok:
            return error_response("cannot flush the cache while requests are running", 400)
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest) -> Response:
        engine.abort_request(body.rid)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        info = await asyncio.to_thread(engine.get_server_info)
        return Response(metrics.render(info), media_type="text/plain; version=0.0.4")

    @app.get("/debug/check_memory")
    async def check_memory() -> JSONResponse:
        try:
            return JSONResponse(await asyncio.to_thread(engine.check_memory))
        except AssertionError as e:
            return error_response(f"memory check failed: {e}", 500)

    @app.post("/generate")
    async def generate(body: GenerateRequest):
        items, single = _native_items(body)
        chunks = stream_requests(engine, items, body.stream, metrics.observe_finished)
        if body.stream:
            first = await _first(chunks)  # raises ValueError -> 400 before the stream starts
            return StreamingResponse(_native_sse(first, chunks), media_type="text/event-stream")
        results: dict[int, dict] = {}
        async for i, chunk in chunks:
            results[i] = chunk
        out = [{k: v for k, v in results[i].items() if k != "finished"} for i in sorted(results)]
        return out[0] if single and len(out) == 1 else out


async def _first(chunks: AsyncIterator) -> tuple | None:
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


async def _native_sse(first: tuple | None, chunks: AsyncIterator) -> AsyncIterator[str]:
    """SGLang streams the cumulative text and ids so far in every event."""
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}

    def event(i: int, chunk: dict) -> str:
        texts[i] = texts.get(i, "") + chunk["text"]
        ids[i] = ids.get(i, []) + chunk["output_ids"]
        return sse({"text": texts[i], "output_ids": ids[i], "meta_info": chunk["meta_info"], "index": i})

    try:
        if first is not None:
            yield event(*first)
        async for i, chunk in chunks:
            yield event(i, chunk)
        yield "data: [DONE]\n\n"
    finally:
        await chunks.aclose()


def launch_server(server_args) -> None:
    import uvicorn

    from baby_sgl.server_args import engine_kwargs

    engine = Engine(**engine_kwargs(server_args))
    app = create_app(engine)
    try:
        uvicorn.run(app, host=server_args.host, port=server_args.port, log_level=server_args.log_level,
                    timeout_keep_alive=5)
    finally:
        engine.shutdown()
