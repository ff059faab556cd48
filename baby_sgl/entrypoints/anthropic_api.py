"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, for the agents and
SDKs that speak it. A request becomes the same chat turn as OpenAI's (chat.py): its system prompt,
text, tool_use and tool_result blocks become messages, its tools and tool_choice the same tools
(`any` is OpenAI's `required`); the answer comes back as thinking, text and tool_use blocks, whole
or as Anthropic's stream of events. A last assistant message is a prefill: the answer continues
its text (the reply holds only what follows). Errors have Anthropic's shape (responses.py)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field

from baby_sgl.core.finish_reason import FinishLength, FinishMatched, FinishReason
from baby_sgl.engine import Engine
from baby_sgl.entrypoints.lora_api import adapter_of_model
from baby_sgl.entrypoints.chat import ChatEvent, ChatReader, ChatRequest, NamedTool, Reasoning, ToolChoice, prepare
from baby_sgl.entrypoints.protocol import MAX_MESSAGES, MAX_TOOLS, JsonObject
from baby_sgl.entrypoints.responses import Chunks, first_item, sse_stream
from baby_sgl.entrypoints.tool_grammar import Tool
from baby_sgl.entrypoints.tool_parsers import CallArgs, CallStart, Content
from baby_sgl.core.sampling_params import StopString
from baby_sgl.validation import MAX_ID_LEN, MAX_STOP, Id, StrictModel, Text

ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")]
CacheControl = dict[str, Any] | None  # prompt caching hints: the radix cache needs none


class TextBlock(StrictModel):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl = None
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: Id
    name: ToolName
    input: JsonObject
    cache_control: CacheControl = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: Id
    content: Text | Annotated[list[TextBlock], Field(max_length=MAX_MESSAGES)] | None = None
    is_error: bool | None = None
    cache_control: CacheControl = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None


class ImageBlock(StrictModel):
    """Read as Anthropic's schema has it only to be refused by name: the models served read text."""
    type: Literal["image"]
    source: dict[str, Any]
    cache_control: CacheControl = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | ImageBlock, Field(discriminator="type")]


class MessageParam(StrictModel):
    role: Literal["user", "assistant"]
    content: Text | Annotated[list[Block], Field(max_length=MAX_MESSAGES)]


class ToolParam(StrictModel):
    name: ToolName
    description: Text | None = None
    input_schema: JsonObject
    type: Literal["custom"] | None = None
    cache_control: CacheControl = None


class ToolChoiceParam(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: ToolName | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(StrictModel):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=0)


class _Conversation(StrictModel):
    model: Annotated[Text, Field(max_length=MAX_ID_LEN)]
    messages: list[MessageParam] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Text | Annotated[list[TextBlock], Field(max_length=MAX_MESSAGES)] | None = None
    tools: Annotated[list[ToolParam], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingConfig | None = None  # with a thinking template: enable_thinking

    def chat_request(self) -> ChatRequest:
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)
            messages.append({"role": "system", "content": system})
        *turns, last = self.messages
        prefill = _prefill(last) if last.role == "assistant" else ""
        for m in turns if last.role == "assistant" else self.messages:
            messages += _openai_messages(m)
        tools = [Tool(t.name, t.description, t.input_schema) for t in self.tools or []]
        if len({t.name for t in tools}) < len(tools):
            raise ValueError("tools: two tools have the same name")
        choice = self.tool_choice or ToolChoiceParam(type="auto" if tools else "none")
        modes: dict[str, ToolChoice] = {"auto": "auto", "any": "required", "none": "none"}
        if choice.type == "tool":
            if choice.name is None:
                raise ValueError("tool_choice of type tool needs the tool's name")
            mode: ToolChoice = NamedTool(choice.name)
        else:
            mode = modes[choice.type]
        if mode not in ("none", "auto") and not tools:
            raise ValueError(f"tool_choice {choice.type} needs tools")
        kwargs = None if self.thinking is None else {"enable_thinking": self.thinking.type == "enabled"}
        return ChatRequest(messages, tools, mode, not choice.disable_parallel_tool_use, kwargs, prefill=prefill)


