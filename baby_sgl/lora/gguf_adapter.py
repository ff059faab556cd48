"""llama.cpp's LoRA adapters: a GGUF file whose general.type is "adapter" and adapter.type "lora"
(as llama.cpp's convert_lora_to_gguf.py writes them), its pairs named <tensor>.lora_a and
<tensor>.lora_b after the base model's GGUF tensors, the scale adapter.lora.alpha / rank. Read as
PEFT's tensors, so the same checks and fusing follow (adapter.py)."""

from __future__ import annotations

import numpy as np
import torch

# GGUF's projection names -> PEFT's module paths (a layer's); Phi-3's fused gate/up is ffn_up.
_MODULES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
            "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_PHI3_MODULES = _MODULES | {"ffn_up": "mlp.gate_up_proj"}


def read_gguf_adapter(path: str, num_heads: int, num_kv_heads: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(a PEFT config, PEFT's tensors) of the adapter at `path`. llama.cpp's converter reorders
    a Llama's q and k rows for its rotary kernel (lora_b's rows, as the base weights'): they are
    put back in the checkpoint's order, as the base model's loader does."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)

    def meta(key: str) -> object:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    if meta("general.type") != "adapter" or meta("adapter.type") != "lora":
        raise ValueError(f"{path} is not a LoRA adapter (general.type {meta('general.type')!r}, "
                         f"adapter.type {meta('adapter.type')!r})")
    alpha = meta("adapter.lora.alpha")
    if not isinstance(alpha, int | float) or alpha <= 0:
        raise ValueError(f"{path}: adapter.lora.alpha must be a positive number, not {alpha!r}")
    arch = meta("general.architecture")
    modules = _PHI3_MODULES if arch == "phi3" else _MODULES
    tensors = {}
    for t in reader.tensors:
        parts = t.name.split(".")  # blk, layer, projection, weight, lora_a|lora_b
        if len(parts) != 5 or parts[0] != "blk" or parts[2] not in modules or parts[4] not in ("lora_a", "lora_b"):
            raise ValueError(f"{path}: unexpected tensor {t.name!r} (only blk.N.<projection>.weight.lora_a/_b)")
        values = np.require(dequantize(t.data, t.tensor_type), np.float32, "W")
        matrix = torch.from_numpy(values).reshape([int(d) for d in reversed(t.shape)])
        if arch == "llama" and parts[4] == "lora_b" and parts[2] in ("attn_q", "attn_k"):
            heads = num_heads if parts[2] == "attn_q" else num_kv_heads
            if matrix.dim() != 2 or matrix.shape[0] % (2 * heads):
                raise ValueError(f"{path}: {t.name} has shape {tuple(matrix.shape)}, not {heads} heads' rows")
            matrix = _unpermute_rows(matrix, heads)
        half = "A" if parts[4] == "lora_a" else "B"
        tensors[f"base_model.model.model.layers.{parts[1]}.{modules[parts[2]]}.lora_{half}.weight"] = matrix
    return {"lora_alpha": float(alpha)}, tensors


def _unpermute_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Each head's rows from llama.cpp's interleaved order back to the checkpoint's rotate-half one."""
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(rows.shape)
