"""How requests with adapters are scheduled and cached: at most --max-loras-per-batch adapters in a
pass and none left waiting for good, KV never shared between adapters (the radix cache's extra
key) while requests of one adapter share prefixes, and a session keeps the adapter it began with."""

from __future__ import annotations

import pytest

from baby_sgl import Engine
from helpers import GREEDY, random_prompts
from peft_adapters import ATTENTION, AdapterSpec, make_adapter, peft_greedy

MAX_NEW = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """Four attention adapters over the tiny Llama: name -> path."""
    root = tmp_path_factory.mktemp("lora-batching")
    return {f"l{i}": make_adapter(tiny_llama, root / f"l{i}", AdapterSpec(4 + 4 * i, 8, tuple(ATTENTION)), 10 + i)
            for i in range(4)}


def test_a_batch_holds_at_most_max_loras_per_batch_adapters(tiny_llama, adapters, monkeypatch):
    """Twelve requests over four adapters with two slots: every pass uses at most two adapters,
    every request finishes with PEFT's ids (the ones whose adapter did not fit waited, then ran).
    Before the admission check (managers/scheduler/prefill.py:_admit_waiting admitted any adapter)
    the first pass took all four and the pool's slot assignment failed."""
    prompts = random_prompts(12, 512, 3, 30, seed=5)
    names = [f"l{i % 4}" for i in range(12)]
    expected = {n: peft_greedy(tiny_llama, adapters[n], prompts, MAX_NEW) for n in adapters}
    with Engine(tiny_llama, dtype="float32", max_loras_per_batch=2,
                lora_paths=[f"{n}={p}" for n, p in adapters.items()]) as engine:
        pool = engine.runner.lora_pool
        per_pass: list[set[str]] = []
        prepare = pool.prepare
        monkeypatch.setattr(pool, "prepare", lambda ids: per_pass.append({n for n in ids if n}) or prepare(ids))
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": MAX_NEW},
                               lora_path=names)
        assert [o["output_ids"] for o in outs] == [expected[n][i] for i, n in enumerate(names)]
        assert max(map(len, per_pass)) == 2 and len(set().union(*per_pass)) == len(adapters)
        engine.check_memory()


def test_kv_is_shared_within_an_adapter_and_never_across(tiny_llama, adapters):
    """The same prompt under l0, then l1, then l0 again: l1 finds nothing cached (its K/V differ
    from l0's) and gives its own ids; l0's second request reuses l0's prefix. Before the extra key
    (mem_cache/radix_cache.py:match_prefix matched tokens alone) l1 reused l0's KV and its ids
    came out as l0's."""
    prompt = random_prompts(1, 512, 40, 41, seed=9)
    expected = {n: peft_greedy(tiny_llama, adapters[n], prompt, MAX_NEW)[0] for n in ("l0", "l1")}
    with Engine(tiny_llama, dtype="float32", lora_paths=[f"{n}={adapters[n]}" for n in ("l0", "l1")]) as engine:
        params = {**GREEDY, "max_new_tokens": MAX_NEW}
        runs = [engine.generate(input_ids=prompt[0], sampling_params=params, lora_path=n) for n in ("l0", "l1", "l0")]
        assert [r["output_ids"] for r in runs] == [expected["l0"], expected["l1"], expected["l0"]]
        cached = [r["meta_info"]["cached_tokens"] for r in runs]
        assert cached[1] == 0 and cached[2] >= len(prompt[0]) - 1
        base = engine.generate(input_ids=prompt[0], sampling_params=params)
        assert base["meta_info"]["cached_tokens"] == 0
        engine.check_memory()


def test_a_session_keeps_its_adapter(tiny_llama, adapters):
    """A streaming session's second turn, naming no adapter, continues with the first turn's (its
    KV was computed with it): its ids are PEFT's over the whole context. Naming another adapter is
    refused by name. Before (managers/session_controller.py:attach left the turn's adapter as
    given) the second turn ran with the base model over l0's KV."""
    first, second = random_prompts(2, 512, 10, 20, seed=11)
    with Engine(tiny_llama, dtype="float32", lora_paths=[f"{n}={adapters[n]}" for n in ("l0", "l1")]) as engine:
        params = {**GREEDY, "max_new_tokens": MAX_NEW}
        sid = engine.open_session(1000, streaming=True)
        one = engine.generate(input_ids=first, sampling_params=params, lora_path="l0",
                              session_params={"id": sid})
        context = first + one["output_ids"] + second
        two = engine.generate(input_ids=second, sampling_params=params,
                              session_params={"id": sid, "rid": one["meta_info"]["id"]})
        assert two["output_ids"] == peft_greedy(tiny_llama, adapters["l0"], [context], MAX_NEW)[0]
        with pytest.raises(ValueError, match=r"'l0#\d+'.*cannot change it.*'l1#\d+'"):
            engine.generate(input_ids=second, sampling_params=params, lora_path="l1",
                            session_params={"id": sid, "rid": two["meta_info"]["id"]})
        engine.close_session(sid)
        engine.check_memory()


def test_an_adapter_loaded_again_under_its_name_does_not_find_the_old_kv(tiny_llama, adapters):
    """"x" from l0's files, unloaded, then "x" from l1's: the same prompt gets l1's ids, nothing
    cached. Before each load had an id of its own (the name was the radix cache's key,
    lora/registry.py:resolve returned it) the second "x" reused the first one's KV."""
    prompt = random_prompts(1, 512, 40, 41, seed=13)[0]
    expected = peft_greedy(tiny_llama, adapters["l1"], [prompt], MAX_NEW)[0]
    with Engine(tiny_llama, dtype="float32", enable_lora=True, max_lora_rank=16) as engine:
        params = {**GREEDY, "max_new_tokens": MAX_NEW}
        engine.load_lora_adapter("x", adapters["l0"])
        engine.generate(input_ids=prompt, sampling_params=params, lora_path="x")
        engine.unload_lora_adapter("x")
        engine.load_lora_adapter("x", adapters["l1"])
        out = engine.generate(input_ids=prompt, sampling_params=params, lora_path="x")
        assert out["output_ids"] == expected and out["meta_info"]["cached_tokens"] == 0
        engine.check_memory()