def _prefill(m: MessageParam) -> str:
    """A last assistant message's text, which the answer continues (as Anthropic's API does, it may
    not end in white space: the answer's first token would be a guess across it)."""
    if not isinstance(m.content, str) and not all(isinstance(b, TextBlock) for b in m.content):
        raise ValueError("a last assistant message (a prefill) holds text blocks only")
    text = m.content if isinstance(m.content, str) else "".join(b.text for b in m.content if isinstance(b, TextBlock))
    if text != text.rstrip():
        raise ValueError("final assistant content cannot end with trailing whitespace")
    return text


def _openai_messages(m: MessageParam) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI-shaped chat messages: tool results first (each its own
    `tool` message), then the text; an assistant's tool_use blocks as its tool calls."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    if any(isinstance(b, ImageBlock) for b in m.content):
        raise ValueError("messages: an image block is not supported: this model reads text only")
    out: list[dict[str, Any]] = []
    text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
    if m.role == "user":
        if any(isinstance(b, ToolUseBlock | ThinkingBlock) for b in m.content):
            raise ValueError("a user message holds text and tool_result blocks only")
        out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                for b in m.content if isinstance(b, ToolResultBlock)]
        if text or not out:
            out.append({"role": "user", "content": text})
        return out
    if any(isinstance(b, ToolResultBlock) for b in m.content):
        raise ValueError("an assistant message cannot hold tool_result blocks")
    message: dict[str, Any] = {"role": "assistant", "content": text}
    thinking = "".join(b.thinking for b in m.content if isinstance(b, ThinkingBlock))
    if thinking:
        message["reasoning_content"] = thinking
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
             for b in m.content if isinstance(b, ToolUseBlock)]
    return [message | ({"tool_calls": calls} if calls else {})]


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1, le=2**31 - 1)
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=2**31 - 1)
    metadata: dict[str, Any] | None = None  # user_id: nothing to do with it
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here
    cache_control: CacheControl = None  # the radix cache reuses prefixes anyway

    def sampling_params(self) -> dict[str, Any]:
        params = {"max_new_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "top_k": self.top_k or None, "stop": self.stop_sequences}
        return {k: v for k, v in params.items() if v is not None}


class CountTokensRequest(_Conversation):
    pass


def add_anthropic_routes(app: FastAPI) -> None:
    engine: Engine = app.state.engine
    aengine = app.state.async_engine

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict:
        turn = await aengine.off_loop(1, lambda: prepare(engine, app.state.server_settings, body.chat_request()))
        return {"input_tokens": len(turn.input_ids)}

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        turn = await aengine.off_loop(1, lambda: prepare(engine, app.state.server_settings, body.chat_request()))
        item = {"input_ids": turn.input_ids, "sampling_params": body.sampling_params() | turn.constraint,
                "server_grammar": turn.server_grammar, "lora_path": adapter_of_model(engine, body.model)}
        chunks = app.state.async_engine.generate([item], body.stream, request.is_disconnected)
        head = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": body.model}
        stops = set(body.stop_sequences or [])
        if body.stream:
            first = await first_item(chunks)  # raises ValueError -> 400 before the stream starts
            return StreamingResponse(_stream(first, chunks, head, turn.reader(stream=True), stops),
                                     media_type="text/event-stream")
        finals = [chunk async for _, chunk in chunks]
        if await request.is_disconnected():
            return Response(status_code=499)

        # Off the event loop, as the OpenAI routes do: reading a long output into blocks (reasoning,
        # tool calls) and its JSON can take seconds. JSONResponse renders its body when built.
        def reply() -> JSONResponse:
            reader, blocks = turn.reader(stream=False), _Blocks()
            blocks.add(reader.feed(finals[0]["text"]) + reader.flush())
            blocks.close()
            ending = _ending(finals[0]["meta_info"], stops, blocks.called)
            return JSONResponse(head | {"content": blocks.blocks} | ending)

        return await asyncio.to_thread(reply)


class _Blocks:
    """A reply's events as Anthropic content blocks, in order: a block opens where the kind
    (thinking, text, tool_use) changes. It keeps the blocks (the whole reply) and says what each
    step changed as Anthropic's stream events, so both forms hold the same blocks."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.open = False
        self.called = False
        # The open block's text (thinking, text) or arguments (tool_use) so far, in pieces: joined
        # when it closes (adding to one string copied it at every piece).
        self._parts: list[str] = []

    def add(self, events: list[ChatEvent]) -> list[str]:
        out: list[str] = []
        for e in events:
            if isinstance(e, Reasoning | Content):
                kind, key = ("thinking", "thinking") if isinstance(e, Reasoning) else ("text", "text")
                if not (self.open and self.blocks[-1]["type"] == kind):
                    out += self._start({"type": kind, key: ""} | ({"signature": ""} if kind == "thinking" else {}))
                self._parts.append(e.text)
                out.append(self._delta({"type": f"{kind}_delta", key: e.text}))
            elif isinstance(e, CallStart):
                self.called = True
                out += self._start({"type": "tool_use", "id": _tool_id(), "name": e.name, "input": {}})
            elif isinstance(e, CallArgs):
                self._parts.append(e.fragment)
                out.append(self._delta({"type": "input_json_delta", "partial_json": e.fragment}))
        return out

    def close(self) -> list[str]:
        if not self.open:
            return []
        self.open = False
        block, text = self.blocks[-1], "".join(self._parts)
        self._parts = []
        if block["type"] == "tool_use":
            block["input"] = _input(text)
        else:
            block[block["type"]] = text  # the thinking or text block's own key
        return [_event("content_block_stop", {"index": len(self.blocks) - 1})]

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.blocks.append(block)
        self.open = True
        return out + [_event("content_block_start", {"index": len(self.blocks) - 1, "content_block": dict(block)})]

    def _delta(self, payload: dict[str, Any]) -> str:
        return _event("content_block_delta", {"index": len(self.blocks) - 1, "delta": payload})


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use input (an object; arguments cut short give what parses)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def _ending(meta: dict[str, Any], stops: set[str], called: bool) -> dict[str, Any]:
    """stop_reason, stop_sequence and usage of a finished answer."""
    reason = FinishReason.from_json(meta.get("finish_reason"))
    if isinstance(reason, FinishLength):
        stop_reason, sequence = "max_tokens", None
    elif isinstance(reason, FinishMatched) and reason.matched in stops:
        stop_reason, sequence = "stop_sequence", reason.matched
    else:
        stop_reason, sequence = ("tool_use" if called else "end_turn"), None
    return {"stop_reason": stop_reason, "stop_sequence": sequence,
            "usage": {"input_tokens": meta["prompt_tokens"], "output_tokens": meta["completion_tokens"],
                      "cache_read_input_tokens": meta.get("cached_tokens", 0)}}


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind} | data, ensure_ascii=False)}\n\n"


def _stream(first, chunks: Chunks, head: dict[str, Any], reader: ChatReader, stops: set[str]) -> AsyncIterator[str]:
    """Anthropic's events: message_start (and a ping), each content block's content_block_start,
    deltas and content_block_stop, then message_delta (stop_reason, usage) and message_stop."""
    blocks, started = _Blocks(), False

    def event(_: int, chunk: dict[str, Any]) -> str | None:
        nonlocal started
        meta = chunk["meta_info"]
        out = []
        if not started:
            started = True
            usage = {"input_tokens": meta["prompt_tokens"], "output_tokens": 0}
            out.append(_event("message_start", {"message": head | {"content": [], "stop_reason": None,
                                                                   "stop_sequence": None, "usage": usage}}))
            out.append(_event("ping", {}))
        out += blocks.add(reader.feed(chunk["text"]) + (reader.flush() if chunk["finished"] else []))
        if chunk["finished"]:
            out += blocks.close()
            ending = _ending(meta, stops, blocks.called)
            out.append(_event("message_delta", {"delta": {"stop_reason": ending["stop_reason"],
                                                          "stop_sequence": ending["stop_sequence"]},
                                                "usage": {"output_tokens": meta["completion_tokens"]}}))
            out.append(_event("message_stop", {}))
        return "".join(out) or None

    return sse_stream(first, chunks, event, done="")
