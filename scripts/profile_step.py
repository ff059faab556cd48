"""Where a decode step spends its time, on the default model unless --model-path is given.

    python scripts/profile_step.py --batch 1 --input-len 128          # batch-1 decode step
    python scripts/profile_step.py --batch 32 --input-len 200         # a full decode batch
    python scripts/profile_step.py --batch 1 --input-len 1000 --mode extend
    python scripts/profile_step.py --batch 8 --shared-prefix 1024     # 8 requests behind one prompt

Decode, for --steps scheduler rounds after --warmup: each round's wall time split into the forward
pass, sampling and the rest of the scheduler's Python (batch preparation, output processing);
then the forward pass itself: with the one-call CPU step, its own split (matmul, attention, the
small ops, the logits; thread 0's time including its waits for the other threads), otherwise
torch.profiler's op table. --mode extend profiles the first prefill pass with torch.profiler.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

from baby_sgl import Engine  # before torch: baby_sgl/native_env.py
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def timed(store: dict, key: str, fn, when=lambda: True):
    """fn, adding its time to store[key] while when() holds."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if when():
                store[key] += time.perf_counter() - t0
    return wrapper


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with")
    p.add_argument("--mode", choices=["decode", "extend"], default="decode")
    p.add_argument("--warmup", type=int, default=4, help="decode rounds before measuring")
    p.add_argument("--steps", type=int, default=32, help="decode rounds measured")
    p.add_argument("--rows", type=int, default=15)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy, as the benchmarks")
    p.add_argument("--model-path", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None, help="as the engine's flag (gguf or none)")
    p.add_argument("--enable-torch-compile", action="store_true", help="as the engine's flag (op by op, compiled)")
    p.add_argument("--cpu-int8-activations", default="auto", help="as the engine's flag (auto, on or off)")
    p.add_argument("--kv-cache-dtype", default="auto", help="as the engine's flag (the KV pool's element type)")
    p.add_argument("--no-step", action="store_true", help="decode op by op instead of the one-call CPU step")
    p.add_argument("--shapes", action="store_true", help="one row per op and input shapes (op table)")
    args = p.parse_args()

    rng = random.Random(0)
    with Engine(args.model_path, dtype=args.dtype, quantization=args.quantization,
                cpu_int8_activations=args.cpu_int8_activations, kv_cache_dtype=args.kv_cache_dtype,
                enable_torch_compile=args.enable_torch_compile,
                torch_compile_max_bs=max(args.batch, 1), max_running_requests=max(64, args.batch)) as engine:
        vocab = engine.model_config.vocab_size
        prefix = [rng.randrange(100, vocab) for _ in range(args.shared_prefix)]
        prompts = [prefix + [rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.batch)]
        if prefix:  # the prefix is in the radix cache before the batch arrives, as after a first request
            engine.generate(input_ids=prefix, sampling_params={"max_new_tokens": 1})
        sched, runner = engine.scheduler, engine.runner
        output = sched.output
        if args.no_step:
            runner.step = None
        step_fn, forward, sample = sched.step, runner.forward, output.sample
        seen, times, report, measuring, split = defaultdict(int), defaultdict(float), [], [False], {}

        def measured_step() -> bool:
            mode = "decode" if sched.queues.running and not sched.queues.waiting else "extend"
            seen[mode] += 1
            measuring[0] = args.mode == "decode" and mode == "decode" and \
                args.warmup < seen[mode] <= args.warmup + args.steps
            if args.mode == "decode" and mode == "decode" and runner.step is not None:
                if seen[mode] == args.warmup + 1:
                    runner.step.step.profile(True)  # from now on (the split so far is dropped)
                elif seen[mode] == args.warmup + args.steps + 1:
                    split.update(runner.step.step.profile(False))
            return timed(times, "round", step_fn, lambda: measuring[0])()

        def profiled_forward(batch):
            if args.mode == "extend" and batch.mode.name == "EXTEND" and not report:
                with profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes) as prof:
                    t0 = time.perf_counter()
                    out = forward(batch)
                report.append((len(batch.seq_lens), max(batch.seq_lens), time.perf_counter() - t0, prof))
                return out
            if args.mode == "decode" and runner.step is None and batch.mode.name == "DECODE" and \
                    seen["decode"] == args.warmup + args.steps + 1 and not report:  # after the timed rounds
                with profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes) as prof:
                    out = forward(batch)
                report.append((len(batch.seq_lens), max(batch.seq_lens), None, prof))
                return out
            return timed(times, "forward", forward, lambda: measuring[0])(batch)

        sched.step, runner.forward = measured_step, profiled_forward
        output.sample = timed(times, "sampling", sample, lambda: measuring[0])
        n_out = args.warmup + args.steps + 2
        engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": n_out, "ignore_eos": True,
                                                              "temperature": args.temperature})
        sched.step, runner.forward, output.sample = step_fn, forward, sample
        engine.check_memory()

    if args.mode == "decode":
        n = args.steps
        rest = times["round"] - times["forward"] - times["sampling"]
        print(f"decode: batch {args.batch}, prompts of {args.shared_prefix + args.input_len} tokens, "
              f"{n} rounds after {args.warmup}")
        print(f"  scheduler round {times['round'] / n * 1e3:.2f} ms = forward {times['forward'] / n * 1e3:.2f} ms"
              f" + sampling {times['sampling'] / n * 1e3:.2f} ms + scheduling and outputs (Python) {rest / n * 1e3:.2f} ms")
        if split:
            parts = ", ".join(f"{k} {v / n * 1e3:.2f} ms" for k, v in split.items())
            print(f"  one-call step (thread 0): {parts}")
            return
    batch, longest, wall, prof = report[0]
    print(f"{args.mode} pass: batch {batch}, longest sequence {longest} tokens"
          + (f", {wall * 1e3:.1f} ms wall (the profiler adds a little)" if wall else ""))
    print(prof.key_averages(group_by_input_shape=args.shapes).table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
