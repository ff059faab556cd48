"""The `baby-sgl` command: generate, demo, serve, chat, bench, tree."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from baby_sgl.distributed.processes import end_without_collecting
from baby_sgl.server_args import EngineArgs, engine_kwargs


def _generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from baby_sgl.engine import Engine

    prompts = list(args.prompt)
    if args.input_file:
        with open(args.input_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("give a prompt or --input-file", file=sys.stderr)
        return 2
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k}
    if args.seed is not None:
        params["seed"] = args.seed
    with Engine(**engine_kwargs(args)) as engine:
        ids = [engine.apply_chat_template([{"role": "user", "content": p}]) if args.chat else None for p in prompts]
        if len(prompts) == 1 and not args.json:  # one prompt: stream it to the terminal
            stream = engine.generate(input_ids=ids[0], sampling_params=params, stream=True) if args.chat else \
                engine.generate(prompts[0], params, stream=True)
            for chunk in stream:
                print(chunk["text"], end="", flush=True)
            print()
            return 0
        kw = {"input_ids": ids} if args.chat else {"prompt": prompts}
        texts, metas = [""] * len(prompts), [None] * len(prompts)
        # Streaming only to move the progress bar as requests finish; pieces are joined back.
        with tqdm(total=len(prompts), desc="generating", unit="req", disable=len(prompts) < 8) as bar:
            for chunk in engine.generate(sampling_params=params, stream=True, **kw):
                texts[chunk["index"]] += chunk["text"]
                if chunk.get("finished", True):
                    metas[chunk["index"]] = chunk["meta_info"]
                    bar.update(1)
        for p, text, meta in zip(prompts, texts, metas):
            print(json.dumps({"prompt": p, "text": text, "meta_info": meta}, ensure_ascii=False)
                  if args.json else f"{p}\n -> {text}\n")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from baby_sgl.demo import run_demo

    ok = run_demo(engine_kwargs(args), args.comprehensive, args.seed, args.max_new_tokens)
    return 0 if ok else 1


# Subcommands with parsers of their own: everything after the name is theirs.
_DELEGATED = {
    "serve": ("baby_sgl.launch_server", "start the HTTP server (SGLang and OpenAI APIs)"),
    "chat": ("baby_sgl.entrypoints.chat_cli", "interactive chat in the terminal"),
    "bench": ("baby_sgl.bench.cli", "benchmarks: bench offline | bench serving"),
    "tree": ("baby_sgl.entrypoints.tree_cli", "print a running server's radix tree"),
}


def _add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="warning", help="logging level: debug, info, warning or error "
                                                               "(default: warning)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baby-sgl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, help="what to run (each has its own --help)")
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompt", nargs="*", help="prompts (one request each)")
    gen.add_argument("--input-file", help="one prompt per line")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer at most (default: 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass (default: 1)")
    gen.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens; -1: all (default)")
    gen.add_argument("--seed", type=int, default=None, help="per-request sampling seed (same seed, same text)")
    gen.add_argument("--json", action="store_true", help="one JSON line per prompt")
    _add_log_level(gen)
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=_generate)
    demo = sub.add_parser("demo", help="a tour of the engine on the default model")
    from baby_sgl.demo import add_demo_args

    add_demo_args(demo)
    _add_log_level(demo)
    EngineArgs.add_cli_args(demo)
    demo.set_defaults(func=_demo)
    for name, (_, help_) in _DELEGATED.items():
        sub.add_parser(name, help=help_, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    end_without_collecting()
    if argv and argv[0] in _DELEGATED:
        import importlib

        return importlib.import_module(_DELEGATED[argv[0]][0]).main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "warning").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # bad flags or a missing model: say so plainly
        print(f"baby-sgl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
