from __future__ import annotations

from baby_sgl.model_config import ModelConfig
from baby_sgl.models.llama import LlamaForCausalLM, Qwen2ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def get_model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    try:
        return MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}; supported: {sorted(MODEL_REGISTRY)}") from None
