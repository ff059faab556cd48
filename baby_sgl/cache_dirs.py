"""Where baby-sgl keeps what it builds once and reuses across runs: $BABY_SGL_CACHE, else
$XDG_CACHE_HOME/baby-sgl, else ~/.cache/baby-sgl. Under it: kernels/ (the CPU kernels, per torch
version and CPU), tokenizers/ and weights/ (GGUF files converted), inductor/ (torch.compile's
cache) and hf-from-gguf/ (the benchmarks' Hugging Face copy of a GGUF, for peers that need one)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("BABY_SGL_CACHE"):
        return Path(os.environ["BABY_SGL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "baby-sgl"
