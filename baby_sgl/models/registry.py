from __future__ import annotations

from baby_sgl.model_config import ModelConfig
from baby_sgl.models.llama import LlamaForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    # The same decoder; model_config.py turns on what differs (q/k norms, experts, the window).
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": LlamaForCausalLM,
}


def get_model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    try:
        return MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}; supported: {sorted(MODEL_REGISTRY)}") from None
