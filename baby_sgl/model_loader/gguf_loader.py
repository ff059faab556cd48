"""Reads a GGUF file (llama.cpp's format): config from its metadata, weights dequantized to
float32 with the `gguf` package, and a Hugging Face tokenizer converted from its vocabulary.

Conversions are slow (the tokenizer takes ~10 s to build), so their results are cached under
$BABY_SGL_CACHE_DIR (default ~/.cache/baby_sgl), keyed by the file's path, size and mtime.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

logger = logging.getLogger(__name__)

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def cache_root() -> str:
    return os.environ.get("BABY_SGL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "baby_sgl")


def _cache_key(path: str) -> str:
    st = os.stat(path)
    return hashlib.sha1(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]


def load_gguf(path: str) -> tuple[dict, dict[str, torch.Tensor], str]:
    """Returns (Hugging Face style config dict, float32 state dict with HF names, tokenizer dir)."""
    key = _cache_key(path)
    tok_dir = os.path.join(cache_root(), "tokenizers", key)
    weights_dir = os.path.join(cache_root(), "weights", key)
    if not os.path.isdir(tok_dir):
        _atomic_dir(tok_dir, lambda tmp: _convert_tokenizer(path, tmp))
    if not os.path.isdir(weights_dir):
        _atomic_dir(weights_dir, lambda tmp: _convert_weights(path, tmp))
    with open(os.path.join(weights_dir, "config.json")) as f:
        config = json.load(f)
    return config, load_file(os.path.join(weights_dir, "model.safetensors")), tok_dir


def _atomic_dir(target: str, build) -> None:
    """Builds into a temporary dir and renames it, so a crash never leaves a half-written cache."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(target))
    try:
        build(tmp)
        os.rename(tmp, target)
    except OSError:
        if not os.path.isdir(target):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_tokenizer(path: str, out_dir: str) -> None:
    from transformers import AutoTokenizer

    logger.info("converting the tokenizer of %s (cached afterwards)", path)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok.save_pretrained(out_dir)


def _convert_weights(path: str, out_dir: str) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    logger.info("dequantizing %s to float32 (cached afterwards)", path)
    reader = GGUFReader(path)
    config = _config(reader)
    state = {}
    for t in tqdm(reader.tensors, desc="dequantizing GGUF", unit="tensor"):
        name = _hf_name(t.name)
        if name is None:
            raise ValueError(f"GGUF tensor {t.name!r} is not supported")
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        w = w.reshape([int(d) for d in reversed(t.shape)]) if w.dim() > 1 else w.reshape(-1)
        state[name] = _unpermute(name, w, config)
    config["tie_word_embeddings"] = "lm_head.weight" not in state
    save_file(state, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)


def _hf_name(name: str) -> str | None:
    base, _, suffix = name.rpartition(".")  # suffix: weight or bias
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def _unpermute(name: str, w: torch.Tensor, config: dict) -> torch.Tensor:
    """llama.cpp stores Llama's Q and K rows interleaved for its rotary kernel; undo that so
    the weights match the rotate-half layout of Hugging Face checkpoints."""
    if config["model_type"] != "llama" or not name.endswith(("q_proj.weight", "k_proj.weight")):
        return w
    heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(reader) -> dict:
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    arch = meta["general.architecture"]
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(_ARCHITECTURES)}")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors) or meta.get(f"{arch}.rope.scaling.type"):
        raise ValueError("GGUF files with rope scaling are not supported; load the Hugging Face checkpoint")
    heads = meta[f"{arch}.attention.head_count"]
    hidden = meta[f"{arch}.embedding_length"]
    eos = reader.fields["tokenizer.ggml.eos_token_id"].contents()
    return {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": meta[f"{arch}.feed_forward_length"],
        "num_hidden_layers": meta[f"{arch}.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": meta.get(f"{arch}.rope.dimension_count", hidden // heads),
        "rms_norm_eps": meta[f"{arch}.attention.layer_norm_rms_epsilon"],
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": None,
        "max_position_embeddings": meta[f"{arch}.context_length"],
        "vocab_size": meta.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data),
        "bos_token_id": reader.fields["tokenizer.ggml.bos_token_id"].contents()
        if "tokenizer.ggml.bos_token_id" in reader.fields else None,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
