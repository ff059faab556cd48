"""The adapters' fast paths: op by op, a prompt's rows multiplied where they lie (runs) or gathered,
over only the blocks of the fused q/k/v and gate/up deltas an adapter fills; the slots in the
model's dtype (bfloat16 on a bfloat16 model), read by the one-call decode step too. And adapters
in llama.cpp's LoRA GGUF, served as their PEFT originals."""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFWriter

from baby_sgl import Engine
from baby_sgl.cpu import decode_step
from baby_sgl.lora.memory_pool import LoRAMemoryPool
from helpers import ARCHS, GREEDY, assert_bfloat16_close, build_for, random_prompts
from gguf_writer import write_lora_gguf
from peft_adapters import EVERY, PHI3_EVERY, AdapterSpec, make_adapter, peft_greedy

MAX_NEW = 8
BF16_PARAMS = {**GREEDY, "max_new_tokens": 2}
# The instruction sets the one-call step is built for (helpers.ARCHS); on a GPU only the native case runs.
CPU_BUILDS = [a if a == "native" else pytest.param(a, marks=pytest.mark.cpu_only("the CPU kernels' builds"))
              for a in ARCHS]


@pytest.fixture(scope="module")
def one_part_adapters(tiny_llama, tmp_path_factory):
    """An adapter on q alone (the first part of q/k/v), and one on k, v and up (the other parts
    of q/k/v, and the last of gate/up): name -> path."""
    root = tmp_path_factory.mktemp("lora-speed")
    return {"q": make_adapter(tiny_llama, root / "q", AdapterSpec(8, 16, ("q_proj",)), 21),
            "kvu": make_adapter(tiny_llama, root / "kvu", AdapterSpec(4, 8, ("k_proj", "v_proj", "up_proj")), 22)}


def test_one_part_adapters_over_runs_and_gathered_rows_give_peft_ids(tiny_llama, one_part_adapters, monkeypatch):
    """One prefill holds long prompts of "q" side by side (one run of rows, multiplied in place)
    and short prompts of "kvu" apart (gathered); each adapter's delta covers only its parts' rows
    of the fused products. The ids equal PEFT's: a block placed over another part's rows, or a
    run cut or taken past its end, changes them (each checked by breaking memory_pool.py's
    _add_delta and LoRAMemoryPool.batch). The op-by-op path (a GPU's; on CPU the one-call step
    takes prefill where it runs)."""
    monkeypatch.setattr(decode_step, "can_run", lambda *a: False)
    long_prompts, short_prompts = random_prompts(3, 512, 120, 160, seed=31), random_prompts(5, 512, 4, 20, seed=32)
    prompts = long_prompts[:2] + short_prompts[:2] + [long_prompts[2]] + short_prompts[2:]
    names = ["q", "q", "kvu", None, None, "kvu", "q", "kvu"]
    expected = {n: peft_greedy(tiny_llama, None if n is None else one_part_adapters[n], prompts, MAX_NEW)
                for n in (None, "q", "kvu")}
    assert all(expected[n] != expected[None] for n in one_part_adapters), "each adapter must change the ids"
    with Engine(tiny_llama, dtype="float32", lora_paths=[f"{n}={p}" for n, p in one_part_adapters.items()]) as engine:
        pool = engine.runner.lora_pool
        kinds: list[set[str]] = []
        batch = pool.batch
        monkeypatch.setattr(pool, "batch", lambda slots, lens: _record(batch(slots, lens), kinds))
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": MAX_NEW},
                               lora_path=names)
        assert [o["output_ids"] for o in outs] == [expected[n][i] for i, n in enumerate(names)]
        assert {"runs", "gathered"} <= set().union(*kinds), "the prefill took both paths"
        q, kv = (engine.model_config.num_heads * engine.model_config.head_dim,
                 engine.model_config.num_kv_heads * engine.model_config.head_dim)
        blocks = {ref.lora_name: pool.blocks["qkv"][0][pool.slot_of[ref.lora_id]] for ref in engine.lora_adapters()}
        assert [(b.ranks, b.outputs) for b in blocks["q"]] == [(slice(0, 8), slice(0, q))]  # k, v never multiplied
        assert [(b.ranks, b.outputs) for b in blocks["kvu"]] == [(slice(0, 4), slice(q, q + kv)),
                                                                 (slice(4, 8), slice(q + kv, q + 2 * kv))]
        engine.check_memory()


def _record(batch, kinds: list[set[str]]):
    if batch is not None:
        kinds.append({"runs" if isinstance(rows, list) else "gathered" for _, rows in batch.segments})
    return batch


@pytest.fixture(scope="module")
def mixed_adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-bf16")
    return {"every": make_adapter(tiny_llama, root / "every", AdapterSpec(8, 16, tuple(EVERY)), 41),
            "qv": make_adapter(tiny_llama, root / "qv", AdapterSpec(4, 8, ("q_proj", "v_proj"), rslora=True), 42)}


