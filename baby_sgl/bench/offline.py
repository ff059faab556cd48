"""`baby-sgl bench offline`: throughput of the engine on a fixed workload, optionally next to
transformers, another engine, or itself in another setting (`--compare ...`) on the very same
prompts, in the same run; with --rounds, each of them several times in turn (the options are
offline_cli.py's)."""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any, cast

import torch

from baby_sgl.bench.checkpoints import ensure_checkpoint
from baby_sgl.bench.copy_workload import copy_workload, multi_turn_workload
from baby_sgl.bench.model_shapes import SHAPES
from baby_sgl.bench.neighbours import busy_core, second_engine
from baby_sgl.bench.peers import PEERS, run_peer
from baby_sgl.bench.roofline import cpu_description, measure_roofs
from baby_sgl.bench.workloads import Workload, one_batch_workload, random_workload, shared_prefix_workload
from baby_sgl.engine import Engine
from baby_sgl.core import kv_cache_dtype
from baby_sgl.core.memory_pool import KVPool
from baby_sgl.server_args import KV_CACHE_DTYPE_CHOICES, engine_kwargs
from baby_sgl.threads import run_in_own_thread


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# `--compare json-schema`: every request writes a JSON array of records under this schema. Each
# array is long enough that the length limit, not the grammar, ends nearly every output, so the
# two runs produce about as many tokens.
BENCH_SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                                     "name": {"type": "string", "maxLength": 12},
                                     "ok": {"type": "boolean"}}, "required": ["id", "name", "ok"]}}


def run_engine(engine: Engine, wl: Workload, constraint: dict | None = None,
               lora_path: list[str | None] | None = None) -> dict:
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **(constraint or {})}
              for n in wl.output_lens]
    # Warm-up (and, with a constraint, its one compile, which is then cached).
    compile_s = time.perf_counter()
    engine.generate(input_ids=wl.prompts[:1], sampling_params={**params[0], "max_new_tokens": 2})
    compile_s = time.perf_counter() - compile_s
    engine.flush_cache()
    before = engine.get_server_info()
    t0 = time.perf_counter()
    outs = cast(list[dict], engine.generate(input_ids=wl.prompts, sampling_params=params, lora_path=lora_path))
    dt = time.perf_counter() - t0
    extra = speculation_stats(before, engine.get_server_info())
    out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    if constraint:
        extra |= {"engine": "baby-sgl json-schema", "warmup_with_compile_s": compile_s,
                 "closed_by_grammar": sum(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs)}
    return {
        "engine": "baby-sgl", **extra, "seconds": dt, "requests_per_s": len(outs) / dt,
        "input_tok_s": wl.input_tokens / dt, "output_tok_s": out_tokens / dt,
        "total_tok_s": (wl.input_tokens + out_tokens) / dt, "cache_hit_rate": cached / wl.input_tokens,
        # What the model really computed: cached prompt tokens cost nothing.
        "computed_tok_s": (wl.input_tokens - cached + out_tokens) / dt,
        "ttft_mean_s": sum(o["meta_info"]["ttft"] for o in outs) / len(outs),
        "outputs": [o["output_ids"] for o in outs],
    }


def speculation_stats(before: dict, after: dict) -> dict:
    """Speculative decoding over a run: tokens per verify pass (the accepted drafts plus the
    model's own token), and how often a decoding request found a draft."""
    steps = after.get("spec_verify_steps", 0) - before.get("spec_verify_steps", 0)
    if not steps:
        return {}
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    chances = after["spec_draft_chances"] - before["spec_draft_chances"]
    return {"spec_accept_length": 1 + accepted / steps, "spec_draft_hit_rate": steps / max(chances, 1),
            "spec_draft_accept_rate": accepted / max(after["spec_draft_tokens"] - before["spec_draft_tokens"], 1)}


def run_one_batch(engine: Engine, wl: Workload, lora_path: list[str | None] | None = None) -> dict:
    """Prefill latency of the whole batch, then the median decode step (streamed timestamps)."""
    params = {"max_new_tokens": wl.output_lens[0], "temperature": 0, "ignore_eos": True}
    engine.generate(input_ids=wl.prompts[:1], sampling_params={"max_new_tokens": 2})
    engine.flush_cache()
    stamps, t0 = [], time.perf_counter()
    for chunk in engine.generate(input_ids=wl.prompts, sampling_params=params, stream=True, lora_path=lora_path):
        if chunk["index"] == 0:
            stamps.append(time.perf_counter())
    steps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    n_out = len(wl.prompts) * wl.output_lens[0]
    return {"engine": "baby-sgl", "prefill_s": stamps[0] - t0, "decode_step_median_s": steps[len(steps) // 2],
            "seconds": stamps[-1] - t0, "output_tok_s": n_out / (stamps[-1] - t0)}


def memory_budget(engine: Engine) -> dict[str, float]:
    """What the process needs: the weights and the KV pool; the README's budget adds 600 MB."""
    cfg = engine.model_config
    model = engine.scheduler.runner.model
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    kv = engine.max_total_tokens * KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                                           engine.kv_cache_dtype)
    return {"weights_mb": weights / 1e6, "kv_pool_mb": kv / 1e6, "budget_mb": (weights + kv) / 1e6 + 600}


