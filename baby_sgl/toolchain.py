"""The machine's C++ toolchain, which torch.compile's CPU backend and our CPU kernel need."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil


def cxx_compiler() -> str | None:
    return next((path for name in (os.environ.get("CXX"), "g++", "c++", "clang++") if name
                 and (path := shutil.which(name))), None)


def cpu_fingerprint() -> str:
    """Short id of this CPU's model and instruction sets: code built with -march=native is kept
    per CPU, so a cache shared by different machines never runs code the CPU lacks."""
    try:
        with open("/proc/cpuinfo") as f:
            info = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        info = [platform.processor()]
    return hashlib.sha256("".join(info).encode()).hexdigest()[:12]
