"""Writes a Hugging Face checkpoint's configuration and tensor names as a GGUF file lays them out
(llama.cpp's converter): the inverse of gguf_loader.py, for checkpoints built here (bench/checkpoints.py)."""

from __future__ import annotations

import math
from typing import TypeVar

import numpy as np
import torch
from gguf import GGUFWriter, RopeScalingType

_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
          "block_sparse_moe.gate": "ffn_gate_inp", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
# Hugging Face model_type -> llama.cpp's architecture (Mixtral is llama with experts).
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "mixtral": "llama",
             "phi3": "phi3", "gemma3_text": "gemma3"}
# Gemma's norms as llama.cpp names them (its ffn_norm is the pre-MLP norm).
_GEMMA = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
          "post_feedforward_layernorm": "post_ffw_norm"}

Rows = TypeVar("Rows", np.ndarray, torch.Tensor)


def gguf_tensor_name(hf: str, gemma: bool = False) -> str:
    name, _, suffix = hf.removeprefix("model.").rpartition(".")
    top = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}
    if name in top:
        return f"{top[name]}.{suffix}"
    _, layer, rest = name.split(".", 2)
    return f"blk.{layer}.{(_LAYER | _GEMMA)[rest] if gemma else _LAYER[rest]}.{suffix}"


def permute_rows(rows: Rows, heads: int) -> Rows:
    """llama.cpp's reordering of a Llama head's Q/K rows (rotate-half -> interleaved); whole rows
    move, so quantized rows move as their blocks."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def permuted_for_llama_cpp(cfg: dict, hf_name: str) -> bool:
    return GGUF_ARCH[cfg["model_type"]] == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name)


def new_gguf_writer(path: str, cfg: dict) -> GGUFWriter:
    """A writer with the architecture's hyperparameters from a Hugging Face config.json dict."""
    w = GGUFWriter(path, GGUF_ARCH[cfg["model_type"]])
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
    if cfg["model_type"] == "gemma3_text":  # the global layers' rope (scaled) and the windowed layers' own base
        _add_gemma3(w, cfg)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        w.add_expert_weights_norm(cfg.get("norm_topk_prob", True))
    return w


def _add_gemma3(w: GGUFWriter, cfg: dict) -> None:
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