def variant(result: dict, label: str, base: dict) -> dict:
    """The same workload in another setting (a dtype, no speculation, ...): how many greedy
    outputs equal the base run's, and on average what fraction of each output agrees before the
    first differing token."""
    result["engine"] = f"baby-sgl {label}"
    if "outputs" in result and "outputs" in base:
        pairs = list(zip(base["outputs"], result["outputs"]))
        result["greedy_identical_frac"] = sum(a == b for a, b in pairs) / len(pairs)
        result["greedy_agree_prefix_frac"] = sum(_common_prefix(a, b) / max(len(a), 1) for a, b in pairs) / len(pairs)
    return result


def beside(result: dict, label: str, base: dict) -> dict:
    """The same workload with a neighbour on the cores: its slowdown against the solo run (the
    decode step's, for one batch; else the output rate's) and the fraction of solo speed kept."""
    result["engine"] = f"baby-sgl {label}"
    if "decode_step_median_s" in result:
        slowdown = result["decode_step_median_s"] / base["decode_step_median_s"]
    else:
        slowdown = base["output_tok_s"] / result["output_tok_s"]
    result |= {"slowdown": slowdown, "solo_speed_kept": 1 / slowdown}
    return result


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def build_workload(args: argparse.Namespace, engine: Engine) -> Workload:
    vocab = engine.model_config.vocab_size
    if args.workload == "copy":
        return copy_workload(engine.tokenizer, args.output_len, args.repeats)
    if args.workload == "multi-turn":
        return multi_turn_workload(engine.tokenizer, args.output_len)
    if args.workload == "random":
        return random_workload(args.num_prompts, vocab, (args.input_min, args.input_max),
                               (args.output_min, args.output_max), args.seed)
    if args.workload == "shared-prefix":
        return shared_prefix_workload(args.groups, args.prompts_per_group, args.system_len, args.question_len,
                                      args.output_len, vocab, args.seed)
    return one_batch_workload(args.batch, args.input_len, args.output_len, vocab, args.seed)


def run_bench(args: argparse.Namespace) -> int:
    """The run offline_cli.py parsed and checked."""
    if args.threads:
        torch.set_num_threads(args.threads)
    kwargs = engine_kwargs(args)
    hf_dir = None
    if args.model_shape:
        checkpoint = ensure_checkpoint(SHAPES[args.model_shape])
        kwargs["model_path"], hf_dir = checkpoint.gguf, checkpoint.hf_dir
    run: Callable[..., dict] = run_one_batch if args.workload == "one-batch" else run_engine
    if args.lora:
        kwargs |= {"enable_lora": True, "max_lora_rank": max(args.lora_rank, kwargs.get("max_lora_rank") or 0),
                   "max_loras_per_batch": max(args.lora_adapters, kwargs["max_loras_per_batch"])}
    with Engine(**kwargs) as engine:
        wl = build_workload(args, engine)
        result = run(engine, wl)
        result["kv_pool_tokens"] = engine.max_total_tokens
        if args.speculative_algorithm:
            result["engine"] = f"baby-sgl {args.speculative_algorithm}"
        # Before the roof measurement and any comparison run, which would raise the high-water mark.
        report_rss = peak_rss_mb()
        if "json-schema" in args.compare:
            report_constrained = run(engine, wl, {"json_schema": json.dumps(BENCH_SCHEMA)})
        neighbours = run_beside_neighbours(args, kwargs, engine, wl, run, result)
        lora_paths = None
        if args.lora:
            lora_row, lora_paths = run_with_adapters(engine, wl, run, args.lora_adapters, args.lora_rank)
            neighbours.append(lora_row)
        roofs = run_in_own_thread(lambda: measure_roofs(engine))  # see threads.py
        model_path, dtype = engine.model_path, engine.dtype
        memory = memory_budget(engine)
    model = (model_path, hf_dir)
    base_rounds, compare_rounds = [result], []
    for compare in args.compare:
        compare_rounds.append([compare_with(compare, args, kwargs, wl, run, result, model, dtype,
                                            report_constrained if compare == "json-schema" else None)])
    for _ in range(1, args.rounds):  # baby-sgl again, then each comparison again, in the same order
        with Engine(**kwargs) as engine:
            base_rounds.append(run(engine, wl))
        for compare, rounds in zip(args.compare, compare_rounds):
            if compare != "json-schema":  # its row is the engine's own, measured in the first round
                rounds.append(compare_with(compare, args, kwargs, wl, run, base_rounds[-1], model, dtype, None))
    result = median_of_rounds(base_rounds)
    report: dict[str, Any] = {"model": args.model_shape or model_path, "cpu": cpu_description(), "workload": wl.name, "num_prompts": len(wl.prompts), "input_tokens": wl.input_tokens,
              "output_tokens": sum(wl.output_lens), "dtype": str(dtype), "threads": torch.get_num_threads(),
              "server_args": kwargs, "roofs": roofs, "memory": memory, "results": [result],
              "peak_rss_mb": report_rss}
    if "total_tok_s" in result:
        result["compute_roof_fraction"] = result["computed_tok_s"] / roofs["compute_roof_tok_s"]
    if "decode_step_median_s" in result:
        result["bandwidth_roof_ratio"] = result["decode_step_median_s"] / roofs["bandwidth_roof_step_s"]
    if "prefill_s" in result:  # one batch: the prompt tokens' pass against the matmul roof
        result["prefill_tok_s"] = wl.input_tokens / result["prefill_s"]
        result["prefill_roof_fraction"] = result["prefill_tok_s"] / roofs["compute_roof_tok_s"]
    report["results"] += neighbours
    for compare, rounds in zip(args.compare, compare_rounds):
        for rows in zip(*rounds):  # one row, or kv-cache-dtypes' row per element type
            report["results"].append(median_of_rounds(list(rows), base_rounds))
        if compare == "vllm" and lora_paths is not None:  # the same adapters, against the LoRA row
            report["results"].append(run_peer("vllm", model_path, dtype, wl, args.workload == "one-batch",
                                              torch.get_num_threads(), lora_row, hf_dir=hf_dir, lora_paths=lora_paths))
    print_report(report)
    if args.output_file:
        for r in report["results"]:
            r.pop("outputs", None)
        with open(args.output_file, "a") as f:
            f.write(json.dumps(report) + "\n")
    return 0


