"""Where one forward pass spends its time: torch.profiler's op table for a decode step (or the
prefill) of a static batch, on the default model unless --model-path is given.

    python scripts/profile_step.py --batch 1 --input-len 128          # batch-1 decode step
    python scripts/profile_step.py --batch 64 --input-len 1024        # long-context decode
    python scripts/profile_step.py --batch 1 --input-len 1000 --mode extend
    python scripts/profile_step.py --batch 8 --shared-prefix 1024     # 8 requests behind one prompt

The step profiled is the `--step`-th decode pass (after warm-up), or the first extend pass.
"""

from __future__ import annotations

import argparse
import random
import time

from torch.profiler import ProfilerActivity, profile

from baby_sgl import Engine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with")
    p.add_argument("--mode", choices=["decode", "extend"], default="decode")
    p.add_argument("--step", type=int, default=8)
    p.add_argument("--rows", type=int, default=15)
    p.add_argument("--model-path", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--shapes", action="store_true", help="one row per op and input shapes")
    args = p.parse_args()

    rng = random.Random(0)
    with Engine(args.model_path, dtype=args.dtype) as engine:
        vocab = engine.model_config.vocab_size
        prefix = [rng.randrange(100, vocab) for _ in range(args.shared_prefix)]
        prompts = [prefix + [rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.batch)]
        if prefix:  # the prefix is in the radix cache before the batch arrives, as after a first request
            engine.generate(input_ids=prefix, sampling_params={"max_new_tokens": 1})
        runner = engine.scheduler.runner
        forward, seen, report = runner.forward, {"decode": 0, "extend": 0}, []

        def profiled(batch):
            mode = batch.mode.name.lower()
            seen[mode] += 1
            if mode != args.mode or report or seen[mode] != (args.step if mode == "decode" else 1):
                return forward(batch)
            with profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes) as prof:
                t0 = time.perf_counter()
                out = forward(batch)
                wall = time.perf_counter() - t0
            report.append((len(batch.seq_lens), max(batch.seq_lens), wall, prof))
            return out

        runner.forward = profiled
        engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": args.step + 2, "ignore_eos": True})
        runner.forward = forward
        engine.check_memory()
    batch, longest, wall, prof = report[0]
    print(f"{args.mode} pass: batch {batch}, longest sequence {longest} tokens, {wall * 1e3:.1f} ms wall "
          "(the profiler adds a little)")
    averages = prof.key_averages(group_by_input_shape=args.shapes)
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
