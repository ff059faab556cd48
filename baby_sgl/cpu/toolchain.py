"""The machine's C++ toolchain, which torch.compile's CPU backend and our CPU kernels need, and the
one way our kernels are built: once per CPU with the machine's compiler through torch's extension
loader (-O3 -march=native, OpenMP from torch's own runtime), kept in the cache's kernels/ (cache_dirs.py).
Without a compiler, or if a build fails, the caller keeps its portable path and says so once."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from baby_sgl.cache_dirs import cache_root

logger = logging.getLogger(__name__)


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


def cpu_has_native_bf16() -> bool:
    """avx512_bf16 or AMX: the CPU multiplies bfloat16 itself, without converting to float32."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private, so looked up
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def kernel_cache_dir() -> Path:
    return cache_root() / "kernels" / f"torch-{torch.__version__}-{cpu_fingerprint()}"


def target_arch() -> str:
    """The instruction set our kernels are built for: this CPU's own (-march=native) unless
    BABY_SGL_CPU_ARCH names another (e.g. x86-64-v3 for AVX2, x86-64 for the portable path: the
    tests build those too, so every path is checked on whatever machine runs them)."""
    return os.environ.get("BABY_SGL_CPU_ARCH", "native")


@contextlib.contextmanager
def _build_lock(build: Path) -> Iterator[None]:
    """One builder of `build` at a time across processes, by a lock the OS drops when its holder
    dies. torch's loader has its own lock, a file that a killed builder leaves behind (a server
    stopped while it loads, a daemon thread ended at exit), after which every later load waits
    for it forever. Whoever holds ours is the only builder, so a torch lock file found then is
    stale and is removed."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock only
        yield
        return
    with open(build / "build.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = build / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_extension(name: str, sources: tuple[Path, ...], purpose: str) -> ModuleType | None:
    """The extension built from `sources` for target_arch(), or None (the reason logged): then
    `purpose` takes its portable path. Callers keep the result, so each build is tried once per
    process."""
    if cxx_compiler() is None:
        logger.warning("no C++ compiler found (g++, c++ or clang++): %s takes the portable path", purpose)
        return None
    try:
        from torch.utils.cpp_extension import load

        arch = target_arch()
        if arch != "native":
            name = f"{name}_{re.sub(r'[^A-Za-z0-9]', '_', arch)}"
        build = kernel_cache_dir() / name
        build.mkdir(parents=True, exist_ok=True)
        logger.info("loading the CPU kernels for %s (built once into %s)", purpose, build)
        with _build_lock(build):
            return load(name, [str(s) for s in sources], build_directory=str(build),
                        extra_include_paths=sorted({str(s.parent) for s in sources}),
                        extra_cflags=["-O3", f"-march={arch}", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as e:  # a missing ninja, an old compiler: run, slower, rather than fail
        logger.warning("could not build the CPU kernels for %s (%s); it takes the portable path", purpose,
                       str(e).splitlines()[0] if str(e) else repr(e))
        return None
