"""What differs between the families beyond the shared equivalence tests (test_equivalence.py):
the mixture-of-experts path computes each expert only for its tokens, a checkpoint missing an
expert is refused by name, and the tiny Mistral's sliding window really changes its outputs (so
the equivalence tests exercise windowed attention)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from baby_sgl import Engine
from baby_sgl.layers import moe
from helpers import GREEDY, hf_greedy, random_prompts


def test_each_expert_runs_only_on_the_tokens_routed_to_it(monkeypatch):
    torch.manual_seed(0)
    tokens, hidden, size, experts, k = 37, 16, 12, 8, 2
    x = torch.randn(tokens, hidden)
    gate_up, down = torch.randn(experts, 2 * size, hidden), torch.randn(experts, hidden, size)
    weights, chosen = moe.route(torch.randn(tokens, experts), k, renormalize=True)
    rows_seen = []
    linear = moe.linear

    def counting(inp, w, *args):
        if tuple(w.shape) == (2 * size, hidden):  # an expert's gate/up product
            rows_seen.append(inp.shape[0])
        return linear(inp, w, *args)

    monkeypatch.setattr(moe, "linear", counting)
    out = moe.experts_forward(x, weights, chosen, gate_up, down)
    monkeypatch.undo()
    assert sum(rows_seen) == tokens * k  # every (token, choice) once, nothing more
    assert sorted(rows_seen) == sorted(torch.bincount(chosen.flatten(), minlength=experts)[
        torch.bincount(chosen.flatten(), minlength=experts) > 0].tolist())
    # The dense reference: every expert on every token, weighted by the routing (zero if not chosen).
    dense = torch.zeros(tokens, experts)
    dense.scatter_(1, chosen, weights)
    ref = sum(dense[:, e, None] * F.linear(F.silu(F.linear(x, gate_up[e, :size])) * F.linear(x, gate_up[e, size:]),
                                          down[e]) for e in range(experts))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def test_a_checkpoint_missing_an_expert_is_refused(tiny_mixtral, tmp_path):
    import shutil

    path = tmp_path / "broken"
    shutil.copytree(tiny_mixtral, path)
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match="missing weights.*layers.1.mlp.experts_gate_up"):
        Engine(str(path), dtype="float32")


def test_the_sliding_window_changes_what_transformers_generates(tiny_mistral):
    """The equivalence tests on tiny_mistral check windowed attention only if the window changes
    the outputs of their prompts: with the same weights and no window, transformers differs."""
    prompts = random_prompts(6, 512, 40, 90)
    windowed = AutoModelForCausalLM.from_pretrained(tiny_mistral, dtype=torch.float32).eval()
    full = AutoModelForCausalLM.from_pretrained(tiny_mistral, dtype=torch.float32, sliding_window=None).eval()
    assert hf_greedy(windowed, prompts, 8) != hf_greedy(full, prompts, 8)


def test_prepacked_bfloat16_experts_compute_what_the_stacked_ones_do():
    torch.manual_seed(0)
    layer = moe.SparseMoE(hidden_size=64, size=48, num_experts=8, top_k=2, renormalize=False).to(torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(23, 64, dtype=torch.bfloat16)
    before = layer(x)
    if not layer.prepack_pays():  # no oneDNN, or no bfloat16 in it on this CPU: nothing to compare
        assert not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return
    layer.prepack()
    assert layer.packed is not None and "experts_down" not in dict(layer.named_parameters())
    torch.testing.assert_close(layer(x).float(), before.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("family", ["tiny_qwen3", "tiny_qwen3_moe", "tiny_mixtral", "tiny_phi3", "tiny_gemma3",
                                    "tiny_phi3_longrope"])
def test_a_gguf_gives_the_ids_of_its_hugging_face_directory(family, request, tmp_path):
    """Written as llama.cpp lays each family out (qwen3; qwen3moe and Mixtral's llama with experts
    stacked per layer; phi3 with q/k/v and gate/up fused, its window and rope width, longrope's
    factors as tensors; gemma3 with its
    norms stored as 1 + weight, its layer pattern and two rope bases), quantized to Q8_0: served from the file (matrices as stored, experts
    dequantized) it gives transformers' greedy ids on the weights the blocks stand for."""
    import shutil

    from gguf import GGMLQuantizationType

    from gguf_writer import write_tiny_gguf

    hf_dir = request.getfixturevalue(family)
    reference = write_tiny_gguf(hf_dir, str(tmp_path / "model.gguf"), GGMLQuantizationType.Q8_0)
    ref_dir = tmp_path / "reference"
    shutil.copytree(hf_dir, ref_dir)
    save_file({k: v.contiguous() for k, v in reference.items()}, ref_dir / "model.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    # longrope: prompts past its pre-training context, where transformers uses the long factors throughout.
    prompts = random_prompts(8, 512, *((70, 90) if "longrope" in family else (3, 60)))
    expected = hf_greedy(hf, prompts, 16)
    with Engine(str(tmp_path / "model.gguf"), dtype="float32", page_size=4) as engine:
        assert engine.model_config.architecture == hf.config.architectures[0]
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 16})
        assert [o["output_ids"] for o in outs] == expected
        engine.check_memory()


def test_which_layers_attend_over_the_window():
    from baby_sgl.model_config import ModelConfig

    base = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "sliding_window": 16}
    assert ModelConfig.from_hf(base).sliding_layers == (0, 1, 2, 3)  # Mistral-style: every layer
    assert ModelConfig.from_hf(base | {"use_sliding_window": False}).sliding_window is None
    qwen = base | {"use_sliding_window": True, "max_window_layers": 2}
    assert ModelConfig.from_hf(qwen).sliding_layers == (2, 3)  # Qwen2's rule: from max_window_layers on
    typed = qwen | {"layer_types": ["sliding_attention", "full_attention"] * 2}
    assert ModelConfig.from_hf(typed).sliding_layers == (0, 2)  # transformers 5 names each layer's kind


@pytest.mark.parametrize("context, lengths", [(64, (3, 40)), (None, (70, 90))])
def test_phi3_longrope_matches_transformers(tiny_phi3_longrope, context, lengths):
    """Served within the pre-training context the short factors apply, beyond it the long ones;
    transformers picks the same for sequences that stay on one side of it (a prompt within it that
    grows past it is where the two differ: ModelConfig._longrope says why)."""
    prompts = random_prompts(8, 512, *lengths)
    hf = AutoModelForCausalLM.from_pretrained(tiny_phi3_longrope, dtype=torch.float32).eval()
    new = 64 - lengths[1] if context else 16
    expected = hf_greedy(hf, prompts, new)
    with Engine(tiny_phi3_longrope, dtype="float32", context_length=context, page_size=4) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": new})
        assert [o["output_ids"] for o in outs] == expected
        engine.check_memory()
    if context:  # the factors matter: served with the long ones, these prompts come out otherwise
        with Engine(tiny_phi3_longrope, dtype="float32", page_size=4) as engine:
            outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": new})
            assert [o["output_ids"] for o in outs] != expected
