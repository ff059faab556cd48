"""Busy neighbours for `bench offline --beside-busy-core / --beside-engine`: the same workload run
again while another process competes for the cores, a busy loop or a second engine that serves
the same workload over and over. Run as a module, this is that second engine: it reads its
settings and workload as one JSON line on stdin, says `ready` once warm, and loops until killed."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator

from baby_sgl.bench.workloads import Workload

_READY = "ready"


@contextlib.contextmanager
def busy_core() -> Iterator[None]:
    """One process that spins on a core as long as the block runs."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


@contextlib.contextmanager
def second_engine(engine_kwargs: dict, wl: Workload) -> Iterator[None]:
    """Another engine process on the same cores, serving `wl` without pause once the block runs
    (its model is loaded and warm before the block starts)."""
    proc = subprocess.Popen([sys.executable, "-m", "baby_sgl.bench.neighbours"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps({"engine": engine_kwargs, "prompts": wl.prompts,
                                     "output_lens": wl.output_lens}) + "\n")
        proc.stdin.flush()
        if proc.stdout.readline().strip() != _READY:
            raise RuntimeError(f"the second engine did not start (exit code {proc.wait()})")
        yield
    finally:
        proc.kill()
        proc.wait()


def _serve_forever() -> None:
    from baby_sgl.engine import Engine

    spec = json.loads(sys.stdin.readline())
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in spec["output_lens"]]
    with Engine(**spec["engine"]) as engine:
        engine.generate(input_ids=spec["prompts"][:1], sampling_params={**params[0], "max_new_tokens": 2})
        print(_READY, flush=True)
        while True:
            engine.flush_cache()  # each round computes its prompts again, as the measured engine does
            engine.generate(input_ids=spec["prompts"], sampling_params=params)


if __name__ == "__main__":
    _serve_forever()
