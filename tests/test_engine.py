"""The offline Engine API: results, streaming, chat, aborts, bad input, trace log, cache reuse."""

from __future__ import annotations

import json
import os
import platform
import shutil
import threading
import weakref
from pathlib import Path

import pytest
import torch

from baby_sgl import Engine
from helpers import GREEDY, TINY_KW, random_prompts, wait_until


def test_result_shape(engine):
    out = engine.generate("Hello there", {"max_new_tokens": 5, **GREEDY})
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 5 == len(out["output_ids"])
    assert meta["prompt_tokens"] == len(engine.tokenizer.encode("Hello there"))
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def test_batch_returns_list_in_order(engine):
    prompts = ["a", "bb", "ccc"]
    outs = engine.generate(prompts, [{"max_new_tokens": n, **GREEDY} for n in (1, 2, 3)])
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [1, 2, 3]


def test_stream_concatenates_to_final_text(engine):
    for prompt in ["Tell me a story", "用中文介绍一下量子计算"]:
        params = {"max_new_tokens": 24, "temperature": 0.8, "seed": 7}
        final = engine.generate(prompt, params)
        chunks = list(engine.generate(prompt, params, stream=True))
        assert chunks[-1]["finished"]
        assert "".join(c["text"] for c in chunks) == final["text"]
        assert [t for c in chunks for t in c["output_ids"]] == final["output_ids"]


def test_extending_prompt_reuses_cache(engine):
    base = random_prompts(1, 512, 60, 61, seed=5)[0]
    first = engine.generate(input_ids=base, sampling_params={"max_new_tokens": 8, **GREEDY})
    longer = base + first["output_ids"] + [7, 8, 9]
    out = engine.generate(input_ids=longer, sampling_params={"max_new_tokens": 8, **GREEDY})
    assert out["meta_info"]["cached_tokens"] >= len(base)
    with Engine(engine.model_path, dtype="float32", disable_radix_cache=True) as plain:
        ref = plain.generate(input_ids=longer, sampling_params={"max_new_tokens": 8, **GREEDY})
        assert ref["meta_info"]["cached_tokens"] == 0
        plain.check_memory()
    assert out["output_ids"] == ref["output_ids"]


def test_chat_applies_template(engine):
    messages = [{"role": "user", "content": "hi"}]
    ids = engine.apply_chat_template(messages)
    assert engine.tokenizer.decode(ids).endswith("assistant: ")
    out = engine.chat(messages, {"max_new_tokens": 3, **GREEDY})
    assert out["meta_info"]["prompt_tokens"] == len(ids)


def test_stop_conditions(engine):
    out = engine.generate("abc", {"max_new_tokens": 20, **GREEDY})
    token = out["output_ids"][3]
    stopped = engine.generate("abc", {"max_new_tokens": 20, **GREEDY, "stop_token_ids": [token]})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    assert stopped["output_ids"] == out["output_ids"][: out["output_ids"].index(token) + 1]
    text = out["text"]
    # a stop string: the first two whole characters of the output after its first few
    stop = next((text[i:i + 2] for i in range(2, len(text) - 1) if "\ufffd" not in text[i:i + 2]), None)
    assert stop, f"no two clean characters to stop at in {text!r}"
    by_str = engine.generate("abc", {"max_new_tokens": 20, **GREEDY, "stop": stop})
    assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert by_str["text"] == text[: text.index(stop)]


