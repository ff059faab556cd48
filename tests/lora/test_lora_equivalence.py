"""Greedy ids with LoRA adapters equal PEFT's model in transformers (float32), for every family
the engine serves, with one batch mixing three adapters (different ranks, alphas, rsLoRA and
targets) and the base model; over full-precision and quantized (GGUF) base weights. On a CPU with a
compiler every pass runs in the one-call step, but with compiled decode graphs op by op (as on a
GPU): both paths take the adapters."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from baby_sgl import Engine
from baby_sgl.cpu import toolchain
from peft_adapters import ATTENTION, EVERY, PHI3_EVERY, AdapterSpec, make_adapter, peft_greedy
from helpers import ARCHS, CONFIGS, GREEDY, assert_setting_exercised, build_for, random_prompts, shared_prefix_prompts

MAX_NEW = 24  # with the prompts' 307 tokens, more than the retracting settings' pools hold
NAMES = ("a", "b", "c")
MIXES = [None, "a", "b", "c", "a", "b", "c", None]  # each prompt's adapter in the mixed batch


def specs(family: str) -> list[AdapterSpec]:
    """Three adapters: every projection (attention only for the mixture-of-experts families,
    whose MLPs PEFT does not reach; Phi-3's fused ones), q and v with rsLoRA, o and down."""
    every = PHI3_EVERY if family == "tiny_phi3" else ATTENTION if family in ("tiny_qwen3_moe", "tiny_mixtral") else EVERY
    qv = ("qkv_proj",) if family == "tiny_phi3" else ("q_proj", "v_proj")
    od = ("o_proj",) if family in ("tiny_qwen3_moe", "tiny_mixtral") else ("o_proj", "down_proj")
    return [AdapterSpec(8, 16, tuple(every)), AdapterSpec(4, 8, qv, rslora=True), AdapterSpec(16, 12, od)]


def adapter_case(base: str, tmp_path_factory, family: str, weights_dir: str | None = None):
    """(the adapters' flags, the prompts, the expected ids per prompt of MIXES)."""
    root = tmp_path_factory.mktemp(f"lora-{family}")
    paths = {n: make_adapter(base, root / n, spec, seed) for seed, (n, spec) in enumerate(zip(NAMES, specs(family)))}
    prompts = random_prompts(6, 512, 20, 60) + shared_prefix_prompts(2, 512, 24)
    refs = {n: peft_greedy(base, None if n is None else paths[n], prompts, MAX_NEW, weights_dir) for n in (None, *NAMES)}
    assert all(refs[n] != refs[None] for n in NAMES), "each adapter must change the greedy ids"
    return [f"{n}={p}" for n, p in paths.items()], prompts, [refs[n][i] for i, n in enumerate(MIXES)]


FAMILIES = ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_qwen3_moe", "tiny_mixtral", "tiny_mistral", "tiny_phi3",
            "tiny_gemma3"]
# Every family under every setting of the equivalence tests (helpers.CONFIGS: the radix cache on
# and off and a cached second round, pages of 1, 4 and 16, chunked and mixed prefill, retraction,
# speculative verification, compiled decode graphs).
SETTINGS = [(f, c) for f in FAMILIES for c in CONFIGS]


@pytest.fixture(scope="module")
def cases(request, tmp_path_factory):
    built: dict[str, tuple] = {}

    def case(family: str):
        if family not in built:
            built[family] = adapter_case(request.getfixturevalue(family), tmp_path_factory, family)
        return request.getfixturevalue(family), *built[family]

    return case


@pytest.mark.parametrize("family, config", SETTINGS)
def test_a_mixed_batch_gives_peft_ids(cases, family, config):
    base, lora_paths, prompts, expected = cases(family)
    with Engine(base, dtype="float32", lora_paths=lora_paths, **CONFIGS[config]) as engine:
        params = {**GREEDY, "max_new_tokens": MAX_NEW}
        rounds = {r: engine.generate(input_ids=prompts, sampling_params=params, lora_path=MIXES) for r in ("first", "cached")}
        for round_, outs in rounds.items():
            for i, out in enumerate(outs):
                assert out["output_ids"] == expected[i], f"prompt {i} ({MIXES[i]}) differs under {config} ({round_})"
        # Each setting's mechanism ran with the adapters: retraction (a request comes back with its
        # adapter), chunks beside decodes, drafts verified, the second round's prefixes found in the
        # cache under their adapter.
        assert_setting_exercised(engine, config, prompts, rounds["first"], rounds["cached"])
        if CONFIGS[config].get("enable_torch_compile"):  # the passes with adapters ran eager, the others compiled
            assert engine.runner.compiled is not None
        elif engine.runner.device.type == "cpu" and toolchain.cxx_compiler() is not None:
            assert engine.runner.step is not None, "decode passes with adapters run in the one-call CPU step"
        engine.check_memory()


def test_adapters_over_quantized_gguf_weights(tiny_llama, tmp_path, tmp_path_factory):
    """The base served from a Q8_0 GGUF (matrices kept as blocks): the adapters' deltas are added to
    the quantized products, and the ids are PEFT's over the weights the blocks stand for."""
    from gguf import GGMLQuantizationType

    from gguf_writer import write_tiny_gguf

    reference = write_tiny_gguf(tiny_llama, str(tmp_path / "model.gguf"), GGMLQuantizationType.Q8_0)
    ref_dir = tmp_path / "reference"
    shutil.copytree(tiny_llama, ref_dir)
    save_file({k: v.contiguous() for k, v in reference.items()}, ref_dir / "model.safetensors")
    lora_paths, prompts, expected = adapter_case(tiny_llama, tmp_path_factory, "gguf", str(ref_dir))
    with Engine(str(tmp_path / "model.gguf"), dtype="float32", lora_paths=lora_paths, page_size=4) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": MAX_NEW},
                               lora_path=MIXES)
        assert [o["output_ids"] for o in outs] == expected
        engine.check_memory()


def test_fused_parts_land_in_their_rows(tiny_llama, tmp_path):
    """An adapter on k_proj alone changes only the k rows of the fused q/k/v product, and on
    up_proj alone only the up half of gate/up (the rest of the fused delta is zero)."""
    from baby_sgl.lora.adapter import load_adapter
    from baby_sgl.model_config import ModelConfig
    from transformers import AutoConfig

    path = make_adapter(tiny_llama, tmp_path / "ku", AdapterSpec(4, 8, ("k_proj", "up_proj")), 7)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_llama).to_dict())
    adapter = load_adapter("ku", path, cfg, 16)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qkv_b, gate_up_b = adapter.modules[0, "qkv"].b, adapter.modules[0, "gate_up"].b
    assert torch.count_nonzero(qkv_b[:q]) == 0 and torch.count_nonzero(qkv_b[q + kv :]) == 0
    assert torch.count_nonzero(qkv_b[q : q + kv]) > 0
    assert torch.count_nonzero(gate_up_b[: cfg.intermediate_size]) == 0


@pytest.mark.cpu_only("the CPU's one-call decode step")
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "native"])
def test_every_instruction_set_gives_peft_ids(cases, arch, monkeypatch):
    """The one-call step's adapter deltas built for AVX2 (x86-64-v3) and for no SIMD (x86-64)."""
    base, lora_paths, prompts, expected = cases("tiny_llama")
    build_for(arch, monkeypatch)
    with Engine(base, dtype="float32", lora_paths=lora_paths, page_size=4) as engine:
        assert engine.runner.step is not None
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": MAX_NEW},
                               lora_path=MIXES)
        assert [o["output_ids"] for o in outs] == expected
        engine.check_memory()
