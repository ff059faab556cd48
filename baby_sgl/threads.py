"""Keeping torch's parallel CPU work on one thread of the process at a time.

torch's CPU ops run their parallel loops on OpenMP (libgomp), which gives every thread that
starts a parallel region a team of worker threads of its own, kept until that thread ends. Once
the process holds more of them than it has cores, libgomp stops letting idle workers spin and puts
them to sleep after every region, and every later parallel op waits for them to be woken. On a
2-core machine a [64, 576] bfloat16 add took 50 us instead of 6 on the scheduler's thread when the
thread that had loaded the model had also run parallel ops, and a 64-token prefill 86 ms instead of
56. So the engine loads on a thread that ends before it serves, leaving the scheduler's thread
the only one with workers, and work done beside a running engine (the bench's roof measurement)
runs on a short-lived thread as well. The one-call decode step runs on the same team
(cpu/csrc/step_team.h): a second set of threads spinning beside it made a batch-1 step 2.6x slower.

Those threads are at most as many as the cores the process may use: a
second thread on a core only waits for the first, at every barrier of every op.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from baby_sgl import native_env

T = TypeVar("T")
logger = logging.getLogger(__name__)


def usable_cores() -> int:
    """The cores this thread may run on: its affinity mask, where the OS has one."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def fit_threads_to_cores() -> None:
    """Lowers torch's thread count to usable_cores(). OpenMP counts the cores once, when the
    process starts: a mask narrowed since (taskset -p, a parent pinning the thread that starts
    the engine) left more threads than cores."""
    cores = usable_cores()
    if torch.get_num_threads() > cores:
        logger.info("torch threads %d -> %d: the cores this process may use", torch.get_num_threads(), cores)
        torch.set_num_threads(cores)
    if not native_env.SPIN_SET_BEFORE_TORCH:
        logger.warning("torch was imported before baby_sgl, so its OpenMP threads spin for milliseconds after each "
                       "op (native_env.py): import baby_sgl first, or set GOMP_SPINCOUNT=1000, for a faster "
                       "decode beside other work")


def run_in_own_thread(fn: Callable[[], T], name: str = "baby-sgl-setup") -> T:
    """fn() on a new thread that ends when it returns (its OpenMP workers with it): its result,
    or its exception re-raised here."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, name=name, daemon=True)  # Ctrl-C while loading still exits
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]
