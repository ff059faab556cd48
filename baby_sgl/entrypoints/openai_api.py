"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from baby_sgl.engine import Engine
from baby_sgl.entrypoints.async_bridge import stream_requests
from baby_sgl.entrypoints.http_server import _first, sse
from baby_sgl.entrypoints.protocol import ChatCompletionRequest, CompletionRequest


def _finish_reason(meta: dict) -> str | None:
    reason = meta.get("finish_reason")
    return None if reason is None else {"stop": "stop", "length": "length"}.get(reason["type"], "abort")


def _usage(metas: list[dict], n: int) -> dict:
    # A prompt sampled n times counts once, as OpenAI does.
    prompt = sum(m["prompt_tokens"] for m in metas[::n])
    completion = sum(m["completion_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _token_str(engine: Engine, token: int) -> str:
    return engine.tokenizer.decode([token])


def _chat_logprobs(engine: Engine, meta: dict, start: int) -> dict:
    tops = meta.get("output_top_logprobs") or [[]] * len(meta["output_token_logprobs"])
    content = []
    for (lp, tok, _), top in list(zip(meta["output_token_logprobs"], tops))[start:]:
        s = _token_str(engine, tok)
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                        "top_logprobs": [{"token": _token_str(engine, t), "logprob": v,
                                          "bytes": list(_token_str(engine, t).encode())} for v, t, _ in top]})
    return {"content": content}


def _completion_logprobs(engine: Engine, meta: dict, start: int) -> dict:
    tokens = meta["output_token_logprobs"][start:]
    tops = (meta.get("output_top_logprobs") or [[]] * len(meta["output_token_logprobs"]))[start:]
    return {"tokens": [_token_str(engine, t) for _, t, _ in tokens], "token_logprobs": [lp for lp, _, _ in tokens],
            "top_logprobs": [{_token_str(engine, t): v for v, t, _ in top} for top in tops], "text_offset": []}


def add_openai_routes(app: FastAPI) -> None:
    engine: Engine = app.state.engine
    metrics = app.state.metrics

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": app.state.model_name, "object": "model", "created": 0,
                                            "owned_by": "baby-sgl", "max_model_len": engine.context_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int) \
            else [body.prompt]
        top = body.logprobs or 0
        items = [{("prompt" if isinstance(p, str) else "input_ids"): p,
                  "sampling_params": body.sampling_params(16 if body.max_tokens is None else body.max_tokens)
                  | {"n": 1}, "return_logprob": body.logprobs is not None, "top_logprobs_num": top}
                 for p in prompts for _ in range(body.n)]
        return await _respond(app, items, body, "text_completion", len(prompts), body.n,
                              lambda meta, start: _completion_logprobs(engine, meta, start)
                              if body.logprobs is not None else None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        ids = engine.apply_chat_template(messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling_params(max_tokens) | {"n": 1}
        items = [{"input_ids": ids, "sampling_params": params, "return_logprob": body.logprobs,
                  "top_logprobs_num": body.top_logprobs or 0} for _ in range(body.n)]
        return await _respond(app, items, body, "chat.completion", 1, body.n,
                              lambda meta, start: _chat_logprobs(engine, meta, start) if body.logprobs else None)


async def _respond(app: FastAPI, items: list[dict], body, kind: str, num_prompts: int, n: int, logprobs):
    engine, metrics = app.state.engine, app.state.metrics
    rid, created = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "created": created, "model": body.model or app.state.model_name}
    chunks = stream_requests(engine, items, body.stream, metrics.observe_finished)
    if body.stream:
        first = await _first(chunks)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_openai_sse(first, chunks, head, kind, n, include_usage, logprobs),
                                 media_type="text/event-stream")
    finals: dict[int, dict] = {}
    async for i, chunk in chunks:
        finals[i] = chunk
    choices, metas = [], [finals[i]["meta_info"] for i in sorted(finals)]
    for i in sorted(finals):
        meta, text = finals[i]["meta_info"], finals[i]["text"]
        choice = {"index": i, "logprobs": logprobs(meta, 0), "finish_reason": _finish_reason(meta)}
        choice |= {"message": {"role": "assistant", "content": text}} if kind == "chat.completion" else {"text": text}
        choices.append(choice)
    return {**head, "object": kind, "choices": choices, "usage": _usage(metas, n)}


async def _openai_sse(first, chunks: AsyncIterator, head: dict, kind: str, n: int, include_usage: bool,
                      logprobs) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
    sent: dict[int, int] = {}  # tokens already reported per choice (for logprobs)
    metas: dict[int, dict] = {}

    def event(i: int, chunk: dict) -> str:
        meta = chunk["meta_info"]
        start, sent[i] = sent.get(i, 0), meta["completion_tokens"]
        choice = {"index": i, "logprobs": logprobs(meta, start), "finish_reason": _finish_reason(meta)}
        if kind == "chat.completion":
            delta = {"content": chunk["text"]} | ({"role": "assistant"} if start == 0 else {})
            choice["delta"] = delta
        else:
            choice["text"] = chunk["text"]
        if chunk["finished"]:
            metas[i] = meta
        return sse({**head, "object": obj, "choices": [choice]})

    try:
        if first is not None:
            yield event(*first)
        async for i, chunk in chunks:
            yield event(i, chunk)
        if include_usage:
            yield sse({**head, "object": obj, "choices": [], "usage": _usage([metas[i] for i in sorted(metas)], n)})
        yield "data: [DONE]\n\n"
    finally:
        await chunks.aclose()
