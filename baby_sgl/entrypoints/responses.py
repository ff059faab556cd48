"""Response helpers shared by the native and OpenAI routes: error bodies and SSE framing."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi.responses import JSONResponse

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
                413: "invalid_request_error", 415: "invalid_request_error", 503: "service_unavailable"}


# Anthropic's error types by status (its clients pick their exception by status and type)
_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
ANTHROPIC_PREFIX = "/v1/messages"


def error_response(message: str, status: int = 400, param: str | None = None,
                   headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    """OpenAI's error body, used by every route so clients handle one shape; Anthropic's on the
    routes of its Messages API."""
    if path.startswith(ANTHROPIC_PREFIX):
        return JSONResponse(anthropic_error(message, status), status, headers=headers)
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status,
                        headers=headers)


def anthropic_error(message: str, status: int) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
# What AsyncEngine.generate yields: (index, chunk) pairs.
Chunks = AsyncGenerator[tuple[int, dict[str, Any]], None]


async def sse_stream(first: tuple[int, dict[str, Any]] | None, chunks: Chunks, event: Callable[[int, dict], str | None],
                     trailer: Callable[[], list[str]] = list, done: str = SSE_DONE) -> AsyncIterator[str]:
    """The body of a streamed response over (index, chunk) pairs, `first` (already awaited) and
    then the rest: event(i, chunk) per chunk (None: nothing for it), the trailer's events, then
    `done`. Closing it early (the client gone) closes chunks, which aborts their requests."""
    try:
        for i, chunk in [first] if first is not None else []:
            if (ev := event(i, chunk)) is not None:
                yield ev
        async for i, chunk in chunks:
            if (ev := event(i, chunk)) is not None:
                yield ev
        for ev in trailer():
            yield ev
        if done:
            yield done
    finally:
        await chunks.aclose()


async def first_item(items: Chunks) -> tuple[int, dict[str, Any]] | None:
    """Waits for the first item before the response starts, so bad input still gets a 400
    rather than an error in the middle of a 200 stream."""
    try:
        return await items.__anext__()
    except StopAsyncIteration:
        return None
