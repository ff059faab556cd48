"""--tp-size 2 over gloo: greedy outputs equal transformers' for the tiny Llama in every cache
setting and for every other family in the radix one, the default model runs split, every rank's memory is checked, splits the model
does not allow are refused by name, and no rank outlives its engine or server."""

from __future__ import annotations

import functools
import os
import signal
import subprocess

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from baby_sgl import Engine
from baby_sgl.distributed import tp_plan
from baby_sgl.errors import EngineDeadError
from baby_sgl.model_config import ModelConfig
from entrypoints.conftest import all_gone, child_pids, start_server
from helpers import CONFIGS, GREEDY, TINY_KW, hf_greedy, random_prompts, shared_prefix_prompts, wait_until

MAX_NEW = 24
# The cache settings of invariant 6 (compile is refused with tensor parallelism, tested below).
TP_CONFIGS = ["radix", "no-radix", "page16", "chunked", "retract", "mixed-chunk-retract",
              "spec-ngram-page4-chunked-retract"]

# Ranks are CPU processes over gloo here; on GPUs they would need NCCL and a GPU each.
pytestmark = pytest.mark.cpu_only("tensor parallelism between CPU processes over gloo")


def _followers() -> list[int]:
    """Tensor-parallel rank processes started by this test process."""
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(os.getpid())], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "baby_sgl.distributed.tp_worker" in line]


@functools.cache
def _case(path: str) -> tuple[str, list[list[int]], list[list[int]]]:
    """A checkpoint, prompts, and transformers' greedy outputs for them (once per checkpoint)."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(10, 512, 3, 90) + shared_prefix_prompts(6, 512, 40)
    return path, prompts, hf_greedy(hf, prompts, MAX_NEW)


# Qwen3: q/k norms pass to every rank whole; the MoE families: every rank holds a slice of every
# expert (Qwen3-MoE with a dense layer between, Mixtral under its own tensor names); Mistral: every
# rank attends over the same sliding window; Phi-3: q/k/v and gate/up stored fused, cut per part;
# Gemma 3: the partial sums completed before its post-attention and post-MLP norms. What they add
# is in the model, not the cache: the radix setting each, and for the two whose layers differ most
# from Llama's (experts, Gemma's norms) also the setting that chunks, mixes and retracts. (Each
# case starts three processes: the whole product of families and settings took minutes of CI.)
FAMILY_CASES = [(f, "radix") for f in ("tiny_qwen2", "tiny_qwen3", "tiny_qwen3_moe", "tiny_mixtral", "tiny_mistral",
                                       "tiny_phi3", "tiny_gemma3")] + \
    [("tiny_qwen3_moe", "mixed-chunk-retract"), ("tiny_gemma3", "mixed-chunk-retract")]


@pytest.mark.parametrize("config", TP_CONFIGS)
def test_tp2_greedy_matches_transformers(tiny_llama, config):
    """Llama in every cache setting."""
    _check_tp2(_case(tiny_llama), config)


@pytest.mark.parametrize(("family", "config"), FAMILY_CASES)
def test_tp2_greedy_matches_transformers_for_every_family(request, family, config):
    _check_tp2(_case(request.getfixturevalue(family)), config)


def _check_tp2(case: tuple[str, list[list[int]], list[list[int]]], config: str) -> None:
    path, prompts, expected = case
    with Engine(path, dtype="float32", tp_size=2, **CONFIGS[config]) as engine:
        assert len(_followers()) == 1
        params = {**GREEDY, "max_new_tokens": MAX_NEW}
        first = engine.generate(input_ids=prompts, sampling_params=params)
        second = engine.generate(input_ids=prompts, sampling_params=params)  # largely from the cache
        for i, (a, b) in enumerate(zip(first, second)):
            assert a["output_ids"] == expected[i], f"prompt {i} differs under tp=2, {config}"
            assert b["output_ids"] == expected[i], f"prompt {i} differs under tp=2, {config} (cached round)"
        if "retract" in config:
            assert engine.get_server_info()["num_retractions"] > 0
        engine.check_memory()  # rank 0's ownership identity, and every rank's slot table and pool
    assert _followers() == []


def test_tp4_copies_kv_heads(tiny_qwen3_moe):
    """4 ranks, 2 KV heads: each KV head on two ranks, which split its query heads (and the
    experts' matrices four ways)."""
    path, prompts, expected = _case(tiny_qwen3_moe)
    with Engine(path, dtype="float32", tp_size=4, page_size=4) as engine:
        assert len(_followers()) == 3
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": MAX_NEW})
        assert [o["output_ids"] for o in outs] == expected
        engine.check_memory()
    assert _followers() == []


def test_default_model_runs_split():
    prompts = ["The capital of France is", "List three colours:", "1, 2, 3, 4,"]
    params = {"temperature": 0, "max_new_tokens": 16}
    with Engine(dtype="float32") as engine:
        expected = [o["output_ids"] for o in engine.generate(prompts, params)]
    with Engine(dtype="float32", tp_size=2) as engine:
        assert engine.generate(prompts, params)[0]["text"].lstrip().startswith("Paris")
        assert [o["output_ids"] for o in engine.generate(prompts, params)] == expected
        engine.check_memory()
    assert _followers() == []


def test_a_rank_out_of_step_is_caught(tiny_llama):
    """The memory check compares every rank's request-to-slot table with rank 0's: a write that
    does not reach the other ranks is found, and the engine stops (its passes would be wrong)."""
    with Engine(tiny_llama, dtype="float32", tp_size=2) as engine:
        engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params={**GREEDY, "max_new_tokens": 2})
        engine.check_memory()
        table = engine.runner.req_to_token_pool.req_to_token
        table[0, 0] += 1  # behind the journal's back
        with pytest.raises(EngineDeadError, match="rank 1 is out of step"):
            engine.check_memory()
        assert not engine.is_alive()
    assert _followers() == []  # killed: a rank may not be between passes


