"""GGUF files as people download them: K-quant and i-quant tensors served in their own formats,
and files mixing formats (within a layer, within a fused projection) loading as they are. Tiny
random checkpoints written with our encoder (kquant_encoder.py); the reference is transformers in
float32 on the same weights dequantized by the `gguf` package."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as G
from gguf import GGUFReader
from transformers import AutoModelForCausalLM

from baby_sgl import Engine
from baby_sgl.layers.quantization import FusedWeight, QuantizedWeight, WeightType
from gguf_writer import write_tiny_gguf
from helpers import GREEDY, hf_greedy, random_prompts

MAX_NEW = 16
kernel_only = pytest.mark.cpu_only("quantized weights served by the CPU kernel")


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
    BF16) dequantized at load, in one fused projection. Failed before in
    models/llama.py:_load_quantized, `set_quantized(..., QuantizedWeight.cat(parts))` with parts
    = k and v only (q had come dense): cpu/csrc/cpu_step.cpp then refused the layer with "layer
    weight shapes do not match the config"."""
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


KEPT = [WeightType.Q4_K, WeightType.Q5_K, WeightType.Q6_K, WeightType.Q5_0, WeightType.Q5_1, WeightType.IQ4_NL,
        WeightType.IQ4_XS]


def _matrices(model: torch.nn.Module) -> dict[str, object]:
    """Every matrix the model multiplies or looks up, by module name: its weight as held."""
    return {name: m.weight for name, m in model.named_modules()
            if name.endswith(("_proj", "embed_tokens", "lm_head")) and hasattr(m, "weight")}


def _bytes(weight: object) -> int:
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    assert isinstance(weight, QuantizedWeight | FusedWeight)
    return weight.nbytes


@kernel_only
@pytest.mark.parametrize("qtype", KEPT)
def test_a_model_in_each_format_gives_the_greedy_ids_of_its_dequantized_weights(wide_qwen2, tmp_path, qtype):
    """Every matrix in one format, the embedding tied to the output head: served as stored."""
    path = str(tmp_path / f"{qtype.name}.gguf")
    weights = write_tiny_gguf(wide_qwen2, path, G[qtype.name], embed_qtype=G[qtype.name])
    prompts = random_prompts(6, 512, 3, 60)
    outs, model = _serve(path, prompts)
    assert outs == _expected(wide_qwen2, weights, prompts)
    held = _matrices(model)
    assert all(isinstance(w, QuantizedWeight) and w.qtype == qtype for w in held.values())
    assert held["lm_head"] is held["embed_tokens"]  # tied: one copy


def _q4_k_m(name: str) -> G:
    """llama.cpp's Q4_K_M choice on the tiny Llama: Q4_K, with v and down in Q6_K in layer 0,
    down in Q5_0 in layer 1 (its fallback for rows that are not whole super-blocks), Q6_K output."""
    if "lm_head" in name:
        return G.Q6_K
    if ".layers.0." in name and (".v_proj." in name or ".down_proj." in name):
        return G.Q6_K
    return G.Q5_0 if ".layers.1.down_proj" in name.replace("mlp.", "") else G.Q4_K


@kernel_only
def test_a_q4_k_m_file_serves_with_its_tensors_in_their_own_formats(wide_llama, tmp_path):
    path = str(tmp_path / "q4_k_m.gguf")
    weights = write_tiny_gguf(wide_llama, path, G.Q4_K, type_of=_q4_k_m)
    prompts = random_prompts(6, 512, 3, 60)
    outs, model = _serve(path, prompts)
    assert outs == _expected(wide_llama, weights, prompts)
    held = _matrices(model)
    qkv0 = held["layers.0.self_attn.qkv_proj"]
    assert isinstance(qkv0, FusedWeight)  # q and k in Q4_K, v in Q6_K: each part in its own format
    assert [p.qtype for p in qkv0.parts] == [WeightType.Q4_K, WeightType.Q4_K, WeightType.Q6_K]
    formats = {name: w.qtype for name, w in held.items() if isinstance(w, QuantizedWeight)}
    assert formats["lm_head"] == WeightType.Q6_K and formats["embed_tokens"] == WeightType.Q4_K
    assert formats["layers.0.mlp.down_proj"] == WeightType.Q6_K
    assert formats["layers.1.mlp.down_proj"] == WeightType.Q5_0
    assert formats["layers.1.self_attn.qkv_proj"] == WeightType.Q4_K
    # Resident: the file's bytes for every matrix, not a dequantized copy.
    stored = sum(int(t.n_bytes) for t in GGUFReader(path).tensors if len(t.shape) == 2)
    assert sum(_bytes(w) for w in held.values()) == stored
