"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from baby_sgl.core.finish_reason import FinishAbort, FinishLength, FinishReason
from baby_sgl.engine import Engine
from baby_sgl.entrypoints.lora_api import adapter_of_model
from baby_sgl.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from baby_sgl.core.sampling_params import GRAMMAR_KINDS
from baby_sgl.entrypoints.chat import ChatReader, Reasoning, prepare
from baby_sgl.entrypoints.tool_parsers import CallArgs, CallStart, Content
from baby_sgl.entrypoints.responses import Chunks, first_item, sse, sse_stream


def _finish_reason(meta: dict) -> str | None:
    reason = FinishReason.from_json(meta.get("finish_reason"))
    if reason is None:
        return None
    return "length" if isinstance(reason, FinishLength) else "abort" if isinstance(reason, FinishAbort) else "stop"


def _usage(metas: list[dict], n: int) -> dict:
    # A prompt sampled n times counts once, as OpenAI does.
    prompt = sum(m["prompt_tokens"] for m in metas[::n])
    completion = sum(m["completion_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _chat_logprobs(engine: Engine, meta: dict) -> dict:
    """OpenAI's chat logprobs of the output tokens in meta (a streamed piece's own)."""
    tops = meta.get("output_top_logprobs") or [[]] * len(meta["output_token_logprobs"])
    content = []
    for (lp, tok, _), top in zip(meta["output_token_logprobs"], tops):
        s = engine.token_text(tok)
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                        "top_logprobs": [{"token": engine.token_text(t), "logprob": v,
                                          "bytes": list(engine.token_text(t).encode())} for v, t, _ in top]})
    return {"content": content}


class _CompletionLogprobs:
    """OpenAI's completion logprobs of the output tokens in meta (a streamed piece's own), per
    choice; with echo, the prompt's come first where meta carries them (the first piece), the
    first prompt token's logprob null. text_offset: where each token's text starts in the
    choice's text (the echoed prompt included), counting token texts as vLLM does."""

    def __init__(self, engine: Engine, echo: bool) -> None:
        self.engine, self.echo = engine, echo
        self.ends: dict[int, int] = {}  # choice -> length of the token texts it reported

    def __call__(self, i: int, meta: dict) -> dict:
        tokens = list(meta["output_token_logprobs"])
        tops = meta.get("output_top_logprobs") or [[]] * len(tokens)
        if self.echo and "input_token_logprobs" in meta:
            prompt = meta["input_token_logprobs"]
            tokens, tops = prompt + tokens, (meta.get("input_top_logprobs") or [None] * len(prompt)) + tops
        texts = [self.engine.token_text(t) for _, t, _ in tokens]
        offsets = list(itertools.accumulate(map(len, texts), initial=self.ends.get(i, 0)))
        self.ends[i] = offsets[-1]
        return {"tokens": texts, "token_logprobs": [lp for lp, _, _ in tokens],
                "top_logprobs": [None if top is None else {self.engine.token_text(t): v for v, t, _ in top}
                                 for top in tops],
                "text_offset": offsets[:-1]}


def _copies(item: dict, n: int) -> list[dict]:
    """n choices as n engine requests. With a seed, choice k draws from seed + k: OpenAI gives
    different choices for one seeded request, and choice 0 still equals the n=1 answer."""
    seed = item["sampling_params"].get("seed")
    if seed is None:
        return [item] * n
    return [item | {"sampling_params": item["sampling_params"] | {"seed": _wrap_int64(seed + k)}} for k in range(n)]


def _wrap_int64(x: int) -> int:
    return (x + 2**63) % 2**64 - 2**63


