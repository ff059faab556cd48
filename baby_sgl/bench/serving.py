"""`baby-sgl bench serving --base-url URL`: load test of any SGLang- or OpenAI-compatible server.

Requests arrive as a Poisson process (--request-rate) or at fixed concurrency (--max-concurrency);
each is streamed so time to first token (TTFT), inter-token latency (ITL) and time per output
token (TPOT) are measured at the client. --long-prompt-len adds one long prompt that arrives while
the others stream (--long-prompt-delay seconds in): their ITL then shows whether its prefill
stalls them (the summary's ITL is over the other requests only; the long one is reported apart)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server read from its prefix cache
    error: str = ""


def _words(rng: random.Random, n: int) -> str:
    """Random text of about n tokens, when no tokenizer is at hand (short common words
    tokenize to about one token each)."""
    vocab = "time year people way day man thing woman life child world school state family student group".split()
    return " ".join(rng.choice(vocab) for _ in range(n))


def _random_text(rng: random.Random, n: int, tokenizer) -> str:
    """n random tokens decoded to text (SGLang's random dataset); re-encoding may shift the
    count a little, which is why the server's own prompt_tokens are what gets reported."""
    if tokenizer is None:
        return _words(rng, n)
    special = set(tokenizer.all_special_ids)
    ids = [t for t in (rng.randrange(len(tokenizer)) for _ in range(2 * n + 8)) if t not in special][:n]
    return tokenizer.decode(ids)


def load_tokenizer(args: argparse.Namespace):
    """The tokenizer named by --tokenizer, else the one the server reports; None if neither loads."""
    name = args.tokenizer
    try:
        if name is None:
            info = httpx.get(args.base_url + "/get_model_info", timeout=10).json()
            name = info.get("tokenizer_path") or info.get("model_path")
        from transformers import AutoTokenizer

        if name.endswith(".gguf"):  # a GGUF file carries its own vocabulary (our default model is one)
            return AutoTokenizer.from_pretrained(os.path.dirname(name), gguf_file=os.path.basename(name))
        return AutoTokenizer.from_pretrained(name, trust_remote_code=False)  # never a question on stdin
    except Exception as e:  # any server or model: fall back to word text rather than give up
        print(f"no tokenizer ({e!r:.200}); prompts are random words", file=sys.stderr)
        return None


def build_prompts(args: argparse.Namespace, tokenizer=None) -> list[tuple[str, int]]:
    rng = random.Random(args.seed)
    if args.dataset == "random":
        return [(_random_text(rng, rng.randint(args.random_input_min, args.random_input_max), tokenizer),
                 rng.randint(args.random_output_min, args.random_output_max)) for _ in range(args.num_prompts)]
    prompts = []
    for _ in range(args.gsp_num_groups):
        system = _random_text(rng, args.gsp_system_prompt_len, tokenizer)
        prompts += [(system + " " + _random_text(rng, args.gsp_question_len, tokenizer), args.gsp_output_len)
                    for _ in range(args.gsp_prompts_per_group)]
    rng.shuffle(prompts)
    return prompts


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, prompt: str, max_tokens: int) -> Result:
    res, t0 = Result(), time.perf_counter()
    if args.backend == "sglang":
        params = {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        url, body = "/generate", {"text": prompt, "stream": True, "sampling_params": params}
    else:
        url, body = "/v1/completions", {"model": args.model, "prompt": prompt, "max_tokens": max_tokens,
                                        "temperature": 0, "stream": True, "ignore_eos": True,
                                        "stream_options": {"include_usage": True}}
    last = None
    try:
        async with client.stream("POST", args.base_url + url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data, now = json.loads(line[6:]), time.perf_counter()
                if "error" in data:  # servers report a failure inside a 200 stream this way
                    res.error = str(data["error"])[:300]
                    return res
                produced = _tokens_so_far(args.backend, data, res.output_tokens)
                if produced > res.output_tokens:
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itls += [(now - last) / (produced - res.output_tokens)] * (produced - res.output_tokens)
                    last, res.output_tokens = now, produced
                res.prompt_tokens = _prompt_tokens(args.backend, data) or res.prompt_tokens
                res.cached_tokens = _cached_tokens(args.backend, data) or res.cached_tokens
        res.latency, res.ok = time.perf_counter() - t0, True
    except Exception as e:  # a broken stream or body counts as a failed request, not a crash
        res.error = repr(e)[:300]
    return res


def _tokens_so_far(backend: str, data: dict, current: int) -> int:
    if backend == "sglang":
        return data["meta_info"]["completion_tokens"]
    if data.get("usage"):
        return max(current, data["usage"]["completion_tokens"])
    return current + (1 if data["choices"] and data["choices"][0].get("text") else 0)


def _prompt_tokens(backend: str, data: dict) -> int:
    if backend == "sglang":
        return data["meta_info"]["prompt_tokens"]
    return (data.get("usage") or {}).get("prompt_tokens", 0)


def _cached_tokens(backend: str, data: dict) -> int:
    if backend == "sglang":
        return data["meta_info"].get("cached_tokens", 0)
    return ((data.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _served_model(args: argparse.Namespace) -> str:
    """OpenAI-compatible servers want a model name; the first one they list is the one served."""
    try:
        return httpx.get(args.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    except Exception:
        return "default"


async def run(args: argparse.Namespace) -> dict:
    tokenizer = None if args.no_tokenizer else load_tokenizer(args)
    prompts = build_prompts(args, tokenizer)
    if args.backend == "openai" and args.model is None:
        args.model = _served_model(args)
    rng = random.Random(args.seed + 1)
    limit = asyncio.Semaphore(args.max_concurrency or len(prompts))
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=httpx.Limits(max_connections=1000)) as c:
        async def guarded(p: str, n: int) -> Result:
            async with limit:
                return await one_request(c, args, p, n)

        async def late(prompt: str) -> Result:
            await asyncio.sleep(args.long_prompt_delay)
            return await one_request(c, args, prompt, args.long_prompt_output)

        t0, tasks, long_task = time.perf_counter(), [], None
        if args.long_prompt_len:
            long_prompt = _random_text(random.Random(args.seed + 2), args.long_prompt_len, tokenizer)
            long_task = asyncio.create_task(late(long_prompt))
        for p, n in prompts:
            tasks.append(asyncio.create_task(guarded(p, n)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        long_result = await long_task if long_task else None
        duration = time.perf_counter() - t0
    summary = summarize(results, duration)
    if long_result is not None:
        summary["long_prompt"] = {"ok": long_result.ok, "prompt_tokens": long_result.prompt_tokens,
                                  "ttft_s": long_result.ttft, "latency_s": long_result.latency,
                                  "error": long_result.error}
    return summary


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"mean": statistics.fmean(values), "p50": q[49], "p90": q[89], "p99": q[98], "max": max(values)}


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens, "cached_input_tokens": cached,
        "cache_hit_rate": cached / in_tokens if in_tokens else 0.0,
        "request_throughput": len(ok) / duration, "input_token_throughput": in_tokens / duration,
        "output_token_throughput": out_tokens / duration, "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_s": _stats([r.ttft for r in ok if r.output_tokens]), "itl_s": _stats([x for r in ok for x in r.itls]),
        "tpot_s": _stats(tpot), "e2e_latency_s": _stats([r.latency for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


def print_summary(s: dict, args: argparse.Namespace) -> None:
    """A table laid out as SGLang's bench_serving prints it, so results compare at a glance."""
    rows = [("Backend", args.backend), ("Dataset", args.dataset), ("Traffic request rate", args.request_rate),
            ("Max request concurrency", args.max_concurrency or "not set"),
            ("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"), ("Total input tokens", s["total_input_tokens"]),
            ("Total generated tokens", s["total_output_tokens"]),
            ("Prompt tokens from the prefix cache", f"{s['cached_input_tokens']} ({s['cache_hit_rate']:.1%})"),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Input token throughput (tok/s)", f"{s['input_token_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_token_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    print("{:=^60}".format(" Serving Benchmark Result "))
    for name, value in rows:
        print(f"{name + ':':<44}{value:>16}")
    for key, title in (("e2e_latency_s", "End-to-End Latency"), ("ttft_s", "Time to First Token"),
                       ("tpot_s", "Time per Output Token (excl. 1st token)"), ("itl_s", "Inter-token Latency")):
        print("{:-^60}".format(title))
        short = {"e2e_latency_s": "E2E Latency", "ttft_s": "TTFT", "tpot_s": "TPOT", "itl_s": "ITL"}[key]
        for stat in ("mean", "p50", "p90", "p99") + (("max",) if key == "itl_s" else ()):
            print(f"{stat.capitalize() + ' ' + short + ' (ms):':<44}{s[key][stat] * 1e3:>16.2f}")
    if "long_prompt" in s:
        lp = s["long_prompt"]
        print("{:-^60}".format(" Long prompt arriving mid-run "))
        print(f"{'Prompt tokens:':<44}{lp['prompt_tokens']:>16}")
        print(f"{'TTFT (ms):':<44}{lp['ttft_s'] * 1e3:>16.2f}")
        print(f"{'Others: ITL p99 / p50:':<44}{s['itl_s']['p99'] / max(s['itl_s']['p50'], 1e-9):>16.2f}")
        if not lp["ok"]:
            print(f"error: {lp['error']}")
    print("=" * 60)
    for e in s["errors"]:
        print(f"error: {e}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="baby-sgl bench serving",
                                description="load a running server with concurrent requests (SGLang's bench_serving)")
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="the server (default: http://127.0.0.1:30000)")
    p.add_argument("--backend", choices=["sglang", "openai"], default="sglang",
                   help="sglang: POST /generate; openai: POST /v1/completions (default: sglang)")
    p.add_argument("--model", default=None, help="model name sent with --backend openai (default: the server's)")
    p.add_argument("--dataset", choices=["random", "shared-prefix", "generated-shared-prefix"], default="random",
                   help="random token prompts, or groups of prompts sharing a system prompt")
    p.add_argument("--tokenizer", default=None, help="for random token text (default: the server's)")
    p.add_argument("--no-tokenizer", action="store_true", help="random words instead of random tokens")
    p.add_argument("--num-prompts", type=int, default=32, help="requests of the random dataset (default: 32)")
    p.add_argument("--random-input-min", type=int, default=32, help="random dataset: shortest prompt, tokens")
    p.add_argument("--random-input-max", type=int, default=256, help="random dataset: longest prompt, tokens")
    p.add_argument("--random-output-min", type=int, default=16, help="random dataset: fewest output tokens")
    p.add_argument("--random-output-max", type=int, default=64, help="random dataset: most output tokens")
    p.add_argument("--gsp-num-groups", type=int, default=4, help="shared-prefix dataset: groups (one system prompt each)")
    p.add_argument("--gsp-prompts-per-group", type=int, default=8, help="shared-prefix dataset: prompts per group")
    p.add_argument("--gsp-system-prompt-len", type=int, default=512, help="shared-prefix dataset: system prompt tokens")
    p.add_argument("--gsp-question-len", type=int, default=32, help="shared-prefix dataset: question tokens")
    p.add_argument("--gsp-output-len", type=int, default=32, help="shared-prefix dataset: output tokens")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no limit)")
    p.add_argument("--long-prompt-len", type=int, default=0,
                   help="also send one prompt of this many tokens while the others stream")
    p.add_argument("--long-prompt-delay", type=float, default=3.0, help="seconds after the start it is sent")
    p.add_argument("--long-prompt-output", type=int, default=8, help="tokens it generates")
    p.add_argument("--timeout", type=float, default=600, help="seconds a request may take (default: 600)")
    p.add_argument("--seed", type=int, default=1, help="seed of the prompts and arrivals (default: 1)")
    p.add_argument("--output-file", default=None, help="append the results as one JSON line")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    summary = asyncio.run(run(args))
    print_summary(summary, args)
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps({"args": vars(args) | {"request_rate": str(args.request_rate)}, **summary}) + "\n")
    return 0 if summary["failed"] == 0 and summary.get("long_prompt", {}).get("ok", True) else 1
