"""LoRA adapters made with PEFT over the tiny checkpoints (tests/conftest.py), and PEFT's own
greedy ids with them: the reference the engine must reproduce."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from helpers import hf_greedy

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EVERY = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
# Phi-3's checkpoint has q/k/v and gate/up fused, so PEFT targets the fused projections.
PHI3_EVERY = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


@dataclass(frozen=True)
class AdapterSpec:
    r: int
    alpha: float
    targets: tuple[str, ...]
    rslora: bool = False


def make_adapter(base: str, path, spec: AdapterSpec, seed: int) -> str:
    """A PEFT LoRA adapter over `base` saved at `path`, its matrices random and large enough that
    greedy ids differ from the base model's."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.targets), use_rslora=spec.rslora,
                        lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft_model.save_pretrained(str(path))
    return str(path)


def peft_greedy(base: str, adapter: str | None, prompts: list[list[int]], max_new_tokens: int,
                base_dir: str | None = None) -> list[list[int]]:
    """transformers' greedy ids with the adapter applied by PEFT (None: the base model);
    base_dir: the weights to load, if not base's."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base_dir or base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    return hf_greedy(model, prompts, max_new_tokens)
