"""Writes a tiny Hugging Face checkpoint (from conftest) as a GGUF file with quantized matrices, the
way llama.cpp's converter lays it out, and gives the float32 weights those blocks stand for."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
          "block_sparse_moe.gate": "ffn_gate_inp", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
# Hugging Face model_type -> llama.cpp's architecture (Mixtral is llama with experts).
_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "mixtral": "llama",
         "phi3": "phi3", "gemma3_text": "gemma3"}
# Gemma's norms as llama.cpp names them (its ffn_norm is the pre-MLP norm).
_GEMMA = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
          "post_feedforward_layernorm": "post_ffw_norm"}
# An expert's matrix name (Qwen3-MoE's, Mixtral's) -> the stacked tensor that holds every expert's.
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
            "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def _gguf_name(hf: str, gemma: bool = False) -> str:
    name, _, suffix = hf.removeprefix("model.").rpartition(".")
    top = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}
    if name in top:
        return f"{top[name]}.{suffix}"
    _, layer, rest = name.split(".", 2)
    return f"blk.{layer}.{(_LAYER | _GEMMA)[rest] if gemma else _LAYER[rest]}.{suffix}"


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's reordering of a Llama head's Q/K rows (rotate-half -> interleaved)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_tiny_gguf(hf_dir: str, path: str, qtype: GGMLQuantizationType,
                    embed_qtype: GGMLQuantizationType = GGMLQuantizationType.Q8_0) -> dict[str, torch.Tensor]:
    """Every 2-D weight quantized (the embedding as embed_qtype); returns the Hugging Face state dict
    with those matrices replaced by their dequantized values (what transformers should compute with)."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = _ARCH[cfg["model_type"]]
    w = GGUFWriter(path, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg["model_type"] != "gemma3_text":  # Gemma's two bases are written below
        w.add_rope_freq_base(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    partial = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0
    if partial != 1.0:
        w.add_rope_dimension_count(int(cfg["hidden_size"] // cfg["num_attention_heads"] * partial))
    if cfg.get("sliding_window") and cfg["model_type"] == "phi3":
        w.add_sliding_window(cfg["sliding_window"])
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type") == "longrope":  # Phi-3: its factors as tensors, as llama.cpp's converter writes them
        original = rope["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(cfg["max_position_embeddings"] / original)
                                                  / math.log(original)))
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    gemma = arch == "gemma3"
    if gemma:  # the global layers' rope (scaled) and the windowed layers' own base, as llama.cpp writes them
        full, local = cfg["rope_parameters"]["full_attention"], cfg["rope_parameters"]["sliding_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_freq_base_swa(local["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
        w.add_attention_scale(cfg["query_pre_attn_scalar"] ** -0.5)
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        w.add_expert_weights_norm(cfg.get("norm_topk_prob", True))
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
            kind = embed_qtype if "embed_tokens" in hf_name else qtype
            blocks = quantize(data, kind)
            reference[hf_name] = torch.from_numpy(dequantize(blocks, kind).reshape(data.shape).astype(np.float32))
            if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
                heads = cfg["num_attention_heads" if ".q_proj." in hf_name else "num_key_value_heads"]
                blocks = _permute(blocks, heads)
            w.add_tensor(_gguf_name(hf_name, gemma), blocks, raw_shape=blocks.shape, raw_dtype=kind)
        else:
            reference[hf_name] = tensor.float()
            if gemma and hf_name.endswith("norm.weight"):  # llama.cpp stores Gemma's norms as 1 + weight
                data = data + 1
            w.add_tensor(_gguf_name(hf_name, gemma), data)
    for gguf_name, parts in stacks.items():
        parts.sort()
        blocks = quantize(np.stack([m for _, _, m in parts]), qtype)
        values = dequantize(blocks, qtype).reshape(len(parts), *parts[0][2].shape).astype(np.float32)
        for (_, hf_name, _), v in zip(parts, values):
            reference[hf_name] = torch.from_numpy(v.copy())
        w.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference
