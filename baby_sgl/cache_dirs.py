"""Where baby-sgl keeps what it builds once and reuses across runs: $BABY_SGL_CACHE, else
$XDG_CACHE_HOME/baby-sgl, else ~/.cache/baby-sgl. Under it: kernels/ (the CPU kernels, one
directory per build, named by a hash of what it depends on: cpu/toolchain.py), tokenizers/ and
weights/ (GGUF files converted, named by a hash of the file's contents; keys/ holds each path's
hash), inductor/ (torch.compile's cache), hf-from-gguf/ (the
benchmarks' Hugging Face copy of a GGUF, for peers that need one) and checkpoints/ (the
benchmarks' random-weight checkpoints of real models' shapes, bench/checkpoints.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("BABY_SGL_CACHE"):
        return Path(os.environ["BABY_SGL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "baby-sgl"


def write_atomically(target: str, write: Callable[[str], object]) -> None:
    """Has `write` create a file or dir at a fresh path beside `target`, then renames it into place, so
    a crash never leaves a half-written cache entry. Concurrent writers produce the same content, so
    losing the race for a directory (rename refuses a non-empty target) is fine."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    scratch = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".tmp-")
    try:
        tmp = os.path.join(scratch, "out")
        write(tmp)
        os.rename(tmp, target)
    except OSError:
        if not os.path.exists(target):
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
