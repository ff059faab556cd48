"""baby-sgl: a compact, readable reimplementation of SGLang's LLM serving core."""

import os

# oneDNN (bfloat16 matmuls on CPU) keeps a compiled kernel, with its own reordered copy of the
# weights, for every input shape it meets, up to 1024 of them in each of two caches: a server
# seeing every prompt length grew by hundreds of MB that way. 64 holds every shape of a few
# steps; these are read once, when the first such matmul runs.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
os.environ.setdefault("LRU_CACHE_CAPACITY", "64")

from baby_sgl.engine import Engine  # noqa: E402
from baby_sgl.core.sampling_params import SamplingParams  # noqa: E402
from baby_sgl.server_args import EngineArgs, ServerArgs  # noqa: E402

__all__ = ["Engine", "EngineArgs", "SamplingParams", "ServerArgs"]