@pytest.mark.parametrize(("tp_size", "message"), [
    (8, "tp_size 8 is larger than the model's 4 attention heads"),
    (3, "with more ranks than its 2 KV heads"),
])
def test_splits_the_model_does_not_allow_are_refused(tiny_llama, tp_size, message):
    with pytest.raises(ValueError, match=message):
        Engine(tiny_llama, dtype="float32", tp_size=tp_size)
    assert _followers() == []


def test_more_ranks_than_gpus_are_refused(tiny_llama, monkeypatch):
    """On CUDA each rank takes a GPU of its own. Before: with one GPU and --tp-size 2, rank 1 died on
    a missing cuda:1 and rank 0 waited for it until the collectives' timeout (a 240 s test limit)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="--tp-size 2 puts each rank on a GPU of its own, and torch sees 1"):
        Engine(tiny_llama, dtype="float32", tp_size=2, device="cuda")
    assert _followers() == []


def test_compile_with_tp_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="--enable-torch-compile does not work with --tp-size"):
        Engine(tiny_llama, dtype="float32", tp_size=2, enable_torch_compile=True)


def test_plan_deals_kv_groups_unevenly_when_they_do_not_divide():
    """SmolLM2-135M: 9 query heads in 3 KV groups over 2 ranks go 6+3, the MLP 768+768; with 6
    ranks each KV head is copied to 2 ranks (but its 3 query heads do not split in 2)."""
    cfg = ModelConfig.from_hf({"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
                               "intermediate_size": 1536, "num_hidden_layers": 30, "vocab_size": 49152})
    shards = tp_plan.plan(cfg, 2)
    assert [s.heads for s in shards] == [(0, 6), (6, 9)] and [s.kv_heads for s in shards] == [(0, 2), (2, 3)]
    assert [s.inter for s in shards] == [(0, 768), (768, 1536)]
    assert tp_plan.kv_heads_per_token(cfg, 3) == 3
    with pytest.raises(ValueError, match="must split its 3 query heads evenly"):
        tp_plan.plan(cfg, 6)
    tiny = ModelConfig.from_hf({**TINY_KW, "num_hidden_layers": 2})
    assert [s.kv_heads for s in tp_plan.plan(tiny, 4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # copies
    assert tp_plan.kv_heads_per_token(tiny, 4) == 4


def _serve(tiny_llama) -> tuple[str, subprocess.Popen]:
    proc, base = start_server(tiny_llama, "--dtype", "float32", "--tp-size", "2", "--max-total-tokens", "2048")
    return base, proc


def test_server_with_tp_stops_every_rank(tiny_llama):
    base, proc = _serve(tiny_llama)
    try:
        body = {"text": "hello there", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        r = httpx.post(base + "/generate", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 8
        assert httpx.get(base + "/debug/check_memory", headers={"Content-Type": "application/json"}).status_code == 200
        ranks = child_pids(proc.pid)
        assert len(ranks) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        wait_until(lambda: all_gone(ranks), "every rank to exit with the server", timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_dead_rank_stops_the_server_with_a_clear_error(tiny_llama):
    """kill -9 of rank 1: the next pass fails on rank 0, the requests end with the reason, the
    server exits with code 1 (for a supervisor to restart it) instead of hanging."""
    base, proc = _serve(tiny_llama)
    try:
        (rank,) = child_pids(proc.pid)
        os.kill(rank, signal.SIGKILL)
        body = {"text": "hello there", "sampling_params": {"max_new_tokens": 8}}
        r = httpx.post(base + "/generate", json=body, timeout=120)
        assert r.status_code >= 500 or r.json()["meta_info"]["finish_reason"]["type"] == "abort", r.text
        assert "tensor-parallel" in r.text, r.text
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
