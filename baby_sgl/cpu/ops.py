"""Our compiled CPU ops (csrc/): the linear layer over stored weights (float32, bfloat16 or GGUF's
quantized blocks), one-pass RMSNorm and SiLU-and-mul, prefill attention over the paged pool
(ops.cpp) and the one-call decode step (cpu_step.cpp). Built once per CPU by
toolchain.build_extension; None without a compiler, and then quantized weights are dequantized at
load and everything runs op by op in torch."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from baby_sgl.cpu import toolchain

NAME = "baby_sgl_cpu_ops"
SOURCES = (Path(__file__).parent / "csrc" / "cpu_step.cpp", Path(__file__).parent / "csrc" / "ops.cpp")
_loaded: dict[str, ModuleType | None] = {}


def cpu_ops() -> ModuleType | None:
    if "ops" not in _loaded:
        _loaded["ops"] = toolchain.build_extension(NAME, SOURCES, "quantized weights and the decode step")
    return _loaded["ops"]
