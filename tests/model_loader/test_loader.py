"""Model sources: sharded safetensors, llama3 rope scaling, a hub id found in the local HF cache."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from baby_sgl import Engine
from helpers import GREEDY, TINY_KW, hf_greedy, random_prompts


def test_sharded_checkpoint_with_llama3_rope_scaling(tiny_llama, tmp_path):
    torch.manual_seed(1)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    cfg = LlamaConfig(**TINY_KW, rope_scaling=scaling, rope_theta=500000.0, eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    for name in os.listdir(tiny_llama):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tiny_llama, name), tmp_path)
    prompts = random_prompts(6, 512, 60, 200, seed=9)  # past 64 positions, where scaling matters
    expected = hf_greedy(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32), prompts, 10)
    with Engine(str(tmp_path), dtype="float32", page_size=4) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 10})
        assert [o["output_ids"] for o in outs] == expected
        engine.check_memory()


def test_hub_id_resolves_from_local_cache_only(tiny_llama, tmp_path):
    snapshot = tmp_path / "models--tiny-org--tiny-llama" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_llama, snapshot)
    (tmp_path / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (tmp_path / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("0123abcd")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    ok = subprocess.run([sys.executable, "-m", "baby_sgl.cli", "generate", "hi", "--model-path", "tiny-org/tiny-llama",
                         "--max-new-tokens", "2"], env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    missing = subprocess.run([sys.executable, "-m", "baby_sgl.cli", "generate", "hi", "--model-path", "no-org/absent"],
                             env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "neither a local path nor in the local HF cache" in missing.stderr
    # the server says it as plainly (it printed a traceback)
    serve = subprocess.run([sys.executable, "-m", "baby_sgl.cli", "serve", "--model-path", "no-org/absent"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert serve.returncode == 2 and "Traceback" not in serve.stderr, serve.stderr
    assert serve.stderr.strip() == ("baby-sgl serve: error: model 'no-org/absent' is neither a local path nor in "
                                    "the local HF cache"), serve.stderr


def test_one_cache_directory_holds_what_is_built_once(tiny_llama, tmp_path, monkeypatch):
    # A converted GGUF's tokenizer and weights, the kernels and compiled graphs: all under
    # $BABY_SGL_CACHE (else ~/.cache/baby-sgl), never in a second directory.
    from gguf import GGMLQuantizationType

    from baby_sgl.cpu import toolchain
    from baby_sgl.model_loader.gguf_loader import load_gguf
    from gguf_writer import write_tiny_gguf

    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(tiny_llama, path, GGMLQuantizationType.Q8_0)
    monkeypatch.setenv("BABY_SGL_CACHE", str(tmp_path / "cache"))
    _, _, tokenizer_dir = load_gguf(path)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["keys", "tokenizers", "weights"]
    assert tokenizer_dir.startswith(str(tmp_path / "cache" / "tokenizers"))
    assert toolchain.kernel_cache_dir() == tmp_path / "cache" / "kernels"
    # A copy of the file elsewhere (a second environment, a reinstall) reuses what was converted;
    # a file of other contents gets its own.
    os.makedirs(tmp_path / "elsewhere")
    shutil.copy(path, tmp_path / "elsewhere" / "tiny.gguf")
    assert load_gguf(str(tmp_path / "elsewhere" / "tiny.gguf"))[2] == tokenizer_dir
    write_tiny_gguf(tiny_llama, str(tmp_path / "q4.gguf"), GGMLQuantizationType.Q4_0)
    assert load_gguf(str(tmp_path / "q4.gguf"))[2] != tokenizer_dir
    assert len(list((tmp_path / "cache" / "weights").glob("*.safetensors"))) == 2
    assert len(list((tmp_path / "cache" / "keys").iterdir())) == 3
    monkeypatch.delenv("BABY_SGL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert toolchain.kernel_cache_dir() == tmp_path / "xdg" / "baby-sgl" / "kernels"
