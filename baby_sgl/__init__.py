"""baby-sgl: a compact, readable reimplementation of SGLang's LLM serving core."""

from baby_sgl.engine import Engine
from baby_sgl.sampling.sampling_params import SamplingParams
from baby_sgl.server_args import ServerArgs

__all__ = ["Engine", "SamplingParams", "ServerArgs"]
