"""The engine loads on a thread of its own, which has ended by the time it serves (threads.py)."""

from __future__ import annotations

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
