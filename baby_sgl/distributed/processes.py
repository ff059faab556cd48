"""The processes this one starts on this machine (data-parallel workers and their router,
tensor-parallel ranks): each on its own share of the cores, so their torch threads do not compete,
talking over free loopback ports, and stopping when this process dies; and how a process of ours
ends (end_without_collecting)."""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1  # prctl(2)


def split_cores(n: int) -> list[list[int]]:
    """The cores this process may use, split into n contiguous, disjoint groups. With fewer
    cores than groups, groups share."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) < n:
        return [[cores[i % len(cores)]] for i in range(n)]
    size, extra = divmod(len(cores), n)
    groups, start = [], 0
    for i in range(n):
        end = start + size + (i < extra)
        groups.append(cores[start:end])
        start = end
    return groups


def child_setup(cores: list[int] | None, die_with_parent: bool = False) -> Callable[[], None]:
    """A child's preexec_fn: kept on these cores (if given and the OS has affinity); with
    die_with_parent, sent SIGTERM by the kernel when this process dies, even by SIGKILL (Linux).
    The kernel means the thread that starts the child: use it only from one that lives as long
    as the process (the main thread)."""

    def setup() -> None:
        if cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)
        if die_with_parent and sys.platform == "linux":
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return setup


def end_without_collecting() -> None:
    """For a process of ours (the CLI, a server, a rank), called from its entry point: when the
    process ends, skip the interpreter's last garbage collections. They walk every object torch's
    modules made, ~1 s a process on a 2-core Zen 3 (`python -c "import torch"` ends 0.9 s after its
    last line, 0.2 s with this). The cost: objects in reference cycles are never finalized at exit,
    so no cleanup in these processes may rest on `__del__` or the collector (files, sockets,
    children and process groups are closed by the code that opened them). Other exit handlers still
    run. It affects the whole process; a second call adds nothing."""
    atexit.unregister(gc.freeze)  # registered once, however often asked
    atexit.register(gc.freeze)


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reap(procs: list[subprocess.Popen], timeout: float) -> None:
    """Waits up to `timeout` seconds in all for procs to exit, then kills those still running."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
