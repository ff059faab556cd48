"""`baby-sgl chat`: an interactive terminal chat that streams tokens, against a local engine
(any Engine flag) or a running server (--base-url, OpenAI chat API)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from baby_sgl.server_args import EngineArgs, engine_kwargs

if TYPE_CHECKING:  # the engine (and torch) load only when chatting locally
    from baby_sgl.engine import Engine


def _local_stream(engine: Engine, messages: list[dict], max_tokens: int, temperature: float) -> Iterator[str]:
    for chunk in engine.chat(messages, {"max_new_tokens": max_tokens, "temperature": temperature}, stream=True):
        yield chunk["text"]


def _remote_stream(base_url: str, model: str, messages: list[dict], max_tokens: int,
                   temperature: float) -> Iterator[str]:
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True}
    with httpx.stream("POST", base_url.rstrip("/") + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                if choices:
                    yield choices[0]["delta"].get("content") or ""


def _print_reply(stream: Iterator[str]) -> str | None:
    """Prints the reply as it streams. Ctrl-C stops the reply, not the chat (closing the
    stream aborts the request); an error is shown and the turn is dropped (None)."""
    print("assistant> ", end="", flush=True)
    reply = ""
    try:
        for piece in stream:
            reply += piece
            print(piece, end="", flush=True)
    except KeyboardInterrupt:
        print(" [interrupted]", end="")
    except Exception as e:  # a server that went away or refused the request
        print(f"\n[error: {e}]", file=sys.stderr)
        return None
    finally:
        if hasattr(stream, "close"):
            stream.close()
    print()
    return reply


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="baby-sgl chat", description="interactive chat in the terminal")
    p.add_argument("--base-url", default=None, help="talk to a running server instead of a local engine")
    p.add_argument("--model", default="default", help="model name sent to the server (with --base-url)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest reply, in tokens (default: 256)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default: 0.7)")
    EngineArgs.add_cli_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    engine = None
    if not args.base_url:
        from baby_sgl.engine import Engine

        engine = Engine(**engine_kwargs(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("baby-sgl chat: type a message, /reset to start over, /exit or Ctrl-D to leave.", file=sys.stderr)
    try:
        while True:
            try:
                line = input("you> ").strip()
            except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: leave
                print(file=sys.stderr)
                break
            if line in ("/exit", "/quit"):
                break
            if line == "/reset":
                messages = messages[:1] if args.system else []
                continue
            if not line:
                continue
            messages.append({"role": "user", "content": line})
            stream = _remote_stream(args.base_url, args.model, messages, args.max_new_tokens, args.temperature) \
                if engine is None else _local_stream(engine, messages, args.max_new_tokens, args.temperature)
            reply = _print_reply(stream)
            if reply is None:
                messages.pop()  # the turn failed; let the user try again
            else:
                messages.append({"role": "assistant", "content": reply})
    finally:
        if engine is not None:
            engine.shutdown()
    return 0
