"""Other engines on the same prompts in the same run (`bench offline --compare vllm|llama.cpp`).

Each peer runs in a venv of its own under .peers/ (made by scripts/setup_peers.sh), through a
small script in peer_runners/ that reads the workload as JSON and writes timings and output ids
back. vLLM loads a Hugging Face directory, so a GGUF model is dequantized once into the cache;
llama.cpp runs the GGUF file itself (its own quantized weights)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from baby_sgl.bench.workloads import Workload
from baby_sgl.cache_dirs import cache_root

logger = logging.getLogger(__name__)

_RUNNERS = Path(__file__).with_name("peer_runners")
PEERS_DIR = Path(__file__).resolve().parents[2] / ".peers"  # where scripts/setup_peers.sh puts them
PEERS = {"vllm": "vllm_runner.py", "llama.cpp": "llama_cpp_runner.py"}


def peer_python(name: str) -> Path:
    python = PEERS_DIR / name / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{name} is not installed here: run `bash scripts/setup_peers.sh {name}` first")
    return python


def hf_dir_for(model_source: str) -> str:
    """A Hugging Face directory of the model: the source itself, or its GGUF dequantized once
    (float32 safetensors, config, tokenizer) into the cache's hf-from-gguf/ (cache_dirs.py)."""
    if not model_source.endswith(".gguf"):
        return model_source
    cache = cache_root() / "hf-from-gguf"
    out = cache / Path(model_source).stem
    if not (out / "config.json").exists():
        from safetensors.torch import save_file

        from baby_sgl.model_loader.loader import load_model

        logger.warning("dequantizing %s for the peer into %s (once)", model_source, out)
        loaded = load_model(model_source)  # our GGUF reader: Hugging Face names and layouts
        out.mkdir(parents=True, exist_ok=True)
        dense = {name: t.contiguous() for name, t in loaded.weights if isinstance(t, torch.Tensor)}  # not quantized
        save_file(dense, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(loaded.hf_config, indent=1))
        for f in Path(loaded.tokenizer_path).iterdir():
            shutil.copy(f, out / f.name)
    return str(out)


def run_peer(name: str, model_source: str, dtype: torch.dtype, wl: Workload, one_batch: bool, threads: int,
             base: dict, prompt_lookup: int = 0, hf_dir: str | None = None,
             lora_paths: list[str] | None = None) -> dict:
    """Runs the peer on wl; returns a result row shaped like baby-sgl's, with the ratio inputs
    and how many greedy outputs equal baby-sgl's (base). prompt_lookup > 0: llama.cpp drafts that
    many tokens by prompt lookup (LlamaPromptLookupDecoding). hf_dir: a Hugging Face directory of
    the same weights for vLLM, instead of the GGUF file dequantized. lora_paths: each prompt's
    LoRA adapter (vLLM with --enable-lora)."""
    spec = {"prompts": wl.prompts, "output_lens": wl.output_lens, "one_batch": one_batch, "threads": threads,
            "max_model_len": max(map(len, wl.prompts)) + max(wl.output_lens) + 16, "prompt_lookup": prompt_lookup}
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if name == "vllm":
        spec.update(model=hf_dir or hf_dir_for(model_source), dtype=str(dtype).removeprefix("torch."))
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"  # unbound, it stalls on small machines
        label = f"vLLM CPU {spec['dtype']}" + (f" {len(set(lora_paths))} LoRA" if lora_paths else "")
        if lora_paths:
            spec.update(lora_paths=lora_paths, max_lora_rank=_vllm_rank(lora_paths))
    else:
        if not model_source.endswith(".gguf"):
            raise SystemExit("--compare llama.cpp needs a GGUF model (the default model is one)")
        spec["model"] = model_source
        label = "llama.cpp (GGUF weights, one prompt at a time)" + \
            (f", prompt lookup of {prompt_lookup}" if prompt_lookup else "")
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        subprocess.run([str(peer_python(name)), str(_RUNNERS / PEERS[name]), str(spec_path), str(out_path)],
                       env=env, check=True)
        result = json.loads(out_path.read_text())
    return _as_row(label, result, wl, base)


def _vllm_rank(lora_paths: list[str]) -> int:
    """The smallest of vLLM's allowed --max-lora-rank values that holds every adapter's rank."""
    rank = max(json.loads((Path(p) / "adapter_config.json").read_text())["r"] for p in lora_paths)
    return next(r for r in (8, 16, 32, 64, 128, 256, 320, 512) if r >= rank)


def _as_row(label: str, result: dict, wl: Workload, base: dict) -> dict:
    dt, outs = result["seconds"], result.pop("outputs")
    out_tokens = sum(map(len, outs))
    row = {"engine": label, **result, "requests_per_s": len(outs) / dt, "output_tok_s": out_tokens / dt,
           "total_tok_s": (wl.input_tokens + out_tokens) / dt}
    if "decode_step_median_s" not in row and "prefill_s" in row and wl.output_lens[0] > 1:
        row["decode_step_median_s"] = (dt - row["prefill_s"]) / (wl.output_lens[0] - 1)  # mean, from totals
    if "outputs" in base:
        pairs = list(zip(base["outputs"], outs))
        row["greedy_identical_frac"] = sum(a == b for a, b in pairs) / len(pairs)
    return row