def median_of_rounds(rows: list[dict], base_rounds: list[dict] | None = None) -> dict:
    """One row's --rounds as one row: each measured figure the median of the rounds' (labels,
    counts and outputs the first round's), every round's own figures under "round_rows", and with
    base_rounds (baby-sgl's rows, round by round) each round's speed ratio, and for one batch its
    prefill's (baby-sgl's prefill time over the row's)."""
    merged = dict(rows[0])
    if len(rows) == 1:
        return merged
    for key, value in rows[0].items():
        if isinstance(value, float):  # of the rounds that have it (a round may have failed)
            merged[key] = statistics.median(row[key] for row in rows if isinstance(row.get(key), float))
    merged |= {"rounds": len(rows), "round_rows": [{k: v for k, v in row.items() if k != "outputs"} for row in rows]}
    if base_rounds is not None:
        merged["round_ratios"] = [speed_ratio(base, row) for base, row in zip(base_rounds, rows)]
        if all(row.get("prefill_s") for row in [*rows, *base_rounds]):
            merged["round_prefill_ratios"] = [base["prefill_s"] / row["prefill_s"]
                                              for base, row in zip(base_rounds, rows)]
    return merged


def speed_ratio(base: dict, row: dict) -> float | None:
    """base's speed over row's: by the decode step where both rows have one (one batch), else by
    output tokens per second; None for a row with neither (an error)."""
    if by_decode_step(base, row):
        return base["decode_step_median_s"] / row["decode_step_median_s"]
    if row.get("output_tok_s") and base.get("output_tok_s"):
        return base["output_tok_s"] / row["output_tok_s"]
    return None


def by_decode_step(base: dict, row: dict) -> bool:
    return bool(row.get("decode_step_median_s") and base.get("decode_step_median_s"))


def run_beside_neighbours(args: argparse.Namespace, kwargs: dict, engine: Engine, wl: Workload,
                          run: Callable[..., dict], base: dict) -> list[dict]:
    """The rows of --beside-busy-core and --beside-engine."""
    rows = []
    if args.beside_busy_core:
        with busy_core():
            rows.append(beside(run(engine, wl), "beside a busy core", base))
    if args.beside_engine:
        with second_engine(kwargs, wl):
            rows.append(beside(run(engine, wl), "beside a second engine", base))
    return rows


def run_with_adapters(engine: Engine, wl: Workload, run: Callable[..., dict], count: int,
                      rank: int) -> tuple[dict, list[str]]:
    """The workload with prompt i under adapter i mod count, every batch mixing them; the result
    row and each prompt's adapter directory."""
    from baby_sgl.bench.lora_adapters import load_random_adapters

    loaded = load_random_adapters(engine, count, rank)
    names, paths = loaded.pop("names"), loaded.pop("paths")
    result = run(engine, wl, lora_path=[names[i % count] for i in range(len(wl.prompts))])
    return result | loaded | {"engine": f"baby-sgl {count} LoRA r{rank}"}, [paths[i % count] for i in range(len(wl.prompts))]