def add_openai_routes(app: FastAPI) -> None:
    engine: Engine = app.state.engine
    created = int(time.time())  # the model's card: when this server started serving it

    @app.get("/v1/models")
    async def models() -> dict:
        base = {"id": app.state.model_name, "object": "model", "created": created, "owned_by": "baby-sgl",
                "max_model_len": engine.context_len}
        adapters = [base | {"id": r.lora_name, "root": r.lora_path, "parent": app.state.model_name}
                    for r in engine.lora_adapters()]
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = _prompt_list(body.prompt)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
        echo_logprobs = body.echo and body.logprobs is not None
        items = [item for p in prompts for item in _copies({
            ("prompt" if isinstance(p, str) else "input_ids"): p, "sampling_params": body.sampling_params(max_tokens),
            "return_logprob": body.logprobs is not None, "top_logprobs_num": body.logprobs or 0,
            "logprob_start_len": 0 if echo_logprobs else -1, "lora_path": adapter_of_model(engine, body.model)}, body.n)]
        logprobs = _CompletionLogprobs(engine, body.echo) if body.logprobs is not None else _no_logprobs
        echoed = None
        if body.echo:  # each choice's text starts with its prompt
            texts = [p if isinstance(p, str) else await asyncio.to_thread(_decode, engine, p) for p in prompts]
            echoed = [t for t in texts for _ in range(body.n)]
        return await _respond(app, request, items, body, "text_completion", logprobs, echoed)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling_params(max_tokens)
        constraint = {kind: params.pop(kind) for kind in GRAMMAR_KINDS if kind in params}
        # On the bounded pool: the history's tool-call arguments are parsed, and may be megabytes.
        turn = await app.state.async_engine.off_loop(
            1, lambda: prepare(engine, app.state.server_settings, body.chat_request(constraint)))
        item = {"input_ids": turn.input_ids, "sampling_params": params | turn.constraint,
                "server_grammar": turn.server_grammar, "lora_path": adapter_of_model(engine, body.model),
                "return_logprob": body.logprobs, "top_logprobs_num": body.top_logprobs or 0}
        logprobs = (lambda _, meta: _chat_logprobs(engine, meta)) if body.logprobs else _no_logprobs
        reader = turn.reader if turn.starts_inside is not None or turn.tool_format else None
        return await _respond(app, request, _copies(item, body.n), body, "chat.completion", logprobs,
                              reader=reader, reasoning=turn.starts_inside is not None)


# The logprobs of a choice's piece or whole answer: (choice index, meta_info) -> OpenAI's logprobs object.
Logprobs = Callable[[int, dict], dict | None]


def _no_logprobs(_: int, __: dict) -> None:
    return None


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _chat_finish(meta: dict, called: bool, cut: bool) -> str | None:
    """called: the choice made calls; cut: it ended inside one (stop strings, max_tokens)."""
    reason = _finish_reason(meta)
    return "tool_calls" if called and not cut and reason == "stop" else reason


async def _respond(app: FastAPI, request: Request, items: list[dict], body, kind: str, logprobs: Logprobs,
                   echoed: list[str] | None = None, reader: Callable[[bool], ChatReader] | None = None,
                   reasoning: bool = False):
    """reader: a reader of each choice's output (reasoning and tool calls), given whether it
    streams; reasoning: the message has reasoning_content."""
    rid, created = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "created": created, "model": body.model or app.state.model_name}
    chunks = app.state.async_engine.generate(items, body.stream, request.is_disconnected)
    if body.stream:
        first = await first_item(chunks)  # raises ValueError -> 400 before the stream starts
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chat = None if reader is None else (reader, body.stream_reasoning)
        return StreamingResponse(_openai_sse(first, chunks, head, kind, body.n, include_usage, logprobs, echoed,
                                             chat), media_type="text/event-stream")
    finals = {i: chunk async for i, chunk in chunks}
    if await request.is_disconnected():
        return Response(status_code=499)  # nobody to answer; the requests were aborted

    # Off the event loop: the choices' logprobs (a token text and a top list a token) and the JSON
    # of them can take seconds for long outputs.
    def response_body() -> str:
        choices, metas = [], [finals[i]["meta_info"] for i in sorted(finals)]
        for i in sorted(finals):
            meta, text = finals[i]["meta_info"], (echoed[i] if echoed else "") + finals[i]["text"]
            choice = {"index": i, "logprobs": logprobs(i, meta), "finish_reason": _finish_reason(meta)}
            if kind != "chat.completion":
                choice["text"] = text
            elif reader is None:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice_reader = reader(False)
                thought, answer, calls = choice_reader.read(text)
                message: dict[str, Any] = {"role": "assistant", "content": answer or (None if calls else "")}
                if reasoning:
                    message["reasoning_content"] = thought or None
                if calls:
                    message["tool_calls"] = [{"id": _call_id(), "type": "function",
                                              "function": {"name": name, "arguments": args}} for name, args in calls]
                choice["message"], choice["finish_reason"] = message, _chat_finish(meta, bool(calls), choice_reader.cut)
            choices.append(choice)
        return json.dumps({**head, "object": kind, "choices": choices, "usage": _usage(metas, body.n)},
                          ensure_ascii=False, allow_nan=False)

    return Response(await asyncio.to_thread(response_body), media_type="application/json")


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's `prompt`: one text or token list, or a batch of them."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return cast("list[str | list[int]]", list(prompt))
    return [cast("str | list[int]", prompt)]


