"""GGUF files as people download them: K-quant and i-quant tensors served in their own formats,
and files mixing formats (within a layer, within a fused projection) loading as they are. Tiny
random checkpoints written with our encoder (kquant_encoder.py); the reference is transformers in
float32 on the same weights dequantized by the `gguf` package."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as G
from transformers import AutoModelForCausalLM

from baby_sgl import Engine
from baby_sgl.layers.quantization import QuantizedWeight, WeightType
from conftest import _save_tiny
from gguf_writer import write_tiny_gguf
from helpers import GREEDY, hf_greedy, random_prompts

MAX_NEW = 16
kernel_only = pytest.mark.cpu_only("quantized weights served by the CPU kernel")


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory) -> str:
    """The tiny Llama with rows of 256 and 512 values: whole K-quant super-blocks."""
    return _save_tiny(tmp_path_factory.mktemp("wide-llama"), "llama", hidden_size=256, intermediate_size=512)


@pytest.fixture(scope="module")
def wide_qwen2(tmp_path_factory) -> str:
    """The same shapes with the embedding tied to the output head."""
    return _save_tiny(tmp_path_factory.mktemp("wide-qwen2"), "qwen2", hidden_size=256, intermediate_size=512)


def _expected(hf_dir: str, weights: dict[str, torch.Tensor], prompts: list[list[int]]) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    hf.load_state_dict(weights, strict=False)  # the values the blocks stand for
    hf.tie_weights()
    return hf_greedy(hf, prompts, MAX_NEW)


def _serve(path: str, prompts: list[list[int]]) -> tuple[list[list[int]], torch.nn.Module]:
    with Engine(path, dtype="float32", page_size=4) as engine:
        assert engine.scheduler.runner.step is not None  # the one-call decode step took the model
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": MAX_NEW})
        engine.check_memory()
        return [o["output_ids"] for o in outs], engine.scheduler.runner.model


@kernel_only
def test_a_layer_mixing_kept_and_dequantized_formats_loads(tiny_llama, tmp_path):
    """q/k/v, gate/up and the rest each in a format of its own: some kept as blocks, some (F16,
    BF16) dequantized at load, in one fused projection. Before, models/llama.py:load_weights kept
    the quantized parts of qkv_proj alone as its weight (`QuantizedWeight.cat(parts)` over k and v
    only), and cpu/csrc/cpu_step.cpp refused it: "layer weight shapes do not match the config"."""
    types = {"q_proj": G.F16, "k_proj": G.Q8_0, "v_proj": G.Q8_0, "o_proj": G.BF16, "gate_proj": G.Q4_1,
             "up_proj": G.Q8_0, "down_proj": G.Q5_0, "embed_tokens": G.Q5_1, "lm_head": G.F32}

    def type_of(name: str) -> G:
        return types[name.split(".")[-2]]

    path = str(tmp_path / "mixed.gguf")
    weights = write_tiny_gguf(tiny_llama, path, G.Q8_0, type_of=type_of)
    prompts = random_prompts(6, 512, 3, 60)
    outs, model = _serve(path, prompts)
    assert outs == _expected(tiny_llama, weights, prompts)
    layer = model.layers[0]
    assert isinstance(model.embed_tokens.weight, QuantizedWeight) and model.embed_tokens.weight.qtype == WeightType.Q5_1
    assert isinstance(layer.mlp.down_proj.weight, QuantizedWeight)
    assert layer.mlp.down_proj.weight.qtype == WeightType.Q5_0
