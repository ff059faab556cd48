"""The random-weight checkpoints of `bench offline --model-shape`, built at a tiny size of each
family: the GGUF file and the Hugging Face directory hold the same weights and vocabulary, baby-sgl
on the GGUF file decodes as transformers does on the directory (float32), a second call builds
nothing, and the peers are pointed at the file each of them reads."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from baby_sgl import Engine
from baby_sgl.bench import checkpoints, model_shapes
from baby_sgl.bench.checkpoints import ensure_checkpoint, quantize_q4_0_exact
from baby_sgl.bench.model_shapes import ModelShape
from baby_sgl.bench.offline_cli import main
from baby_sgl.model_loader.loader import load_model
from helpers import GREEDY, hf_greedy, random_prompts

pytestmark = pytest.mark.cpu_only("the bench's checkpoints are served by the CPU kernel")

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Large weights (0.2) make greedy choices decisive at this size, so float32 sums in another order
# cannot flip them.
TINY = {
    "llama": ModelShape("tiny-llama", "llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128, vocab_size=512, rope_theta=130000.0,
                        max_position_embeddings=1024, rms_norm_eps=1e-5, tokenizer=509, specials=SPECIALS,
                        bos="<|im_start|>", eos="<|im_end|>", init_std=0.2),
    # Fewer regular tokens than embedding rows: the rest are padding tokens, as in Qwen2.5's vocabulary.
    "qwen2": ModelShape("tiny-qwen2", "qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128, vocab_size=512, rope_theta=1e6,
                        max_position_embeddings=1024, rms_norm_eps=1e-6, tokenizer=500, specials=SPECIALS,
                        bos="<|endoftext|>", eos="<|im_end|>", init_std=0.2),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Both tiny checkpoints, in a cache of their own for the module's tests (the rest of the cache,
    the built kernels included, stays where it is)."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoints, "cache_root", lambda: root)
        yield {family: ensure_checkpoint(shape) for family, shape in TINY.items()}


@pytest.mark.parametrize("family", list(TINY))
def test_gguf_and_hf_dir_hold_the_same_model(built, family):
    checkpoint, shape = built[family], TINY[family]
    config = AutoConfig.from_pretrained(checkpoint.hf_dir)  # what transformers makes of config.json
    theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
    assert (config.model_type, config.num_key_value_heads, config.vocab_size, theta, config.tie_word_embeddings) \
        == (shape.model_type, shape.num_key_value_heads, shape.vocab_size, shape.rope_theta, True)
    from_gguf = dict(load_model(checkpoint.gguf).weights)  # the Q4_0 blocks dequantized, Q/K rows unpermuted
    from_hf = dict(load_model(checkpoint.hf_dir).weights)
    assert from_gguf.keys() == from_hf.keys()
    assert all(torch.equal(from_gguf[k], from_hf[k].float()) for k in from_hf)  # exact, not close
    hf = AutoModelForCausalLM.from_pretrained(checkpoint.hf_dir, dtype=torch.float32).eval()
    prompts = random_prompts(6, shape.vocab_size, 3, 40)
    expected = hf_greedy(hf, prompts, 12)
    text = "héllo <|im_end|> wörld"
    with Engine(checkpoint.gguf, dtype="float32") as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 12})
        assert [o["output_ids"] for o in outs] == expected
        gguf_ids = engine.tokenizer(text).input_ids
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.hf_dir)
    assert len(tokenizer) == shape.vocab_size and tokenizer(text).input_ids == gguf_ids
    assert tokenizer.decode(gguf_ids) == text


def test_a_second_call_builds_nothing(built, monkeypatch):
    def build(*_):
        raise AssertionError("built again")

    monkeypatch.setattr(checkpoints, "_build", build)
    files = [Path(built["llama"].gguf), *Path(built["llama"].hf_dir).iterdir()]
    stamps = [f.stat().st_mtime_ns for f in files]
    assert ensure_checkpoint(TINY["llama"]) == built["llama"]  # the fixture's cache, still in place
    assert [f.stat().st_mtime_ns for f in files] == stamps


def test_every_build_writes_the_same_files(built, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoints, "cache_root", lambda: tmp_path)
    again = ensure_checkpoint(TINY["qwen2"])
    first = Path(built["qwen2"].gguf).parent
    names = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(Path(again.gguf).parent) for p in Path(again.gguf).parent.rglob("*")
                           if p.is_file())
    assert all((first / n).read_bytes() == (Path(again.gguf).parent / n).read_bytes() for n in names)


def test_q4_0_values_are_exact_in_bfloat16_and_as_gguf_reads_them():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    blocks, values = quantize_q4_0_exact(x)
    assert torch.equal(values.bfloat16().float(), values)
    assert torch.equal(torch.from_numpy(dequantize(blocks.numpy(), GGMLQuantizationType.Q4_0)).reshape(16, 256), values)
    assert (values - x).abs().max() <= x.abs().max() / 4  # a rounding of x, not noise


def test_peers_get_the_files_they_read(built, monkeypatch, tmp_path, capsys):
    """vLLM the Hugging Face directory, llama.cpp the GGUF file, each through its own venv's Python
    (the peers need not be installed here: the command each would run is recorded)."""
    for peer in ("vllm", "llama.cpp"):
        (tmp_path / peer / "bin").mkdir(parents=True)
        (tmp_path / peer / "bin" / "python").write_text("")
    monkeypatch.setattr("baby_sgl.bench.peers.PEERS_DIR", tmp_path)
    monkeypatch.setitem(model_shapes.SHAPES, "tiny-llama", TINY["llama"])
    commands = []

    def peer_run(cmd, **_):
        commands.append((cmd, json.loads(Path(cmd[2]).read_text())))
        spec = commands[-1][1]
        Path(cmd[3]).write_text(json.dumps({"seconds": 1.0, "prefill_s": 0.1,
                                            "outputs": [[3] * n for n in spec["output_lens"]]}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr("baby_sgl.bench.peers.subprocess.run", peer_run)
    assert main(["--model-shape", "tiny-llama", "--workload", "one-batch", "--batch", "2", "--input-len", "8",
                 "--output-len", "3", "--compare", "vllm", "llama.cpp"]) == 0
    (vllm_cmd, vllm_spec), (llama_cmd, llama_spec) = commands
    assert vllm_cmd[:2] == [str(tmp_path / "vllm/bin/python"), str(Path(checkpoints.__file__).parent /
                                                                     "peer_runners/vllm_runner.py")]
    assert vllm_spec["model"] == built["llama"].hf_dir and llama_spec["model"] == built["llama"].gguf
    assert llama_cmd[1].endswith("peer_runners/llama_cpp_runner.py")
    assert len(vllm_spec["prompts"]) == 2 and vllm_spec["one_batch"] and vllm_spec["dtype"] in ("float32", "bfloat16")
    assert "model tiny-llama on " in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--model-shape", "tiny-llama", "--model-path", built["llama"].gguf])


def test_smollm2_shapes_take_the_default_models_vocabulary(tmp_path, monkeypatch):
    from baby_sgl.model_loader.gguf_header import read_gguf_header
    from baby_sgl.model_loader.loader import default_model_path

    monkeypatch.setattr(checkpoints, "cache_root", lambda: tmp_path)
    shape = ModelShape("tiny-smollm2", "llama", hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=4, intermediate_size=128, vocab_size=49152, rope_theta=130000.0,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, tokenizer="smollm2")
    checkpoint = ensure_checkpoint(shape)
    ours, default = (read_gguf_header(path, strings=True) for path in (checkpoint.gguf, default_model_path()))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id"):
        assert ours.metadata[key] == default.metadata[key] and ours.types[key] == default.types[key]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.hf_dir)
    config = json.loads((Path(checkpoint.hf_dir) / "config.json").read_text())
    assert len(tokenizer) == 49152 and config["eos_token_id"] == tokenizer.eos_token_id
    assert tokenizer.decode(tokenizer("Hello, wörld!").input_ids) == "Hello, wörld!"