def _decode(engine: Engine, ids: list[int]) -> str:
    text = engine.tokenizer.decode(ids)
    assert isinstance(text, str)
    return text


def _openai_sse(first: tuple[int, dict[str, Any]] | None, chunks: Chunks, head: dict[str, Any], kind: str, n: int,
                include_usage: bool, logprobs: Logprobs, echoed: list[str] | None,
                chat: tuple[Callable[[bool], ChatReader], bool] | None = None) -> AsyncIterator[str]:
    """chat: (a reader per choice, whether the reasoning streams as it comes)."""
    obj = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
    sent: dict[int, int] = {}  # tokens already reported per choice (none: its first piece is next)
    metas: dict[int, dict] = {}
    readers: dict[int, ChatReader] = {}
    held: dict[int, list[str]] = {}  # reasoning kept for the last piece (stream_reasoning false), in pieces
    called: set[int] = set()  # choices that made tool calls

    def chat_delta(i: int, chunk: dict) -> dict[str, Any]:
        if chat is None:
            return {"content": chunk["text"]}
        reader = readers.setdefault(i, chat[0](True))
        events = reader.feed(chunk["text"]) + (reader.flush() if chunk["finished"] else [])
        thought = "".join(e.text for e in events if isinstance(e, Reasoning))
        answer = "".join(e.text for e in events if isinstance(e, Content))
        if not chat[1]:
            held.setdefault(i, []).append(thought)
            thought = "".join(held.pop(i)) if chunk["finished"] else ""
        calls: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, CallStart):
                called.add(i)
                calls.append({"index": e.index, "id": _call_id(), "type": "function",
                              "function": {"name": e.name, "arguments": ""}})
            elif isinstance(e, CallArgs):
                if calls and calls[-1]["index"] == e.index:
                    calls[-1]["function"]["arguments"] += e.fragment
                else:
                    calls.append({"index": e.index, "function": {"arguments": e.fragment}})
        delta: dict[str, Any] = {"content": answer} if answer or not calls else {}
        return delta | ({"reasoning_content": thought} if thought else {}) | ({"tool_calls": calls} if calls else {})

    def event(i: int, chunk: dict) -> str:
        meta = chunk["meta_info"]
        start, sent[i] = sent.get(i, 0), meta["completion_tokens"]
        choice = {"index": i, "logprobs": logprobs(i, meta), "finish_reason": _finish_reason(meta)}
        if kind == "chat.completion":
            choice["delta"] = chat_delta(i, chunk) | ({"role": "assistant"} if start == 0 else {})
            choice["finish_reason"] = _chat_finish(meta, i in called, i in readers and readers[i].cut)
        else:  # echo: the prompt comes with the first piece
            choice["text"] = (echoed[i] if echoed and start == 0 else "") + chunk["text"]
        if chunk["finished"]:
            metas[i] = meta
        return sse({**head, "object": obj, "choices": [choice]})

    def usage() -> list[str]:
        return [sse({**head, "object": obj, "choices": [], "usage": _usage([metas[i] for i in sorted(metas)], n)})
                ] if include_usage else []

    return sse_stream(first, chunks, event, usage)
