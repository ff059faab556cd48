"""--lora-paths in SGLang's three forms, and the adapter slots: which adapter leaves its slot for one
a pass needs (--lora-eviction-policy), pinned adapters never."""

from __future__ import annotations

import argparse

import pytest
import torch

from baby_sgl.lora.adapter import LoRAAdapter, LoRABlock, ModuleLoRA
from baby_sgl.lora.memory_pool import NO_ADAPTER, LoRAMemoryPool
from baby_sgl.lora.registry import LoRARef, parse_lora_path
from baby_sgl.model_config import ModelConfig
from baby_sgl.server_args import EngineArgs


def test_lora_paths_take_sglangs_three_forms():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--lora-paths", "fr=/a/fr", '{"lora_name": "de", "lora_path": "/a/de", "pinned": true}', "/a/es"]))
    assert args.enable_lora
    assert [parse_lora_path(p) for p in args.lora_paths] == [
        LoRARef("fr", "/a/fr"), LoRARef("de", "/a/de", pinned=True), LoRARef("/a/es", "/a/es")]
    with pytest.raises(ValueError, match="needs lora_name and lora_path"):
        parse_lora_path('{"lora_name": "x"}')
    with pytest.raises(ValueError, match="lora_eviction_policy"):
        EngineArgs(lora_eviction_policy="random")
    with pytest.raises(ValueError, match="max_loaded_loras must be >= max_loras_per_batch"):
        EngineArgs(max_loaded_loras=2, max_loras_per_batch=4)


def test_lora_target_modules_bound_what_an_adapter_may_change(tiny_llama, tmp_path):
    from baby_sgl.lora.adapter import LoRAError, load_adapter
    from transformers import AutoConfig

    from peft_adapters import AdapterSpec, make_adapter

    path = make_adapter(tiny_llama, tmp_path / "qo", AdapterSpec(4, 8, ("q_proj", "o_proj")), 3)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_llama).to_dict())
    assert load_adapter("qo", path, cfg, 8, frozenset({"q_proj", "o_proj"})).targets == {"q_proj", "o_proj"}
    with pytest.raises(LoRAError, match="'qo': target module 'o_proj' is not in --lora-target-modules"):
        load_adapter("qo", path, cfg, 8, frozenset({"q_proj", "k_proj"}))


CFG = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 16, "hidden_size": 8,
                           "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2})


def adapter(name: str) -> LoRAAdapter:
    fill = float(len(name))
    return LoRAAdapter(name, name, 1, frozenset({"o_proj"}),
                       {(0, "o"): ModuleLoRA(torch.full((1, 8), fill), torch.full((8, 1), fill),
                                             (LoRABlock(slice(0, 1), slice(0, 8)),))})


@pytest.mark.parametrize("policy, evicted", [("lru", "bb"), ("fifo", "a")])
def test_a_pass_evicts_by_policy_and_never_a_pinned_adapter(policy, evicted):
    pool = LoRAMemoryPool(CFG, max_loras_per_batch=3, max_lora_rank=1, device=torch.device("cpu"),
                          eviction_policy=policy)
    for name, pinned in (("p", True), ("a", False), ("bb", False), ("ccc", False)):
        pool.add(name, adapter(name), pinned)
    assert pool.prepare(["a", None]) == [pool.slot_of["a"], NO_ADAPTER]
    pool.prepare(["bb"])
    pool.prepare(["a"])  # a used last: lru evicts bb; fifo evicts a, slotted first
    slots = pool.prepare(["ccc"])
    assert evicted not in pool.slot_of and set(pool.slot_of) == {"p", "a", "bb", "ccc"} - {evicted}
    assert torch.equal(pool.a["o"][0, slots[0], 0], torch.full((8,), 3.0))  # ccc's matrices in its slot
    assert not pool.fits({"a", "bb", "ccc"})  # the pinned adapter keeps one of the three slots
