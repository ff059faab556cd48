"""Reads a GGUF file (llama.cpp's format) as a Hugging Face checkpoint: a config.json-like dict built
from its metadata, weights with Hugging Face names, and a Hugging Face tokenizer converted from its
vocabulary. The weights come either as they are stored (the block formats our CPU kernel reads,
layers/quantization.py, as their blocks; other types dequantized) or all dequantized to float32 with the `gguf` package.

Converting is slow next to loading (the tokenizer alone takes ~10 s), so the tokenizer and the float32
weights are cached under the cache's tokenizers/ and weights/ (cache_dirs.py), keyed by the file's path, size
and mtime. Blocks are read straight from the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file

from baby_sgl.cache_dirs import cache_root, write_atomically
from baby_sgl.layers.quantization import BLOCK_BYTES, DENSE_WEIGHT_TYPES, QuantizedWeight, WeightType, block_values
from baby_sgl.model_loader.gguf_header import GGUFTensor, read_gguf_header

logger = logging.getLogger(__name__)

# Part of the cache key: bump it whenever the conversion's output changes, so stale caches are ignored.
_CACHE_VERSION = 2

# llama.cpp's architecture names; "llama" with experts is Mixtral.
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "qwen3moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3 stores q/k/v fused (and gate/up fused as ffn_up)
}
# Gemma 3's norms around attention and the MLP (llama.cpp's ffn_norm is its pre-MLP norm there).
_GEMMA_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
# A mixture of experts' matrices, stacked in one tensor per layer: their per-expert names.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# Mixtral's own names for the same.
_MIXTRAL_NAMES = {".mlp.gate.": ".block_sparse_moe.gate.", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# llama.cpp keeps Llama 3.1's rope scaling as this tensor of per-frequency divisors, not as metadata.
_ROPE_FREQS = "rope_freqs.weight"
_LONGROPE_FACTORS = {"long_factor": "rope_factors_long.weight", "short_factor": "rope_factors_short.weight"}


# GGUF block formats the CPU kernel multiplies as they are.
_KEPT_QUANTIZED = {getattr(GGMLQuantizationType, t.name): t for t in WeightType if t not in DENSE_WEIGHT_TYPES}


def load_gguf(path: str, quantized: bool = False) -> tuple[dict, dict[str, torch.Tensor | QuantizedWeight], str]:
    """Returns (hf_config, state_dict with Hugging Face names, tokenizer_dir): float32 tensors, or
    with `quantized` the matrices in a format our kernel reads as QuantizedWeight."""
    path = os.path.abspath(path)
    root = str(cache_root())
    key = _cache_key(path)
    weights_file = os.path.join(root, "weights", f"{key}.safetensors")
    config_file = os.path.join(root, "weights", f"{key}.json")

    have_weights = os.path.isfile(weights_file) and os.path.isfile(config_file)
    if not have_weights:
        logger.info("converting %s to a Hugging Face checkpoint (once; cached under %s)", path, root)
    tokenizer_dir = converted_tokenizer(path)
    if quantized:
        config, state_dict = _convert_weights(path, keep_quantized=True)
        return config, state_dict, tokenizer_dir
    if have_weights:
        with open(config_file) as f:
            cached: dict[str, torch.Tensor | QuantizedWeight] = dict(load_file(weights_file))
            return json.load(f), cached, tokenizer_dir

    config, state_dict = _convert_weights(path)
    dense = cast(dict[str, torch.Tensor], state_dict)  # nothing kept quantized
    write_atomically(weights_file, lambda tmp: save_file(dense, tmp))
    # The config goes last: its presence tells a later load that the weights file is complete.
    write_atomically(config_file, lambda tmp: _write_json(config, tmp))
    return config, state_dict, tokenizer_dir


def converted_tokenizer(path: str) -> str:
    """The GGUF file's tokenizer as a Hugging Face tokenizer directory: converted by transformers
    the first time (seconds: it reads the whole vocabulary), then read from the cache."""
    path = os.path.abspath(path)
    tokenizer_dir = os.path.join(str(cache_root()), "tokenizers", _cache_key(path))
    if not os.path.isdir(tokenizer_dir):
        logger.info("converting the tokenizer of %s (once; cached in %s)", path, tokenizer_dir)
        write_atomically(tokenizer_dir, lambda tmp: convert_tokenizer(path, tmp))
    return tokenizer_dir


def _cache_key(path: str) -> str:
    """Names a GGUF's converted tokenizer and weights by the file's contents, so that copies of one
    file (the default model installed in a second virtual environment, a reinstall, a file moved)
    share them instead of each adding its own (a float32 copy of a 1.7B model is 6.8 GB). The key
    of each (path, size, mtime) is kept under keys/, so a file is read for its hash once (~1.5 s
    a GB)."""
    st = os.stat(path)
    known = cache_root() / "keys" / hashlib.sha1(
        repr((path, st.st_size, st.st_mtime_ns, _CACHE_VERSION)).encode()).hexdigest()
    if known.is_file():  # written whole (write_atomically)
        return known.read_text()
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    key = hashlib.sha1(repr((digest, st.st_size, _CACHE_VERSION)).encode()).hexdigest()
    write_atomically(str(known), lambda tmp: Path(tmp).write_text(key))
    return key


def _write_json(obj: Any, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def convert_tokenizer(path: str, out_dir: str) -> None:
    """The GGUF file's vocabulary as a Hugging Face tokenizer directory."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    # Keep the chat template inside tokenizer_config.json (not a separate chat_template.jinja), where
    # readers of the directory other than recent transformers also look for it.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)


