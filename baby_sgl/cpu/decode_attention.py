"""The CPU decode-attention kernel (csrc/decode_attention.cpp), built once per CPU by
toolchain.build_extension. Without it the attention backend keeps its portable path (gather +
scaled_dot_product_attention)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from baby_sgl.cpu import toolchain

_SOURCE = Path(__file__).parent / "csrc" / "decode_attention.cpp"
_loaded: dict[str, ModuleType | None] = {}


def decode_kernel() -> ModuleType | None:
    """The built kernel module, or None (the reason logged once per process)."""
    if "decode" not in _loaded:
        _loaded["decode"] = toolchain.build_extension("baby_sgl_decode_attention", (_SOURCE,), "decode attention")
    return _loaded["decode"]