def test_eos_ends_generation_unless_ignored(engine):
    eos = engine.eos_token_ids[0]
    to_eos = {"max_new_tokens": 10, "temperature": 0, "logit_bias": {str(eos): 100.0}}  # EOS is the likeliest
    out = engine.generate("xyz", to_eos)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert out["meta_info"]["completion_tokens"] == 1 and out["output_ids"] == [eos]
    ignored = engine.generate("xyz", to_eos | {"ignore_eos": True})
    assert ignored["meta_info"]["finish_reason"]["type"] == "length" and ignored["output_ids"] == [eos] * 10
    held = engine.generate("xyz", to_eos | {"min_new_tokens": 4})  # EOS masked for the first four
    assert held["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert held["output_ids"][4:] == [eos] and eos not in held["output_ids"][:4]
    engine.check_memory()


def test_abort_running_request(engine):
    results = []
    stream = engine.generate("long one", {"max_new_tokens": 500, **GREEDY}, stream=True, rid="to-abort")

    def consume():
        for chunk in stream:
            results.append(chunk)
            if len(results) == 3:
                engine.abort_request("to-abort")

    t = threading.Thread(target=consume)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "the aborted stream never ended"
    assert results[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert results[-1]["meta_info"]["completion_tokens"] < 500
    info = engine.get_server_info()
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
    engine.check_memory()


def test_stopping_a_stream_early_frees_the_request(engine):
    generated = engine.get_server_info()["generation_tokens"]
    stream = engine.generate("abandon", {"max_new_tokens": 300, **GREEDY}, stream=True, rid="abandoned")
    next(stream)
    stream.close()
    # the abort reaches the scheduler at its next step; the request is then gone, unfinished
    wait_until(lambda: engine.get_server_info()["num_running_reqs"] == 0, what="the abandoned request to end")
    info = engine.get_server_info()
    assert info["num_waiting_reqs"] == 0
    # Left alone it would make all 300 tokens (ignore_eos); the abort cut it short.
    assert info["generation_tokens"] - generated < 300
    engine.check_memory()  # its request slot and KV are back (or with the prefix cache)


@pytest.mark.parametrize("settings", [{"page_size": 16}, {"disable_radix_cache": True}])
def test_an_aborted_request_frees_what_the_cache_does_not_keep(tiny_llama, settings):
    """With the radix cache at page size 1 an aborted request's whole row goes to the tree; here its
    partial last page (or, without the cache, its whole row) is freed by the request itself."""
    with Engine(tiny_llama, dtype="float32", max_total_tokens=4096, debug_memory_check=True, **settings) as eng:
        stream = eng.generate(input_ids=list(range(3, 40)), sampling_params={"max_new_tokens": 300, **GREEDY},
                              stream=True, rid="abandoned")
        next(stream)
        stream.close()
        wait_until(lambda: eng.get_server_info()["num_running_reqs"] == 0, what="the abandoned request to end")
        assert eng.get_server_info()["generation_tokens"] < 300
        eng.check_memory()


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": ""}, "prompt is empty"),
    ({"input_ids": []}, "input_ids is empty"),
    ({"input_ids": [1, 2, 99999]}, "outside the vocabulary"),
    ({"input_ids": [5] * 5000}, "prompt is too long"),
    ({"prompt": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"prompt": "x", "sampling_params": {"temperature": -0.5}}, "temperature"),
    ({"prompt": "x", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"prompt": "x", "sampling_params": {"top_k": 0}}, "top_k"),
    ({"prompt": "x", "sampling_params": {"bogus": 1}}, "unknown field .sampling_params.bogus."),
    ({"prompt": "x", "sampling_params": {"max_new_tokens": "ten"}}, "max_new_tokens"),
    ({"prompt": "x", "input_ids": [1]}, "exactly one of prompt or input_ids"),
    ({"prompt": ["a", "b"], "sampling_params": [{}]}, "got 2 prompts but 1 sampling_params and 2 rids"),
    ({"prompt": ["a", "b"], "rid": ["r1", "r2", "r3"]}, "got 2 prompts but 2 sampling_params and 3 rids"),
])
def test_bad_input_is_refused_with_a_clear_error(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)


def test_bad_request_in_batch_spares_the_others(engine):
    outs = engine.generate(["fine", "", "also fine"], {"max_new_tokens": 3, **GREEDY})
    assert "prompt is empty" in outs[1]["error"]
    assert outs[0]["meta_info"]["completion_tokens"] == 3 == outs[2]["meta_info"]["completion_tokens"]


def test_trace_file_records_batches_and_cache_events(tiny_llama, tmp_path):
    path = tmp_path / "trace.jsonl"
    with Engine(tiny_llama, dtype="float32", trace_file=str(path), max_total_tokens=128) as eng:
        prompts = random_prompts(6, 512, 30, 40, seed=3)
        eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 12, **GREEDY})
        eng.generate(input_ids=prompts[:1], sampling_params={"max_new_tokens": 2, **GREEDY})
        eng.check_memory()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = {e["event"] for e in events}
    assert {"batch", "cache_insert", "cache_evict", "retract"} <= kinds
    extend = next(e for e in events if e["event"] == "batch" and e["mode"] == "EXTEND")
    for (start, end), prefix, ext in zip(extend["positions"], extend["prefix_lens"], extend["extend_lens"]):
        assert start == prefix and end == prefix + ext - 1  # absolute positions (invariant 1)
    assert sum(extend["extend_lens"]) == len(extend["kv_slots"])