def _convert_weights(path: str, keep_quantized: bool = False) \
        -> tuple[dict[str, Any], dict[str, torch.Tensor | QuantizedWeight]]:
    header = read_gguf_header(path)
    tensors = {t.name: t for t in header.tensors}
    config = _hf_config(header.metadata, tensors)
    state_dict: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name, tensor in tensors.items():
        if name in (_ROPE_FREQS, *_LONGROPE_FACTORS.values()):  # already folded into config["rope_scaling"]
            continue
        # GGUF lists dimensions innermost first; Hugging Face (and numpy) outermost first: [out, in].
        shape = [int(d) for d in reversed(tensor.shape)]
        if name.split(".")[-2] in _EXPERT_NAMES:  # [experts, out, in]: one matrix per expert, dense
            stacked = torch.from_numpy(np.require(dequantize(tensor.data, tensor.tensor_type), np.float32, "W"))
            for e, matrix in enumerate(stacked.reshape(shape)):
                state_dict[_expert_name(name, e, config["architectures"][0])] = matrix.clone()
            continue
        hf_name = _hf_name(name, _GEMMA_NAMES if config["model_type"] == "gemma3_text" else {})
        if config["model_type"] == "phi3":
            hf_name = hf_name.replace(".mlp.up_proj.", ".mlp.gate_up_proj.")
        if config["architectures"][0] == "MixtralForCausalLM":
            hf_name = hf_name.replace(".mlp.gate.", _MIXTRAL_NAMES[".mlp.gate."])
        weight: torch.Tensor | QuantizedWeight
        if keep_quantized and tensor.tensor_type in _KEPT_QUANTIZED and len(shape) == 2:
            qtype = _KEPT_QUANTIZED[tensor.tensor_type]
            per_block = block_values(qtype)
            if shape[1] % per_block or tensor.data.nbytes != shape[0] * shape[1] // per_block * BLOCK_BYTES[qtype]:
                raise ValueError(f"GGUF tensor {name}: {qtype.name} rows of {shape[1]} values must be whole blocks of "
                                 f"{per_block} ({BLOCK_BYTES[qtype]} bytes each); the file holds "
                                 f"{tensor.data.nbytes} bytes for {shape[0]} rows")
            # One row of blocks per output row; np.array copies it out of the read-only file map.
            weight = QuantizedWeight(torch.from_numpy(np.array(tensor.data)).reshape(shape[0], -1), qtype,
                                     (shape[0], shape[1]))
        else:
            # Copies only what is still a read-only view of the file (F32 tensors); dequantized ones are fresh.
            dense = torch.from_numpy(np.require(dequantize(tensor.data, tensor.tensor_type), np.float32, "W"))
            weight = dense.reshape(shape)
        if config["model_type"] == "gemma3_text" and name.endswith("norm.weight") and isinstance(weight, torch.Tensor):
            weight = weight - 1  # llama.cpp's converter stores Gemma's norms as 1 + weight
        if config["model_type"] in ("llama", "mixtral") and hf_name.split(".")[-2] in ("q_proj", "k_proj"):
            heads = config["num_attention_heads" if "q_proj" in hf_name else "num_key_value_heads"]
            weight = _unpermute_rows(weight, heads)
        state_dict[hf_name] = weight
    return config, state_dict


