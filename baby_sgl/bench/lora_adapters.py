"""`baby-sgl bench offline --lora`: random LoRA adapters in PEFT's format for the benchmarked
model (every projection of every layer, attention only in a mixture-of-experts layer), written
once into the cache, loaded into the engine with their load time and size measured."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from baby_sgl.cache_dirs import cache_root
from baby_sgl.engine import Engine
from baby_sgl.lora.adapter import module_shapes
from baby_sgl.model_config import ModelConfig

_PIECES = {"q_proj": ("self_attn", "qkv", 0), "k_proj": ("self_attn", "qkv", 1), "v_proj": ("self_attn", "qkv", 2),
           "o_proj": ("self_attn", "o", 0), "gate_proj": ("mlp", "gate_up", 0), "up_proj": ("mlp", "gate_up", 1),
           "down_proj": ("mlp", "down", 0)}


def random_adapter(cfg: ModelConfig, rank: int, seed: int, path: Path) -> Path:
    """A PEFT adapter of this rank on every projection (written once; the same seed, the same one)."""
    if (path / "adapter_model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes, tensors = module_shapes(cfg), {}
    for layer in range(cfg.num_layers):
        for piece, (block, module, part) in _PIECES.items():
            if block == "mlp" and layer in cfg.moe_layers:
                continue
            in_features, outs = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{piece}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=g, device="cpu") / in_features**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(outs[part], rank, generator=g, device="cpu") * 0.01
    save_file(tensors, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(_PIECES),
              "bias": "none", "use_rslora": False}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def load_random_adapters(engine: Engine, count: int, rank: int) -> dict:
    """Loads `count` random adapters into the engine; their names, the mean load time and size."""
    cfg = engine.model_config
    root = cache_root() / "lora" / f"{cfg.architecture}-{cfg.hidden_size}x{cfg.num_layers}-r{rank}"
    paths = [str(random_adapter(cfg, rank, i, root / f"bench{i}")) for i in range(count)]
    answers = [engine.load_lora_adapter(f"bench{i}", path) for i, path in enumerate(paths)]
    return {"names": [f"bench{i}" for i in range(count)], "paths": paths,
            "adapter_load_s": sum(a["load_time_s"] for a in answers) / count,
            "adapter_mb": sum(a["adapter_bytes"] for a in answers) / count / 1e6,
            "adapter_slot_mb": engine.runner.lora_pool.slot_bytes() / 1e6 if engine.runner.lora_pool else 0.0}
