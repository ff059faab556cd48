"""baby-sgl: a compact, readable reimplementation of SGLang's LLM serving core."""

from baby_sgl import native_env  # noqa: F401  (first: it sets what torch reads as it loads)
from baby_sgl.engine import Engine  # noqa: E402
from baby_sgl.core.sampling_params import SamplingParams  # noqa: E402
from baby_sgl.server_args import EngineArgs, ServerArgs  # noqa: E402

__all__ = ["Engine", "EngineArgs", "SamplingParams", "ServerArgs"]
