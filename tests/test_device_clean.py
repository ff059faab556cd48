"""Every tensor the engine builds names its device. With torch's default device set to `meta` in
the scheduler's thread, a tensor created without one lands on `meta` and the first op mixing it
with the model's tensors fails: so requests that exercise every path of the scheduler and the
sampler (sampling, penalties, logit_bias, min_new_tokens, seeds, logprobs of prompt and output,
a grammar, a session, chunked prefill, eviction) would end in errors. This is how the test
suite shows, without a GPU, that nothing would be built on the CPU for a model on another device."""

from __future__ import annotations

import pytest
import torch

from baby_sgl import Engine


@pytest.fixture(params=[pytest.param("one-call step", marks=pytest.mark.cpu_only("the CPU's one-call decode step")),
                        "op by op, mixed chunks"])
def meta_default_engine(tiny_llama, request):
    op_by_op = request.param != "one-call step"
    with Engine(tiny_llama, dtype="float32", chunked_prefill_size=16, max_total_tokens=256, page_size=4,
                enable_mixed_chunk=op_by_op) as engine:
        if op_by_op:  # decode through the model's modules and the attention backend (shared prefixes grouped)
            engine.scheduler.call(lambda: setattr(engine.runner, "step", None))
        assert (engine.runner.step is None) == op_by_op
        engine.scheduler.call(lambda: torch.set_default_device("meta"))
        assert engine.scheduler.call(lambda: torch.empty(1).device.type) == "meta"
        yield engine
        engine.scheduler.call(lambda: torch.set_default_device(None))


def test_every_path_runs_with_meta_as_the_default_device(meta_default_engine):
    engine = meta_default_engine
    prompt = list(range(5, 45))
    cases = [
        {"temperature": 0, "max_new_tokens": 6},
        {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "seed": 7, "max_new_tokens": 6},
        {"temperature": 1.0, "max_new_tokens": 6},  # the whole vocabulary, no cut
        {"temperature": 0.7, "top_p": 0.5, "max_new_tokens": 6},  # top_p alone
        {"temperature": 0, "repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.4,
         "max_new_tokens": 6},
        {"temperature": 0, "logit_bias": {"7": 5.0, "11": -100.0}, "max_new_tokens": 6},
        {"temperature": 0, "min_new_tokens": 4, "max_new_tokens": 6},
        {"temperature": 0, "regex": "(ab|cd)+", "max_new_tokens": 6},
    ]
    outs = engine.generate(input_ids=[prompt] * len(cases), sampling_params=cases, return_logprob=True,
                           top_logprobs_num=3, logprob_start_len=30, token_ids_logprob=[3, 4])
    for case, out in zip(cases, outs):
        assert "error" not in out and out["meta_info"]["finish_reason"]["type"] in ("stop", "length"), (case, out)
        meta = out["meta_info"]
        assert len(meta["output_token_logprobs"]) == len(out["output_ids"])
        assert len(meta["input_token_logprobs"]) == len(prompt) - 30
    sid = engine.open_session(1000, streaming=True)
    first = engine.generate(input_ids=prompt[:20], sampling_params={"temperature": 0, "max_new_tokens": 4},
                            session_params={"id": sid})
    second = engine.generate(input_ids=prompt[20:], sampling_params={"temperature": 0, "max_new_tokens": 4},
                             session_params={"id": sid, "rid": first["meta_info"]["id"]})
    assert second["meta_info"]["finish_reason"]["type"] == "length" and len(second["output_ids"]) == 4
    engine.close_session(sid)
    # More distinct prompts than the pool holds: the radix cache evicts as it admits them.
    many = engine.generate(input_ids=[[i] * 60 for i in range(50, 58)],
                           sampling_params={"temperature": 0, "max_new_tokens": 3})
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in many), many
    assert engine.flush_cache()
    engine.check_memory()


@pytest.mark.parametrize("family", ["tiny_qwen3_moe", "tiny_mistral", "tiny_phi3", "tiny_gemma3"])
def test_every_familys_paths_run_with_meta_as_the_default_device(family, request):
    """The families' own paths (experts and their routing, sliding-window metadata, partial rope,
    Gemma's norms, embedding scale and two ropes) also name their devices: prompts longer than the
    windows, chunked, greedy and sampled."""
    with Engine(request.getfixturevalue(family), dtype="float32", chunked_prefill_size=16, page_size=4,
                max_total_tokens=1024) as engine:
        # Decode op by op too (the one-call CPU step would take every decode batch).
        engine.scheduler.call(lambda: setattr(engine.runner, "step", None))
        engine.scheduler.call(lambda: torch.set_default_device("meta"))
        try:
            outs = engine.generate(input_ids=[list(range(5, 45)), list(range(100, 170))],
                                   sampling_params=[{"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
                                                    {"temperature": 0.8, "top_p": 0.9, "seed": 3, "max_new_tokens": 6,
                                                     "ignore_eos": True}])
            assert all("error" not in o and len(o["output_ids"]) == 6 for o in outs), outs
        finally:
            engine.scheduler.call(lambda: torch.set_default_device(None))
        engine.check_memory()