def _hf_name(name: str, overrides: dict[str, str]) -> str:
    base, _, suffix = name.rpartition(".")  # suffix: "weight" or "bias"
    parts = base.split(".")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    layer_names = _LAYER_NAMES | overrides
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face counterpart")


def _expert_name(name: str, expert: int, architecture: str) -> str:
    """blk.L.ffn_gate_exps.weight's expert e as Hugging Face names it (Qwen3-MoE's or Mixtral's)."""
    _, layer, kind, suffix = name.split(".")
    proj = _EXPERT_NAMES[kind]
    if architecture == "MixtralForCausalLM":
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{_MIXTRAL_NAMES[proj]}.{suffix}"
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.{suffix}"


def _unpermute_rows(weight: torch.Tensor | QuantizedWeight, heads: int) -> torch.Tensor | QuantizedWeight:
    """llama.cpp's converter reorders each Llama head's Q/K rows (and biases) from the rotate-half layout
    of Hugging Face checkpoints, [x0..x(d/2-1), y0..y(d/2-1)], to the interleaved one of its rotary kernel,
    [x0, y0, x1, y1, ...]. Undo it so the weights equal the original checkpoint's. Only whole rows move,
    so quantized rows move as their blocks."""
    if isinstance(weight, QuantizedWeight):
        order = _unpermute_rows(torch.arange(weight.shape[0]), heads)
        assert isinstance(order, torch.Tensor)
        return weight.select_rows(order)
    head_dim = weight.shape[0] // heads
    per_head = weight.reshape(heads, head_dim // 2, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape)


def _hf_config(metadata: dict[str, Any], tensors: dict[str, GGUFTensor]) -> dict:
    def meta(key: str, default: Any = None) -> Any:
        return metadata.get(key, default)

    arch = meta("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(_ARCHITECTURES)}")
    experts = meta(f"{arch}.expert_count") or 0
    hf_arch = "MixtralForCausalLM" if arch == "llama" and experts else _ARCHITECTURES[arch]
    hidden = meta(f"{arch}.embedding_length")
    heads = meta(f"{arch}.attention.head_count")
    head_dim = meta(f"{arch}.attention.key_length") or hidden // heads
    rope_theta = meta(f"{arch}.rope.freq_base", 10000.0)
    # Instruct models stop at an end-of-turn token that may differ from the end-of-text one.
    eos_ids = [meta(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
    eos_ids = list(dict.fromkeys(i for i in eos_ids if i is not None))

    moe = {}
    if experts:
        expert_size = meta(f"{arch}.expert_feed_forward_length") or meta(f"{arch}.feed_forward_length")
        # The chosen experts' weights are renormalised unless the file says otherwise (llama.cpp's
        # default for both; Qwen3-MoE's checkpoints set norm_topk_prob).
        moe = {"num_experts" if arch == "qwen3moe" else "num_local_experts": experts,
               "num_experts_per_tok": meta(f"{arch}.expert_used_count"), "moe_intermediate_size": expert_size,
               "norm_topk_prob": bool(meta(f"{arch}.expert_weights_norm", True)),
               # Layers without a router keep a dense MLP.
               "mlp_only_layers": [i for i in range(meta(f"{arch}.block_count"))
                                   if f"blk.{i}.ffn_gate_inp.weight" not in tensors]}
    common = {
        "hidden_size": hidden,
        "intermediate_size": meta(f"{arch}.feed_forward_length") or moe.get("moe_intermediate_size"),
        "num_hidden_layers": meta(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        # GGUF stores it as float32; its shortest decimal gives back the checkpoint's 1e-05, not 9.99999974e-06.
        "rms_norm_eps": float(str(np.float32(meta(f"{arch}.attention.layer_norm_rms_epsilon")))),
        "max_position_embeddings": meta(f"{arch}.context_length"),
        # The embedding's row count, not the token list's length: some vocabularies are padded.
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        "torch_dtype": "float32",
    }
    if arch == "gemma3":
        return common | _gemma3_config(meta, tensors, head_dim, rope_theta)
    rope_dims = meta(f"{arch}.rope.dimension_count") or head_dim
    window = meta(f"{arch}.attention.sliding_window")
    return common | moe | ({"partial_rotary_factor": rope_dims / head_dim} if rope_dims != head_dim else {}) | (
        {"sliding_window": int(window)} if window else {}) | {
        "architectures": [hf_arch],
        "model_type": "mixtral" if hf_arch == "MixtralForCausalLM" else arch,
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(meta, arch, tensors, head_dim, rope_theta),
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }


def _gemma3_config(meta: Callable[..., Any], tensors: dict[str, GGUFTensor], head_dim: int, theta: float) -> dict:
    """Gemma 3's own settings, with llama.cpp's defaults where a file leaves them out: every sixth
    layer global, the windowed layers' rope base 10000, the attention scaled by head_dim ** -0.5."""
    layers = meta("gemma3.block_count")
    pattern = meta("gemma3.attention.sliding_window_pattern", 6)
    windowed = list(pattern) if isinstance(pattern, list) else [(i + 1) % pattern != 0 for i in range(layers)]
    scale = meta("gemma3.attention.scale")
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "sliding_window": meta("gemma3.attention.sliding_window"),
        "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed],
        "rope_parameters": {
            "full_attention": (_rope_scaling(meta, "gemma3", tensors, head_dim, theta) or {"rope_type": "default"})
            | {"rope_theta": theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": meta("gemma3.rope.freq_base_swa", 10000.0)}},
        "query_pre_attn_scalar": float(scale) ** -2 if scale else head_dim,
        "final_logit_softcapping": meta("gemma3.final_logit_softcapping"),
    }


def _rope_scaling(
    meta: Callable[..., Any], arch: str, tensors: dict[str, GGUFTensor], head_dim: int, theta: float
) -> dict | None:
    if _LONGROPE_FACTORS["long_factor"] in tensors:  # Phi-3's longrope, its factors as tensors
        factors = {key: np.asarray(dequantize(tensors[t].data, tensors[t].tensor_type), np.float64).tolist()
                   for key, t in _LONGROPE_FACTORS.items()}
        attention = meta(f"{arch}.rope.scaling.attn_factor")
        return factors | {"rope_type": "longrope",
                          "original_max_position_embeddings": meta(f"{arch}.rope.scaling.original_context_length")} | (
            {"attention_factor": float(attention)} if attention is not None else {})
    kind = meta(f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta(f"{arch}.rope.scaling.factor"))}
    if kind != "none":
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported")
    if _ROPE_FREQS not in tensors:
        return None
    divisors = np.asarray(dequantize(tensors[_ROPE_FREQS].data, tensors[_ROPE_FREQS].tensor_type), np.float64)
    original_context = meta(f"{arch}.rope.scaling.original_context_length") or 8192  # Llama 3's
    return _llama3_rope_scaling(divisors, head_dim, theta, original_context)


def _llama3_rope_scaling(divisors: np.ndarray, head_dim: int, theta: float, original_context: int) -> dict:
    """Recovers Hugging Face's "llama3" rope_scaling from llama.cpp's per-frequency divisors: 1 for short
    wavelengths, `factor` for long ones, and between them 1 / ((1 - s) / factor + s), where
    s = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor).
    s is linear in the frequency, so a line fitted through the blended divisors gives both freq factors.
    (Any original_context yields the same divisors with matching freq factors, so assuming one is safe.)"""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    factor = float(divisors.max())
    x = original_context * inv_freq / (2 * math.pi)  # original_context / wavelength
    blended = (divisors > 1 + 1e-4) & (divisors < factor * (1 - 1e-4))
    if blended.sum() < 2:
        raise ValueError(f"{_ROPE_FREQS} has too few blended frequencies to recover llama3 rope scaling")
    s = (1 / divisors[blended] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(x[blended], s, 1)  # s = (x - low) / (high - low)
    low = -intercept / slope
    high = low + 1 / slope
    # Rounding drops float32 noise, so typical values come back exact (1.0 and 4.0).
    low, high = round(float(low), 4), round(float(high), 4)

    s_all = (x - low) / (high - low)
    expected = np.where(s_all > 1, 1.0, np.where(s_all < 0, factor, 1 / ((1 - s_all) / factor + s_all)))
    if not np.allclose(expected, divisors, rtol=1e-3):
        raise ValueError(f"{_ROPE_FREQS} does not follow llama3 rope scaling")
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original_context,
    }