def test_context_manager_and_server_info(tiny_llama):
    with Engine(tiny_llama, dtype="float32", page_size=8, max_total_tokens=1000) as eng:
        info = eng.get_server_info()
        assert info["page_size"] == 8 and info["max_total_tokens"] == 1000 // 8 * 8
        eng.check_memory()


@pytest.mark.parametrize("op_by_op", [False, True], ids=["step", "op-by-op"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_closing_an_engine_lets_go_of_its_kv_pool(tiny_llama, kv_cache_dtype, op_by_op, monkeypatch):
    """The pool's memory goes back when the engine stops, not when the engine object is collected
    (it sits in reference cycles until the garbage collector runs), so engines made one after
    another never hold two pools; on the op-by-op path (a GPU, tensor parallelism, no compiler)
    the decode's gathers of the pool go too."""
    if op_by_op:  # and the portable decode (gathers of the pool), as on a GPU
        from baby_sgl.attention import torch_native
        from baby_sgl.cpu import decode_step

        monkeypatch.setattr(decode_step, "can_run", lambda *a, **k: False)
        monkeypatch.setattr(torch_native, "decode_kernel", lambda: None)
    eng = Engine(tiny_llama, dtype="float32", max_total_tokens=1000, kv_cache_dtype=kv_cache_dtype)
    eng.generate("hello there", {**GREEDY, "max_new_tokens": 4})
    eng.check_memory()
    pool = eng.runner.kv_pool
    buffers = [weakref.ref(t) for t in pool.k_buffers + pool.v_buffers + pool.k_scales + pool.v_scales]
    assert len(buffers) >= 2 * eng.runner.cfg.num_layers
    gathers = list(eng.runner.attn_backend.workspace.buffers.values())
    assert (eng.runner.step is None) == op_by_op and (len(gathers) > 0) == op_by_op
    buffers += [weakref.ref(t) for t in gathers]
    del gathers
    eng.shutdown()
    assert [b for b in buffers if b() is not None] == []


def test_mem_fraction_static_sizes_the_pool_as_sglang(tiny_llama, monkeypatch):
    """SGLang's rule: the weights and the pool take the fraction of the memory free at start, so
    the pool is that share less what the engine took for its weights (its own use: engines
    starting together on one device do not count each other's); --max-total-tokens, if given
    too, bounds it; a fraction that leaves no room, one outside (0, 1) or one with --tp-size > 1
    is refused by name. The readings are fixed here (1 GiB free at start, 1 MiB taken by the
    weights) so the sizes are exact on any device; each is taken once, before the weights load
    and after."""
    free_at_start, in_use = 1 << 30, [100 << 20, (100 << 20) + (1 << 20)]
    calls: list[tuple[str, bool]] = []

    def reading(name: str):
        def read(self) -> int:
            calls.append((name, hasattr(self, "model_config")))  # set once the checkpoint is read
            return free_at_start if name == "free" else in_use[sum(c[0] == "in use" for c in calls) - 1]
        return read

    monkeypatch.setattr(Engine, "_free_memory", reading("free"))
    monkeypatch.setattr(Engine, "_memory_in_use", reading("in use"))
    head_dim = TINY_KW["hidden_size"] // TINY_KW["num_attention_heads"]
    per_token = 2 * TINY_KW["num_hidden_layers"] * TINY_KW["num_key_value_heads"] * head_dim * 4  # float32 K and V
    with Engine(tiny_llama, dtype="float32", mem_fraction_static=3 / 1024) as eng:  # 3 MiB: 1 for weights, 2 pool
        assert calls == [("free", False), ("in use", False), ("in use", True)]
        assert eng.get_server_info()["max_total_tokens"] == (2 << 20) // per_token
        assert eng.generate(input_ids=[1, 2, 3], sampling_params={**GREEDY, "max_new_tokens": 4})["output_ids"]
        eng.check_memory()
    calls.clear()
    with Engine(tiny_llama, dtype="float32", mem_fraction_static=3 / 1024, max_total_tokens=1000) as eng:
        assert eng.get_server_info()["max_total_tokens"] == 1000
        eng.check_memory()
    calls.clear()
    with pytest.raises(ValueError, match=r"--mem-fraction-static 0.0005 leaves no room for the KV pool.*raise it"):
        Engine(tiny_llama, dtype="float32", mem_fraction_static=0.0005)  # 0.5 MiB: less than the weights
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="mem_fraction_static must be between 0 and 1"):
            Engine(tiny_llama, mem_fraction_static=bad)
    with pytest.raises(ValueError, match="--mem-fraction-static does not work with --tp-size > 1"):
        Engine(tiny_llama, mem_fraction_static=0.5, tp_size=2)


def test_the_memory_readings_are_of_this_machine(engine):
    """What --mem-fraction-static reads: free memory within the device's, and this process's own."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = torch.cuda.mem_get_info()[1] if engine.device.type == "cuda" else os.sysconf("SC_PHYS_PAGES") * page
    assert 0 < engine._free_memory() <= total
    assert 0 < engine._memory_in_use() <= total


def test_tokenizer_path_and_trust_remote_code(tiny_llama, tmp_path):
    """--tokenizer-path loads the tokenizer from another directory: here the model's own files
    with a tokenizer class of their own (auto_map), which runs only with --trust-remote-code and
    is refused by name without it; the same vocabulary gives the same greedy ids."""
    tok_dir = tmp_path / "tokenizer"
    shutil.copytree(tiny_llama, tok_dir, ignore=shutil.ignore_patterns("*.safetensors", "config.json",
                                                                       "generation_config.json"))
    (tok_dir / "tokenization_shout.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\nclass ShoutTokenizerFast(PreTrainedTokenizerFast):\n"
        "    pass\n")
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="ShoutTokenizerFast",
                  auto_map={"AutoTokenizer": [None, "tokenization_shout.ShoutTokenizerFast"]})
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    params = {**GREEDY, "max_new_tokens": 6}
    with pytest.raises(ValueError, match="runs code of its own .*--trust-remote-code"):
        Engine(tiny_llama, dtype="float32", tokenizer_path=str(tok_dir))
    with Engine(tiny_llama, dtype="float32", tokenizer_path=str(tok_dir), trust_remote_code=True) as eng:
        assert type(eng.tokenizer).__name__ == "ShoutTokenizerFast" and Path(eng.tokenizer_path) == tok_dir
        shouted = eng.generate("Hello there", params)["output_ids"]
        eng.check_memory()
    with Engine(tiny_llama, dtype="float32") as eng:
        assert eng.generate("Hello there", params)["output_ids"] == shouted
        eng.check_memory()
    with pytest.raises(ValueError, match="--tokenizer-path takes a tokenizer's directory"):
        Engine(tiny_llama, tokenizer_path="model.gguf")
    with pytest.raises(FileNotFoundError, match="tokenizer 'no-such/tokenizer' is neither a local path"):
        Engine(tiny_llama, tokenizer_path="no-such/tokenizer")


def test_chat_template_file_replaces_the_models(tiny_llama, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")
    with Engine(tiny_llama, dtype="float32", chat_template=str(template)) as eng:
        ids = eng.apply_chat_template([{"role": "user", "content": "hi"}])
        assert eng.tokenizer.decode(ids) == "<user>hi<assistant>"
    with pytest.raises(ValueError, match="cannot read"):
        Engine(tiny_llama, chat_template=str(tmp_path / "missing.jinja"))
    template.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        Engine(tiny_llama, chat_template=str(template))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc keeps freed heap memory; malloc_trim returns it")
def test_a_stopped_engine_gives_its_kv_pool_back(tiny_llama):
    """glibc serves blocks below its mmap threshold (raised to each large block freed, up to 32
    MB) from a heap it keeps after they are freed: a stopped engine's KV pool stayed resident,
    and engines started one after another in one process (a test run, a notebook) piled up,
    one test worker of the suite reaching 16 GB. Engine.shutdown now trims the heap."""
    def resident_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    pool_mb = 0.0
    for _ in range(2):  # the second start reuses the heap the first one's pool came from
        with Engine(tiny_llama, dtype="float32", max_total_tokens=200_000) as engine:
            engine.generate("hello", {"max_new_tokens": 2})
            engine.check_memory()
            pool = engine.runner.kv_pool  # 2 layers x K and V x 200k slots x 2 heads x 16 dims x 4 bytes: 24 MB each
            pool_mb = sum(b.numel() * b.element_size() for b in pool.k_buffers + pool.v_buffers) / 2**20
            during = resident_mb()
        after = resident_mb()
    assert pool_mb >= 90 and during - after >= 0.8 * pool_mb, (pool_mb, during, after)
