"""A LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors) or llama.cpp's
(a .gguf file: gguf_adapter.py), read and checked against the base model, its matrices laid out as
the decoder's fused projections.

The decoder computes q/k/v in one product and gate/up in another (models/llama.py), so an
adapter's per-projection pairs are fused too: for a fused projection, A stacks the parts' A
matrices ([sum of ranks, in]) and B places each part's B in its rows and its own rank columns
(block-diagonal, [out, sum of ranks]), so x A^T B^T gives every part's delta in its rows. The
scale (alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into B. Phi-3's checkpoint is fused
already (qkv_proj, gate_up_proj): its adapters' pairs are one part each.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from baby_sgl.lora.gguf_adapter import read_gguf_adapter
from baby_sgl.model_config import ModelConfig

# The decoder's projections an adapter may change, and the capacity of each in ranks: a fused
# projection holds one rank budget per part.
MODULES = ("qkv", "o", "gate_up", "down")
RANK_SLOTS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}
# PEFT's target module names (as in the Hugging Face checkpoints) -> (our module, part).
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "qkv_proj": ("qkv", None),
           "o_proj": ("o", None), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
           "gate_up_proj": ("gate_up", None), "down_proj": ("down", None)}
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight: the module's path and which half.
_KEY = re.compile(r"(.*)\.lora_([AB])(?:\.\w+)?\.weight")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_CONFIG, _WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


class LoRAError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the problem."""


@dataclass(frozen=True)
class LoRABlock:
    """Where one part's pair sits in a fused delta: its rank columns of B and its output rows (B
    is zero outside its parts' blocks, so a product over the blocks alone gives the delta)."""

    ranks: slice
    outputs: slice


@dataclass(frozen=True)
class ModuleLoRA:
    """One fused projection's delta: x A^T B^T, float32, the scale folded into B."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]
    blocks: tuple[LoRABlock, ...]  # its parts' blocks of B, in rank order


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int  # the largest rank of its pairs
    targets: frozenset[str]  # PEFT's names of the projections it changes
    modules: dict[tuple[int, str], ModuleLoRA]  # (layer, module in MODULES) -> its delta

    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Each module's input width and the output rows of each of its parts."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (cfg.hidden_size, [q, kv, kv]), "o": (q, [cfg.hidden_size]),
            "gate_up": (cfg.hidden_size, [cfg.intermediate_size] * 2), "down": (cfg.intermediate_size, [cfg.hidden_size])}


def load_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int,
                 allowed_targets: frozenset[str] | None = None) -> LoRAAdapter:
    """Reads and checks the adapter at `path` (PEFT's directory, or llama.cpp's .gguf file) for
    the base model `cfg`: LoRAError naming the problem for a missing file, a rank above max_rank, a
    target module the decoder (or --lora-target-modules) does not take, or a matrix of the wrong
    shape."""
    config, tensors = _read_gguf(name, path, cfg) if path.endswith(".gguf") else _read_peft(name, path)
    pairs = _pairs(name, tensors)
    targets = frozenset(piece for _, piece in pairs)
    if allowed_targets is not None and not targets <= allowed_targets:
        raise LoRAError(f"LoRA adapter {name!r}: target module {sorted(targets - allowed_targets)[0]!r} is not in "
                        f"--lora-target-modules ({', '.join(sorted(allowed_targets))})")
    modules = _fuse(name, pairs, config, cfg, max_rank)
    rank = max((pair[0].shape[0] for pair in pairs.values()), default=0)
    return LoRAAdapter(name, path, rank, targets, modules)


def _read_peft(name: str, path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    config = _read_config(name, path)
    listed = config.get("target_modules")
    unknown = sorted(set(listed) - set(TARGETS)) if isinstance(listed, list) else []
    if unknown:
        raise LoRAError(f"LoRA adapter {name!r}: target module {unknown[0]!r} is not supported (supported: "
                        f"{', '.join(TARGETS)} of the decoder layers)")
    from safetensors.torch import load_file

    weights_path = os.path.join(path, _WEIGHTS)
    if not os.path.isfile(weights_path):
        raise LoRAError(f"LoRA adapter {name!r}: {weights_path} not found")
    return config, load_file(weights_path)


def _read_gguf(name: str, path: str, cfg: ModelConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """llama.cpp's LoRA GGUF (gguf_adapter.py)."""
    if not os.path.isfile(path):
        raise LoRAError(f"LoRA adapter {name!r}: {path} not found")
    try:
        return read_gguf_adapter(path, cfg.num_heads, cfg.num_kv_heads)
    except (OSError, ValueError, RuntimeError) as e:  # not an adapter, or a file the gguf reader cannot parse
        raise LoRAError(f"LoRA adapter {name!r}: {e}") from None