def compare_with(compare: str, args: argparse.Namespace, kwargs: dict, wl: Workload, run: Callable[..., dict],
                 base: dict, model: tuple[str, str | None], dtype: torch.dtype, constrained: dict | None) -> list[dict]:
    """The result rows of one --compare choice. model: the path baby-sgl loaded, and the Hugging
    Face directory of the same weights where there is one (--model-shape)."""
    model_path, hf_dir = model
    if compare == "hf":
        from baby_sgl.bench.hf_baseline import compare_hf

        return compare_hf(hf_dir or model_path, dtype, wl)
    if compare in PEERS:
        return [run_peer(compare, model_path, dtype, wl, args.workload == "one-batch", torch.get_num_threads(), base,
                         prompt_lookup=args.speculative_num_draft_tokens - 1 if args.speculative_algorithm else 0,
                         hf_dir=hf_dir)]
    if compare == "json-schema":
        assert constrained is not None
        return [constrained]
    if compare in ("no-speculation", "request-only-drafts"):
        other_args = {"speculative_algorithm": None} if compare == "no-speculation" else \
            {"speculative_ngram_request_only": True}
        with Engine(**{**kwargs, **other_args}) as other:
            return [variant(run(other, wl), compare, base)]
    if compare == "deterministic":
        flipped = not kwargs.get("enable_deterministic_inference", False)
        with Engine(**{**kwargs, "enable_deterministic_inference": flipped}) as other:
            return [variant(run(other, wl), "deterministic" if flipped else "not deterministic", base)]
    if compare == "kv-cache-dtypes":
        ran = kv_cache_dtype.resolve(kwargs.get("kv_cache_dtype", "auto"), dtype)  # the base row's pool
        return [kv_cache_variant(name, kwargs, wl, run, base) for name in KV_CACHE_DTYPE_CHOICES
                if kv_cache_dtype.resolve(name, dtype) != ran]
    with Engine(**{**kwargs, "dtype": compare}) as other:
        return [variant(run(other, wl), str(other.dtype).removeprefix("torch."), base)]


def kv_cache_variant(name: str, kwargs: dict, wl: Workload, run: Callable[..., dict], base: dict) -> dict:
    """The workload over a KV pool of another element type, sized in the same bytes."""
    with Engine(**{**kwargs, "kv_cache_dtype": name}) as other:
        result = variant(run(other, wl), f"KV {name}", base)
        result["kv_pool_tokens"] = other.max_total_tokens
        return result


def print_report(report: dict) -> None:
    print(f"model {report['model']} on {report['cpu']}")
    print(f"workload {report['workload']}: {report['num_prompts']} prompts, {report['input_tokens']} input tokens, "
          f"{report['output_tokens']} output tokens, {report['dtype']}, {report['threads']} threads")
    roofs = report["roofs"]
    print(f"roofs: matmul {roofs['gflops']:.0f} GFLOP/s -> {roofs['compute_roof_tok_s']:.0f} tok/s; "
          f"read {roofs['read_gb_s']:.1f} GB/s -> batch-1 decode step >= {roofs['bandwidth_roof_step_s'] * 1e3:.1f} ms")
    base = report["results"][0]
    for r in report["results"]:
        fields = [f"{k}={v:.4g}" for k, v in r.items() if isinstance(v, float | int) and not isinstance(v, bool)]
        ratio, speed = "", speed_ratio(base, r) if r is not base else None
        if speed is not None:
            ratio = f"  (decode step {speed:.2f}x the first row's speed" if by_decode_step(base, r) \
                else f"  (baby-sgl is {speed:.2f}x"
            if r.get("round_ratios"):
                ratio += "; rounds " + ", ".join(f"{x:.2f}x" for x in r["round_ratios"] if x is not None)
            if r.get("prefill_s") and base.get("prefill_s"):  # one batch: the time to the first token
                ratio += f"; baby-sgl's prefill in {base['prefill_s'] / r['prefill_s']:.2f}x this row's time"
                if r.get("round_prefill_ratios"):
                    ratio += "; rounds " + ", ".join(f"{x:.2f}x" for x in r["round_prefill_ratios"])
            ratio += ")"
        print(f"  {r['engine']:>28s}: " + " ".join(fields) + ratio)
    mem = report["memory"]
    print(f"peak RSS {report['peak_rss_mb']:.0f} MB (weights {mem['weights_mb']:.0f} MB + KV pool "
          f"{mem['kv_pool_mb']:.0f} MB + 600 MB = budget {mem['budget_mb']:.0f} MB)")
