"""The routes' class (FastAPI's APIRoute, extended): a body's token-id prompts (`input_ids`,
OpenAI's `prompt`) longer than the context are refused by their length before the body is
validated, so a body of millions of ids costs a JSON parse, not the validation of every id on
the event loop as well."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

PROMPT_FIELDS = ("input_ids", "prompt")


class PromptBoundRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def bounded(request: Request) -> Response:
            if request.method in ("POST", "PUT") and await request.body():
                try:
                    body = await request.json()  # kept: FastAPI parses it once
                except ValueError:
                    body = None  # FastAPI reports it
                except RecursionError:  # json's decoder recurses per level: a 400, not a 500 and a traceback
                    raise ValueError("the request body's JSON is nested too deeply") from None
                if isinstance(body, dict):
                    check_prompt_lengths(body, request.app.state.engine.context_len)
            return await handle(request)

        return bounded


def check_prompt_lengths(body: dict[str, Any], context_len: int) -> None:
    """Raises ValueError naming the first token-id list of a prompt field (one, or one of a
    batch) that holds more ids than the context."""
    for name in PROMPT_FIELDS:
        value = body.get(name)
        if not isinstance(value, list):
            continue
        lists = [value] if _is_ids(value) else [v for v in value if isinstance(v, list) and _is_ids(v)]
        for ids in lists:
            if len(ids) > context_len:
                raise ValueError(f"prompt is too long: {name} holds {len(ids)} token ids, more than the context "
                                 f"length {context_len}")


def _is_ids(value: list[Any]) -> bool:
    return bool(value) and isinstance(value[0], int) and not isinstance(value[0], bool)


