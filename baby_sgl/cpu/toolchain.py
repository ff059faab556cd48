"""The machine's C++ toolchain, which torch.compile's CPU backend and our CPU kernels need, and the
one way our kernels are built: once per CPU with the machine's compiler through torch's extension
loader (-O3 -march=native, OpenMP from torch's own runtime), kept in the cache's kernels/ (cache_dirs.py)
under a name made from what the build depends on (build_key), so checkouts and environments on one
machine share a build when their sources are equal and never overwrite each other's.
Without a compiler, or if a build fails, the caller keeps its portable path and says so once."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import re
import shutil
import sysconfig
from collections.abc import Iterator, Sequence
from importlib import util as import_util
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
    return cache_root() / "kernels"


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


def _cflags(arch: str) -> list[str]:
    return ["-O3", f"-march={arch}", "-fopenmp"]


def _inputs(sources: Sequence[Path]) -> list[Path]:
    """What a build reads: its sources and every header beside them."""
    headers = {h for s in sources for h in s.parent.glob("*.h")}
    return sorted({*sources, *headers}, key=lambda p: p.name)


def build_key(name: str, sources: Sequence[Path], arch: str) -> str:
    """Names a build by everything its binary depends on: the contents (not the paths) of its
    inputs, the compiler and its flags, this CPU, torch's version and Python's extension ABI.
    Equal sources in two checkouts give one key; any difference, another."""
    h = hashlib.sha256()
    for part in (name, cxx_compiler() or "", *_cflags(arch), cpu_fingerprint(), torch.__version__,
                 sysconfig.get_config_var("EXT_SUFFIX") or ""):
        h.update(part.encode() + b"\0")
    for path in _inputs(sources):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def module_name(name: str) -> str:
    """The extension's name for target_arch(): each instruction set its own module."""
    arch = target_arch()
    return name if arch == "native" else f"{name}_{re.sub(r'[^A-Za-z0-9]', '_', arch)}"


def build_dir(name: str, sources: Sequence[Path]) -> Path:
    """Where `name` built from `sources` for target_arch() is kept."""
    return kernel_cache_dir() / f"{module_name(name)}-{build_key(module_name(name), sources, target_arch())}"


def _copy_inputs(sources: Sequence[Path], into: Path) -> list[Path]:
    """The build's own copy of its inputs, so that its command lines, which name them, are the
    same from every checkout (torch's loader rebuilds when they change). Returns the sources'."""
    into.mkdir(exist_ok=True)
    for path in _inputs(sources):
        data = path.read_bytes()
        if not (into / path.name).is_file() or (into / path.name).read_bytes() != data:  # a copy cut short
            (into / f"{path.name}.tmp").write_bytes(data)
            os.replace(into / f"{path.name}.tmp", into / path.name)
    return [into / s.name for s in sources]


def _load_built(build: Path) -> ModuleType | None:
    """The module a finished build left in `build` (its file named in `built`), or None: then
    it is built (again, if what was left does not load). The module's name is its file's: torch's
    loader names a second build of one name in a process NAME_v1."""
    stamp = build / "built"
    if not stamp.is_file():
        return None
    file = stamp.read_text()
    spec = import_util.spec_from_file_location(file.split(".")[0], build / file)
    if spec is None or spec.loader is None:
        return None
    module = import_util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        logger.warning("rebuilding %s: %s", build, e)
        return None
    return module


def build_extension(name: str, sources: tuple[Path, ...], purpose: str) -> ModuleType | None:
    """The extension built from `sources` for target_arch(), or None (the reason logged): then
    `purpose` takes its portable path. Callers keep the result, so each build is tried once per
    process."""
    if cxx_compiler() is None:
        logger.warning("no C++ compiler found (g++, c++ or clang++): %s takes the portable path", purpose)
        return None
    try:
        from torch.utils.cpp_extension import load

        build = build_dir(name, sources)
        build.mkdir(parents=True, exist_ok=True)
        logger.info("loading the CPU kernels for %s (built once into %s)", purpose, build)
        with _build_lock(build):
            if (built := _load_built(build)) is not None:
                return built
            copies = _copy_inputs(sources, build / "src")
            module = load(module_name(name), [str(c) for c in copies], build_directory=str(build),
                          extra_include_paths=[str(build / "src")], extra_cflags=_cflags(target_arch()),
                          extra_ldflags=["-fopenmp"])
            (build / "built.tmp").write_text(Path(str(module.__file__)).name)
            os.replace(build / "built.tmp", build / "built")  # only a finished build is stamped
            return module
    except Exception as e:  # a missing ninja, an old compiler: run, slower, rather than fail
        logger.warning("could not build the CPU kernels for %s (%s); it takes the portable path", purpose,
                       str(e).splitlines()[0] if str(e) else repr(e))
        return None