def _read_config(name: str, path: str) -> dict:
    config_path = os.path.join(path, _CONFIG)
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"LoRA adapter {name!r}: {config_path} not found") from None
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {config_path}: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: {config_path} is not a LoRA adapter's config")
    for option in ("use_dora", "modules_to_save", "alpha_pattern"):
        if config.get(option):
            raise LoRAError(f"LoRA adapter {name!r}: {option}={config[option]!r} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {name!r}: bias={config['bias']!r} is not supported")
    if not isinstance(config.get("lora_alpha", 8), int | float):
        raise LoRAError(f"LoRA adapter {name!r}: lora_alpha must be a number")
    return config


def _pairs(name: str, tensors: dict[str, torch.Tensor]) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, PEFT module name) -> (A, B), every tensor accounted for."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise LoRAError(f"LoRA adapter {name!r}: unexpected tensor {key!r} (only lora_A/lora_B weights)")
        piece, in_layer = m[1].rsplit(".", 1)[-1], _LAYER.search(m[1])
        if piece not in TARGETS or in_layer is None:
            raise LoRAError(f"LoRA adapter {name!r}: target module {piece!r} is not supported (supported: "
                            f"{', '.join(TARGETS)} of the decoder layers)")
        halves.setdefault((int(in_layer[1]), piece), {})[m[2]] = tensor
    pairs = {}
    for (layer, piece), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {piece} has lora_{next(iter(ab))} only")
        pairs[layer, piece] = (ab["A"].float(), ab["B"].float())
    return pairs


def _fuse(name: str, pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], config: dict,
          cfg: ModelConfig, max_rank: int) -> dict[tuple[int, str], ModuleLoRA]:
    shapes = module_shapes(cfg)
    parts: dict[tuple[int, str], list[tuple[int | None, torch.Tensor, torch.Tensor]]] = {}
    for (layer, piece), (a, b) in pairs.items():
        module, part = TARGETS[piece]
        where = f"LoRA adapter {name!r}: layer {layer} {piece}"
        if layer >= cfg.num_layers:
            raise LoRAError(f"{where}: the base model has {cfg.num_layers} layers")
        if module in ("gate_up", "down") and layer in cfg.moe_layers:
            raise LoRAError(f"{where}: a mixture-of-experts layer's MLP cannot take a LoRA adapter")
        rank = a.shape[0]
        if rank > max_rank:
            raise LoRAError(f"{where}: rank {rank} is above --max-lora-rank {max_rank}")
        in_features, outs = shapes[module]
        out = sum(outs) if part is None else outs[part]
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out, rank):
            raise LoRAError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base model "
                            f"(expected ({rank}, {in_features}) and ({out}, {rank}))")
        parts.setdefault((layer, module), []).append((part, a, b * _scale(config, rank)))
    return {key: _fused(shapes[key[1]][1], found) for key, found in parts.items()}


def _scale(config: dict, rank: int) -> float:
    alpha = float(config.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _fused(outs: list[int], found: list[tuple[int | None, torch.Tensor, torch.Tensor]]) -> ModuleLoRA:
    """The parts' pairs as one: A stacked, each B in its part's rows and its own rank columns."""
    starts = [sum(outs[:i]) for i in range(len(outs))]
    rank = sum(a.shape[0] for _, a, _ in found)
    b_fused = torch.zeros(sum(outs), rank, device="cpu")  # the host copy
    blocks, col = [], 0
    for part, a, b in found:
        row = 0 if part is None else starts[part]
        blocks.append(LoRABlock(slice(col, col + a.shape[0]), slice(row, row + b.shape[0])))
        b_fused[blocks[-1].outputs, blocks[-1].ranks] = b
        col += a.shape[0]
    return ModuleLoRA(torch.cat([a for _, a, _ in found]).contiguous(), b_fused, tuple(blocks))
