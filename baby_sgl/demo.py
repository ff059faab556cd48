"""The demo: a tour of the engine on the default model (`baby-sgl demo`, `python run_demo.py`)."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine (torch, transformers: ~5 s) is imported when the demo runs, not for --help
    from baby_sgl.engine import Engine

ENGLISH = [
    "Summarize the key benefits of unit testing in software engineering.",
    "Explain the concept of attention in transformer models.",
    "Draft a short professional email requesting a project status update.",
    "Give three tips to improve public speaking.",
]
CHINESE = ["用中文介绍一下量子计算的基本原理。", "给出三条关于上海旅游的建议。"]
SYSTEM = ("You are a meticulous travel assistant. Always answer in one short paragraph, mention the best "
          "season to visit, one local dish, and one thing to avoid. Be friendly and precise.")
CITIES = ["Paris", "Tokyo", "Lisbon", "Cairo"]


def _chat_ids(engine: Engine, question: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return engine.apply_chat_template(messages)


def _section(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 60 - len(title)))


def _start(engine_kwargs: dict) -> tuple[Engine, dict]:
    """An engine with --enable-deterministic-inference on where the engine takes it (it refuses
    it, by name, where the CPU's one-call step does not run), and the settings it took. Without
    it the radix cache changes which batches a prompt's tokens are computed in, and in bfloat16
    that moves logits by a rounding, enough to part greedy outputs at near-ties."""
    from baby_sgl.engine import Engine

    if engine_kwargs["enable_deterministic_inference"]:
        return Engine(**engine_kwargs), engine_kwargs
    deterministic = {**engine_kwargs, "enable_deterministic_inference": True}
    try:
        return Engine(**deterministic), deterministic
    except ValueError as e:
        if "--enable-deterministic-inference" not in str(e):
            raise
        return Engine(**engine_kwargs), engine_kwargs


def run_demo(engine_kwargs: dict, comprehensive: bool, seed: int, max_new_tokens: int) -> bool:
    from baby_sgl.engine import Engine

    ok = True
    engine, engine_kwargs = _start(engine_kwargs)
    with engine:
        print(f"model: {engine.model_path}")
        if engine_kwargs["enable_deterministic_inference"]:
            print("deterministic inference: on (a request's outputs do not depend on its batch or the cache)")
        _section("single prompt")
        out = engine.chat([{"role": "user", "content": "Hello, how are you?"}], {"max_new_tokens": max_new_tokens, "temperature": 0})
        print(f"Hello, how are you? -> {out['text']!r}")

        _section("empty input")
        try:
            engine.generate("", {"max_new_tokens": 4})
            print("accepted an empty prompt (unexpected)")
            ok = False
        except ValueError as e:
            print(f"refused as expected: {e}")
        if not comprehensive:
            return ok

        prompts = [_chat_ids(engine, q) for q in ENGLISH + CHINESE]
        _section("greedy batch")
        greedy = {"max_new_tokens": max_new_tokens, "temperature": 0}
        t0 = time.perf_counter()
        radix = engine.generate(input_ids=prompts, sampling_params=greedy)
        dt = time.perf_counter() - t0
        for q, o in zip(ENGLISH + CHINESE, radix):
            print(f"[{o['meta_info']['finish_reason']['type']}] {q}\n    -> {o['text']!r}")
        print(f"{sum(o['meta_info']['completion_tokens'] for o in radix) / dt:.1f} output tok/s")

        _section("sampled batch (temperature 0.7, top_k 20, top_p 0.9)")
        sampled = {"max_new_tokens": max_new_tokens, "temperature": 0.7, "top_k": 20, "top_p": 0.9}
        outs = engine.generate(input_ids=prompts, sampling_params=[{**sampled, "seed": seed + i} for i in range(len(prompts))])
        for q, o in zip(ENGLISH + CHINESE, outs):
            print(f"{q}\n    -> {o['text']!r}")

        _section("shared prefix: one system prompt, four questions")
        shared = [_chat_ids(engine, f"I am going to {c}. Any advice?", SYSTEM) for c in CITIES]
        engine.generate(input_ids=shared[:1], sampling_params=greedy)  # warms the cache with the system prompt
        for c, o in zip(CITIES, engine.generate(input_ids=shared, sampling_params=greedy)):
            m = o["meta_info"]
            print(f"{c:7s} prompt {m['prompt_tokens']:4d} tokens, cached {m['cached_tokens']:4d} -> {o['text'][:70]!r}")

        _section("radix cache on vs off")
        engine.check_memory()
    with Engine(**{**engine_kwargs, "disable_radix_cache": True}) as plain:
        no_radix = plain.generate(input_ids=prompts, sampling_params=greedy)
        plain.check_memory()
    same = [a["output_ids"] == b["output_ids"] for a, b in zip(radix, no_radix)]
    print(f"greedy outputs identical with the radix cache on and off: {sum(same)}/{len(same)}")
    return ok and all(same)


def add_demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--comprehensive", action="store_true", help="run every section, not only the first two")
    parser.add_argument("--seed", type=int, default=42, help="seed of the sampled section (default: 42)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens per answer (default: 48)")
