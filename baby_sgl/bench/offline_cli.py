"""`baby-sgl bench offline`'s command line: its options, parsed and checked before the engine (and
torch) is imported, so `--help` and a mistaken flag answer at once; offline.py runs what it asks."""

from __future__ import annotations

import argparse

from baby_sgl.bench.model_shapes import SHAPES
from baby_sgl.server_args import EngineArgs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="baby-sgl bench offline",
                                description="the engine in-process on a synthetic workload, against the machine's "
                                            "roofs and, with --compare, another engine")
    p.add_argument("--workload", choices=["random", "shared-prefix", "one-batch", "copy", "multi-turn"],
                   default="random",
                   help="random prompts, groups sharing a system prompt, one batch at once, chat tasks that copy "
                        "text (rewrite code, quote a passage, fill JSON from a document), or users asking the "
                        "same questions in chats of their own (default: random)")
    p.add_argument("--repeats", type=int, default=1, help="copy: times each task is asked (default: 1)")
    p.add_argument("--seed", type=int, default=1, help="seed of the prompts (default: 1)")
    p.add_argument("--num-prompts", type=int, default=64, help="random: prompts (default: 64)")
    p.add_argument("--input-min", type=int, default=32, help="random: shortest prompt, tokens (default: 32)")
    p.add_argument("--input-max", type=int, default=512, help="random: longest prompt, tokens (default: 512)")
    p.add_argument("--output-min", type=int, default=32, help="random: fewest output tokens (default: 32)")
    p.add_argument("--output-max", type=int, default=256, help="random: most output tokens (default: 256)")
    p.add_argument("--groups", type=int, default=8, help="shared-prefix: groups, one system prompt each (default: 8)")
    p.add_argument("--prompts-per-group", type=int, default=8, help="shared-prefix: prompts per group (default: 8)")
    p.add_argument("--system-len", type=int, default=1024, help="shared-prefix: system prompt tokens (default: 1024)")
    p.add_argument("--question-len", type=int, default=64, help="shared-prefix: question tokens (default: 64)")
    p.add_argument("--output-len", type=int, default=64,
                   help="shared-prefix, one-batch, copy, multi-turn: output tokens per prompt (default: 64)")
    p.add_argument("--batch", type=int, default=1, help="one-batch: prompts in the batch (default: 1)")
    p.add_argument("--input-len", type=int, default=128, help="one-batch: tokens per prompt (default: 128)")
    p.add_argument("--compare", nargs="+", default=[],
                   choices=["hf", "vllm", "llama.cpp", "float32", "bfloat16", "json-schema", "no-speculation",
                            "request-only-drafts", "kv-cache-dtypes", "deterministic"],
                   help="one or more of: hf: transformers on the same prompts; vllm, llama.cpp: that engine on the "
                        "same prompts (scripts/setup_peers.sh installs them; llama.cpp with its prompt-lookup "
                        "decoding when --speculative-algorithm is set); a dtype: baby-sgl in that dtype, with how "
                        "many greedy outputs match; json-schema: every request constrained to a JSON schema; "
                        "no-speculation: baby-sgl without --speculative-algorithm; request-only-drafts: with "
                        "drafts from each request's own text only; kv-cache-dtypes: baby-sgl with each other "
                        "--kv-cache-dtype (the tokens its pool holds in the same memory, and with --workload "
                        "one-batch the decode step); deterministic: baby-sgl with --enable-deterministic-inference "
                        "flipped (its cost)"),
    p.add_argument("--model-shape", choices=sorted(SHAPES), default=None,
                   help="instead of --model-path: random weights in that real model's shape, built once into the "
                        "cache (a Q4_0 GGUF for baby-sgl and llama.cpp, the same weights as a Hugging Face "
                        "bfloat16 directory for vLLM and transformers)")
    p.add_argument("--beside-busy-core", action="store_true",
                   help="run the workload again beside a process that keeps one core busy; print its slowdown")
    p.add_argument("--beside-engine", action="store_true",
                   help="run the workload again beside a second engine process on the same cores that serves the "
                        "same workload without pause; print the slowdown")
    p.add_argument("--lora", action="store_true",
                   help="run the workload again with its prompts spread over --lora-adapters random LoRA adapters "
                        "of rank --lora-rank (mixed in every batch): the speed against the base model's, each "
                        "adapter's load time and size")
    p.add_argument("--lora-adapters", type=int, default=8, help="--lora: adapters (default: 8)")
    p.add_argument("--lora-rank", type=int, default=16, help="--lora: their rank (default: 16)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run baby-sgl and each --compare row this many times, alternating (baby-sgl, each "
                        "comparison, baby-sgl again, ...), and report each figure as the median of its rounds with "
                        "every round's own ratio: on a busy or shared machine one round's ratio can move by a "
                        "quarter (default: 1; an odd number keeps the medians actual rounds')")
    p.add_argument("--output-file", default=None, help="append the results as one JSON line")
    EngineArgs.add_cli_args(p)
    return p


def main(argv: list[str]) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if "json-schema" in args.compare and args.workload == "one-batch":
        p.error("--compare json-schema runs the other workloads")
    if {"no-speculation", "request-only-drafts"} & set(args.compare) and not args.speculative_algorithm:
        p.error("--compare no-speculation / request-only-drafts need --speculative-algorithm")
    if args.model_shape and args.model_path:
        p.error("--model-shape brings its own model: leave out --model-path")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    from baby_sgl.bench.offline import run_bench

    return run_bench(args)
