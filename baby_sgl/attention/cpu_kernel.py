"""The CPU decode-attention kernel (csrc/decode_attention.cpp): built once per CPU with the
machine's C++ compiler through torch's extension loader (-O3 -march=native, OpenMP through
ATen's thread pool), kept in ~/.cache/baby-sgl/kernels. Without a compiler, or if the build
fails, the attention backend keeps its portable path (gather + scaled_dot_product_attention)
and says so once."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from baby_sgl.toolchain import cpu_fingerprint, cxx_compiler

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "decode_attention.cpp"
_loaded: dict[str, ModuleType | None] = {}


def cache_dir() -> Path:
    root = Path(os.environ.get("BABY_SGL_CACHE", Path.home() / ".cache" / "baby-sgl"))
    return root / "kernels" / f"torch-{torch.__version__}-{cpu_fingerprint()}"


def decode_kernel() -> ModuleType | None:
    """The built kernel module, or None (the reason logged once per process)."""
    if "decode" not in _loaded:
        _loaded["decode"] = _build()
    return _loaded["decode"]


def _build() -> ModuleType | None:
    if cxx_compiler() is None:
        logger.warning("no C++ compiler found (g++, c++ or clang++): decode attention takes the portable path")
        return None
    try:
        from torch.utils.cpp_extension import load

        build = cache_dir()
        build.mkdir(parents=True, exist_ok=True)
        logger.info("loading the CPU decode attention kernel (built once into %s)", build)
        return load("baby_sgl_decode_attention", [str(_SOURCE)], build_directory=str(build),
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as e:  # a missing ninja, an old compiler: run, slower, rather than fail
        logger.warning("could not build the CPU decode attention kernel (%s); decode attention takes the "
                       "portable path", str(e).splitlines()[0] if str(e) else repr(e))
        return None
