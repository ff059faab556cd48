"""baby-sgl: a compact, readable reimplementation of SGLang's LLM serving core.

The public names load on first use, so a tensor-parallel rank (distributed/tp_worker.py), which
imports this package, loads none of the engine, its server or their libraries: a tp=2 engine
reached its first request in 3.6 s instead of 5.3-5.7 s (2-core AMD EPYC Zen 3, avx2)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from baby_sgl import native_env  # noqa: F401  (first: it sets what torch reads as it loads)

if TYPE_CHECKING:
    from baby_sgl.core.sampling_params import SamplingParams
    from baby_sgl.engine import Engine
    from baby_sgl.server_args import EngineArgs, ServerArgs

_HOMES = {"Engine": "baby_sgl.engine", "EngineArgs": "baby_sgl.server_args",
          "SamplingParams": "baby_sgl.core.sampling_params", "ServerArgs": "baby_sgl.server_args"}

__all__ = ["Engine", "EngineArgs", "SamplingParams", "ServerArgs"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'baby_sgl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # found here from now on, without this call
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