@pytest.fixture(scope="module")
def bfloat16_case(tiny_llama, mixed_adapters):
    """Prompts mixing the adapters and the base, the flags, and the float32 model's outputs with
    them (logprobs and the top two), its base outputs and its slot's bytes: the reference."""
    prompts = random_prompts(14, 512, 4, 40, seed=43) + random_prompts(2, 512, 100, 140, seed=44)
    names = [("every", "qv", None)[i % 3] for i in range(len(prompts))]
    lora_paths = [f"{n}={p}" for n, p in mixed_adapters.items()]
    with Engine(tiny_llama, dtype="float32", lora_paths=lora_paths) as engine:
        ref = engine.generate(input_ids=prompts, sampling_params=BF16_PARAMS, lora_path=names, return_logprob=True,
                              top_logprobs_num=2)
        base = engine.generate(input_ids=prompts, sampling_params=BF16_PARAMS)
        float32_slot = engine.runner.lora_pool.slot_bytes()
    changed = [r["output_ids"][0] != b["output_ids"][0] for r, b in zip(ref, base)]
    assert sum(changed) >= len(prompts) // 2, "the adapters must change most first tokens"
    return prompts, names, lora_paths, ref, float32_slot


@pytest.mark.parametrize("arch", CPU_BUILDS)
def test_bfloat16_slots_stay_close_to_float32(tiny_llama, bfloat16_case, arch, monkeypatch):
    """On a bfloat16 model the slots are bfloat16 (half a float32 slot's bytes; before,
    memory_pool.py:LoRAMemoryPool.__init__ made them float32 whatever the model), and the first
    two tokens (the one-call step's on CPU, which widens the slots as it reads them) stay as close
    to the float32 model with the same adapters as bfloat16 stays without adapters
    (helpers.py: assert_bfloat16_close): a slot misread, or its delta dropped, moves them further
    (the adapters change most first tokens). For each instruction set the step is built for
    (native; on x86 also AVX2 and no SIMD): cpu_step.cpp's load_slot for bfloat16 made to shift
    by 15 bits, not 16, in the AVX2 build alone and then in the no-SIMD build alone failed that
    build's case alone."""
    prompts, names, lora_paths, ref, float32_slot = bfloat16_case
    if arch != "native":
        build_for(arch, monkeypatch)
    with Engine(tiny_llama, dtype="bfloat16", lora_paths=lora_paths) as engine:
        pool: LoRAMemoryPool = engine.runner.lora_pool
        assert pool.a["qkv"].dtype == pool.b["down"].dtype == torch.bfloat16
        assert pool.slot_bytes() * 2 == float32_slot
        if arch != "native":
            assert engine.runner.step is not None, "the step reads the bfloat16 slots"
        outs = engine.generate(input_ids=prompts, sampling_params=BF16_PARAMS, lora_path=names, return_logprob=True)
        engine.check_memory()
    assert_bfloat16_close(outs, ref, 2)


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_phi3"])
def test_a_llama_cpp_lora_gguf_gives_the_ids_of_its_peft_original(family, request, tmp_path):
    """A PEFT adapter (rsLoRA, every projection) written as llama.cpp's LoRA GGUF and served from
    --lora-paths gives PEFT's ids. The file holds a Llama's q and k rows of lora_b reordered for
    llama.cpp's rope (read as they are, gguf_adapter.py without _unpermute_rows, the ids differ);
    Phi-3's fused projections keep their GGUF names. A model's GGUF is refused by name."""
    base = request.getfixturevalue(family)
    targets = PHI3_EVERY if family == "tiny_phi3" else EVERY
    peft_dir = make_adapter(base, tmp_path / "peft", AdapterSpec(8, 16, tuple(targets), rslora=True), 51)
    gguf_path = str(tmp_path / "adapter.gguf")
    write_lora_gguf(base, peft_dir, gguf_path)
    prompts = random_prompts(4, 512, 4, 30, seed=52)
    expected = peft_greedy(base, peft_dir, prompts, MAX_NEW)
    assert expected != peft_greedy(base, None, prompts, MAX_NEW), "the adapter must change the ids"
    with Engine(base, dtype="float32", lora_paths=[f"g={gguf_path}"]) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": MAX_NEW},
                               lora_path=["g"] * len(prompts))
        assert [o["output_ids"] for o in outs] == expected
        model_file = GGUFWriter(str(tmp_path / "model.gguf"), "llama")
        model_file.add_type("model")
        model_file.write_header_to_file()
        model_file.write_kv_data_to_file()
        model_file.close()
        with pytest.raises(ValueError, match=r"LoRA adapter 'm': .*model.gguf is not a LoRA adapter"):
            engine.load_lora_adapter("m", str(tmp_path / "model.gguf"))
        engine.check_memory()
