"""Splitting this process's cores between the processes it starts (data-parallel workers,
tensor-parallel ranks), so their torch threads do not compete for the same cores."""

from __future__ import annotations

import os
from collections.abc import Callable


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


def pin_to(cores: list[int]) -> Callable[[], None] | None:
    """A preexec_fn that keeps a child process on these cores (None where the OS has no affinity)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, cores)
