"""What the dashboard costs serving (the figures in docs/server.md).

1. One snapshot (what the scheduler takes for the dashboard, at most every 0.2 s however many
   read it) timed inside the scheduler thread, with a few hundred tree nodes and 8 requests
   decoding.
2. The same `bench serving` run against one fresh server, alternating without and with a client
   that polls /dashboard/state once a second, as the open page does.

    python scripts/dashboard_cost.py [--rounds 3] [--port 31950]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import httpx

BENCH = ["--dataset", "random", "--num-prompts", "32", "--random-input-min", "32", "--random-input-max", "256",
         "--random-output-min", "32", "--random-output-max", "128", "--max-concurrency", "8"]


def read_cost() -> None:
    from baby_sgl import Engine
    from baby_sgl.managers.scheduler.view import take_snapshot

    with Engine(max_total_tokens=16384) as engine:
        prompts = [f"Group {g}: a system prompt its questions share. " * 4 + f"Question {i}?"
                   for g in range(6) for i in range(10)]
        engine.generate(prompts, {"max_new_tokens": 8, "temperature": 0})
        done = threading.Event()
        load = threading.Thread(target=lambda: (engine.generate([f"long request {i}" for i in range(8)],
                                                                {"max_new_tokens": 200, "ignore_eos": True}),
                                                done.set()))
        load.start()
        time.sleep(2)
        inner, running = [], 0
        sched = engine.scheduler
        while not done.is_set():
            a, snap, b = sched.call(lambda: (time.perf_counter(), take_snapshot(
                sched.memory, sched.queues, sched.sessions.held_reqs(), sched.activity), time.perf_counter()))
            inner.append((b - a) * 1e3)
            running = max(running, snap.running["count"])
            time.sleep(0.2)
        load.join()
    print(f"one snapshot in the scheduler thread: median {statistics.median(inner):.2f} ms, max {max(inner):.2f} ms "
          f"(up to {len(snap.nodes or [])} nodes, up to {running} requests running, {len(inner)} reads)")


def poll(base: str, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        httpx.get(base + "/dashboard/state", timeout=60)


@contextlib.contextmanager
def running_server(port: int, *flags: str) -> Iterator[str]:
    """`baby-sgl serve` on the default model on this port, until the block ends; yields its URL."""
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "baby_sgl.launch_server", "--port", str(port), *flags])
    try:
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        yield base
    finally:
        server.terminate()
        server.wait()


def serving_cost(rounds: int, port: int) -> None:
    with running_server(port) as base:
        bench = [sys.executable, "-m", "baby_sgl.cli", "bench", "serving", "--base-url", base, *BENCH]
        subprocess.run(bench[:-2] + ["--num-prompts", "8"], capture_output=True)  # warm-up
        results = {"without": [], "with": []}
        for _ in range(rounds):
            for mode in ("without", "with"):
                stop = threading.Event()
                poller = threading.Thread(target=poll, args=(base, stop))
                if mode == "with":
                    poller.start()
                with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as out:
                    subprocess.run(bench + ["--output-file", out.name], capture_output=True, check=True)
                    results[mode].append(json.loads(out.read().splitlines()[-1])["output_token_throughput"])
                stop.set()
                if poller.is_alive():
                    poller.join()
        for mode, values in results.items():
            print(f"output tok/s {mode} the dashboard polling: " + ", ".join(f"{v:.1f}" for v in values))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--port", type=int, default=31950)
    args = p.parse_args()
    read_cost()
    serving_cost(args.rounds, args.port)


if __name__ == "__main__":
    main()
