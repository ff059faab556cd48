"""The engine loads on a thread of its own, which has ended by the time it serves (threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

import baby_sgl.engine as engine_module
from baby_sgl import Engine
from baby_sgl.threads import run_in_own_thread


def test_run_in_own_thread_returns_and_raises():
    caller = threading.current_thread()
    seen = []

    def work():
        seen.append(threading.current_thread())
        return 42

    assert run_in_own_thread(work) == 42
    assert seen[0] is not caller and not seen[0].is_alive()

    def fail():
        raise KeyError("no such weight")

    with pytest.raises(KeyError, match="no such weight"):
        run_in_own_thread(fail)


def test_engine_loads_off_the_callers_thread(tiny_llama, monkeypatch):
    loaders = []
    real = engine_module.load_model

    def recording(*args, **kwargs):
        loaders.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "load_model", recording)
    with Engine(tiny_llama, dtype="float32") as eng:
        assert loaders and loaders[0] is not threading.current_thread() and not loaders[0].is_alive()
        out = eng.generate(input_ids=[1, 5, 9], sampling_params={"max_new_tokens": 3, "temperature": 0})
        assert len(out["output_ids"]) == 3
        eng.check_memory()


def test_engine_start_errors_reach_the_caller(tiny_llama):
    with pytest.raises(ValueError, match="gguf"):
        Engine(tiny_llama, quantization="gguf")


_SPIN_SEEN = """
import logging, os, sys
if sys.argv[1] == "torch-first":
    import torch  # noqa: F401
import baby_sgl
from baby_sgl import native_env, threads
logging.basicConfig(level=logging.WARNING)
threads.fit_threads_to_cores()
print(os.environ["GOMP_SPINCOUNT"], native_env.SPIN_SET_BEFORE_TORCH)
"""


@pytest.mark.parametrize("order", ["baby-sgl-first", "torch-first"])
def test_openmp_spin_is_set_before_torch_loads(order):
    # libgomp reads GOMP_SPINCOUNT once, as torch loads it (native_env.py): with its default the
    # step's threads and torch's held the cores for milliseconds after each op.
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    done = subprocess.run([sys.executable, "-c", _SPIN_SEEN, order], capture_output=True, text=True, timeout=120,
                          env=dict(env, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 0, done.stderr[-2000:]
    in_time = order == "baby-sgl-first"
    assert done.stdout.split() == ["1000", str(in_time)]
    assert ("import baby_sgl first" in done.stderr) is not in_time
