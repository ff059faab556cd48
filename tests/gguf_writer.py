"""Writes a tiny Hugging Face checkpoint (from conftest) as a GGUF file with matrices quantized by the
`gguf` package (the layout is baby_sgl.model_loader.gguf_writer's), and gives the float32 weights those
blocks stand for."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize
from safetensors.torch import load_file

from kquant_encoder import encode

from baby_sgl.model_loader.gguf_writer import (GGUF_ARCH, gguf_tensor_name, new_gguf_writer, permute_rows,
                                              permuted_for_llama_cpp)

# An expert's matrix name (Qwen3-MoE's, Mixtral's) -> the stacked tensor that holds every expert's.
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
            "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def write_tiny_gguf(hf_dir: str, path: str, qtype: GGMLQuantizationType,
                    embed_qtype: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
                    type_of: Callable[[str], GGMLQuantizationType] | None = None) -> dict[str, torch.Tensor]:
    """Every 2-D weight quantized (the embedding as embed_qtype), or each as type_of(its Hugging Face
    name) says; returns the Hugging Face state dict with those matrices replaced by their dequantized
    values (what transformers should compute with)."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    w = new_gguf_writer(path, cfg)
    gemma = cfg["model_type"] == "gemma3_text"
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        vocab = json.load(f)["model"]["vocab"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])])
    w.add_token_types([3 if i < 3 else 1 for i in range(len(vocab))])
    w.add_token_scores([0.0] * len(vocab))  # no merges: transformers derives them (none) from these
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    reference = {}
    stacks: dict[str, list[tuple[int, str, np.ndarray]]] = {}
    for hf_name, tensor in state.items():
        if ".experts." in hf_name:  # stacked per layer below, as llama.cpp's converter does
            layer, expert, proj = hf_name.split(".")[2], int(hf_name.split(".")[-3]), hf_name.split(".")[-2]
            stacks.setdefault(f"blk.{layer}.{_EXPERTS[proj]}.weight", []).append((expert, hf_name,
                                                                                  tensor.float().numpy()))
            continue
        data = tensor.float().numpy()
        if data.ndim == 2:
            kind = type_of(hf_name) if type_of else embed_qtype if "embed_tokens" in hf_name else qtype
            blocks = encode(data, kind)
            reference[hf_name] = torch.from_numpy(dequantize(blocks, kind).reshape(data.shape).astype(np.float32))
            if permuted_for_llama_cpp(cfg, hf_name):
                heads = cfg["num_attention_heads" if ".q_proj." in hf_name else "num_key_value_heads"]
                blocks = permute_rows(blocks, heads)
            w.add_tensor(gguf_tensor_name(hf_name, gemma), blocks, raw_shape=blocks.shape, raw_dtype=kind)
        else:
            reference[hf_name] = tensor.float()
            if gemma and hf_name.endswith("norm.weight"):  # llama.cpp stores Gemma's norms as 1 + weight
                data = data + 1
            w.add_tensor(gguf_tensor_name(hf_name, gemma), data)
    for gguf_name, parts in stacks.items():
        parts.sort()
        blocks = encode(np.stack([m for _, _, m in parts]), qtype)
        values = dequantize(blocks, qtype).reshape(len(parts), *parts[0][2].shape).astype(np.float32)
        for (_, hf_name, _), v in zip(parts, values):
            reference[hf_name] = torch.from_numpy(v.copy())
        w.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference


def write_lora_gguf(hf_dir: str, peft_dir: str, path: str) -> None:
    """The PEFT adapter at peft_dir (over the checkpoint at hf_dir) as llama.cpp's converter writes a
    LoRA GGUF: general.type adapter, adapter.type lora, adapter.lora.alpha (times sqrt(r) for
    rsLoRA: llama.cpp scales by alpha / r), each pair as <base tensor>.lora_a / .lora_b in float32,
    lora_b's q and k rows reordered as the base model's."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(peft_dir, "adapter_config.json")) as f:
        config = json.load(f)
    w = GGUFWriter(path, GGUF_ARCH[cfg["model_type"]])
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", config["lora_alpha"] * (config["r"] ** 0.5 if config.get("use_rslora") else 1))
    for key, tensor in sorted(load_file(os.path.join(peft_dir, "adapter_model.safetensors")).items()):
        module, half = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        hf_name = f"{module}.weight"
        matrix = tensor.float().numpy()
        if half.startswith("B") and permuted_for_llama_cpp(cfg, hf_name):
            matrix = permute_rows(matrix, cfg["num_attention_heads" if ".q_proj." in hf_name else "num_key_value_heads"])
        w.add_tensor(f"{gguf_tensor_name(hf_name)}.lora_{half[0].lower()}", np.ascontiguousarray(matrix))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
