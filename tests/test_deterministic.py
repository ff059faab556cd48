"""--enable-deterministic-inference: a request's output ids and logprobs are the same bits whatever
it is batched with, however its prompt is chunked, whether its prefix was cached, at any page
size, with speculation on or off; seeded sampling draws the same tokens; the HTTP server's
concurrent clients get what a client alone gets.

Without the mode these runs part. On the default model in bfloat16 (2-core Zen 4), 8 prompts of
40-300 tokens, 24 tokens out, against the same prompts run alone: among 40 others 5/8 outputs
identical and 0/8 with bit-identical logprobs, and the same 5/8 and 0/8 with the radix cache off,
chunks of 16 at page size 16, mixed chunks, and n-gram speculation; with the mode, 8/8 and 8/8 in
every one. The causes: prefill ran op by op (torch's GEMMs, whose blocking follows the row
count, and another attention kernel) while decode ran in the one-call step, and the step chose
its product kernels by row count (model_executor/model_runner.py: _forward, cpu_step.cpp:
linear)."""

from __future__ import annotations

import concurrent.futures
import random

import httpx
import pytest
from gguf import GGMLQuantizationType as G

from baby_sgl import Engine
from entrypoints.conftest import serve_checked
from gguf_writer import write_tiny_gguf

pytestmark = pytest.mark.cpu_only("the mode runs the CPU's one-call step")

PROBES = 8
OUT = 24


@pytest.fixture(scope="module")
def q4_0_llama(tiny_llama, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("det-gguf") / "tiny-q4_0.gguf")
    write_tiny_gguf(tiny_llama, path, G.Q4_0)
    return path


@pytest.fixture(scope="module", params=["dense", "q4_0"])
def model(request, tiny_llama, q4_0_llama) -> str:
    """Plain bfloat16 weights (bfloat16 products), and a Q4_0 GGUF (int8 products)."""
    return tiny_llama if request.param == "dense" else q4_0_llama


def _prompts(seed: int, count: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randrange(lo, hi))] for _ in range(count)]


PROBE_PROMPTS = _prompts(0, PROBES, 20, 300)
OTHERS = _prompts(1, 40, 1, 400)
GREEDY = {"temperature": 0, "max_new_tokens": OUT, "ignore_eos": True}


def _seeded(i: int) -> dict:
    return {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 1000 + i, "max_new_tokens": OUT, "ignore_eos": True}


def _run(engine: Engine, prompts: list[list[int]], params: list[dict]) -> list[tuple[list[int], list[float]]]:
    """The first PROBES outputs: ids and logprobs (floats compare equal only if bit-identical,
    NaN aside, which a logprob never is)."""
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    return [(o["output_ids"], [lp[0] for lp in o["meta_info"]["output_token_logprobs"]]) for o in outs[:PROBES]]


def _alone(engine: Engine, params: list[dict]) -> list[tuple[list[int], list[float]]]:
    return [_run(engine, [p], [sp])[0] for p, sp in zip(PROBE_PROMPTS, params)]


# Settings to vary: radix cache, chunk size, page size, speculation, mixed chunks, retraction.
SETTINGS = {
    "radix": {},
    "no-radix-chunk16-page16-ngram": {"disable_radix_cache": True, "chunked_prefill_size": 16, "page_size": 16,
                                      "speculative_algorithm": "NGRAM"},
    "chunk64-page16": {"chunked_prefill_size": 64, "page_size": 16},
    "mixed-chunk16-ngram": {"enable_mixed_chunk": True, "chunked_prefill_size": 16, "speculative_algorithm": "NGRAM"},
    "no-chunking-page16-ngram": {"chunked_prefill_size": -1, "page_size": 16, "speculative_algorithm": "NGRAM"},
    "retract-chunk64": {"chunked_prefill_size": 64, "max_total_tokens": 1200, "schedule_conservativeness": 0.0,
                        "disable_radix_cache": True},
}


def _engine(model: str, **overrides) -> Engine:
    return Engine(model, **{"dtype": "bfloat16", "enable_deterministic_inference": True, "max_total_tokens": 16384,
                            "debug_memory_check": True, **overrides})


@pytest.fixture(scope="module")
def reference(model):
    """Each probe alone, greedy and seeded, on a fresh engine with the default settings."""
    with _engine(model) as engine:
        greedy = _alone(engine, [GREEDY] * PROBES)
        seeded = _alone(engine, [_seeded(i) for i in range(PROBES)])
        engine.check_memory()
    return greedy, seeded


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_same_bits_in_any_batch_and_setting(model, reference, setting):
    greedy, seeded = reference
    params = [GREEDY] * PROBES + [{**GREEDY, "max_new_tokens": 1 + i % OUT} for i in range(len(OTHERS))]
    with _engine(model, **SETTINGS[setting]) as engine:
        if setting == "radix":  # half of each probe's prompt already cached, from other requests,
            # and prompts that part from it a token later: a node split where a token differs
            halves = [len(p) // 2 for p in PROBE_PROMPTS]
            engine.generate(input_ids=[p[:h] for p, h in zip(PROBE_PROMPTS, halves)], sampling_params=GREEDY)
            engine.generate(input_ids=[p[: h + 1] + [p[h + 1] % 255 + 4] + p[h + 2 :] for p, h in zip(PROBE_PROMPTS, halves)],
                            sampling_params=GREEDY)
        assert _run(engine, PROBE_PROMPTS + OTHERS, params) == greedy
        seeded_params = [_seeded(i) for i in range(PROBES)] + params[PROBES:]
        assert _run(engine, PROBE_PROMPTS + OTHERS, seeded_params) == seeded
        if engine.engine_args.disable_radix_cache is False:  # now every probe's whole prompt is cached
            assert _run(engine, PROBE_PROMPTS, [GREEDY] * PROBES) == greedy
        if setting.startswith("retract"):
            assert engine.get_server_info()["num_retractions"] > 0
        engine.check_memory()


def test_a_sessions_context_gives_the_bits_of_the_whole_prompt(model):
    """A session's second turn attends over KV its first turn computed (the prompt as a prefill,
    the answer one decode pass at a time); the same text as one fresh prompt gets the same bits.
    A streaming session keeps that KV itself (a normal one would find it through the radix cache,
    off here, and prefill the whole text again)."""
    first, second = PROBE_PROMPTS[0], PROBE_PROMPTS[1][:40]
    with _engine(model, disable_radix_cache=True) as engine:
        sid = engine.open_session(1000, streaming=True)
        turn1 = engine.generate(input_ids=first, sampling_params=GREEDY, session_params={"id": sid})
        turn2 = _run_one(engine, second, {"id": sid, "rid": turn1["meta_info"]["id"]})
        engine.close_session(sid)
        fresh = _run_one(engine, first + turn1["output_ids"] + second, None)
        assert turn2 == fresh
        engine.check_memory()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "bfloat16"])
def test_a_decode_step_gives_the_bits_of_a_prefill(tiny_llama_head64, kv_cache_dtype):
    """A token's logprob from a decode step (attention.h: attend_row_v, which widens a 1- or
    2-byte pool's values once a block for all of a KV head's query heads) is the one a prefill of
    the same text gives at its last position (attend_rows_v, the block widened for all rows)."""
    prompt = PROBE_PROMPTS[0]
    with _engine(tiny_llama_head64, kv_cache_dtype=kv_cache_dtype, disable_radix_cache=True) as engine:
        ids, logprobs = _run_one(engine, prompt, None)
        for i in range(OUT // 2, OUT):
            o = engine.generate(input_ids=prompt + ids[:i], sampling_params={**GREEDY, "max_new_tokens": 1},
                                return_logprob=True)
            assert (o["output_ids"][0], o["meta_info"]["output_token_logprobs"][0][0]) == (ids[i], logprobs[i])
        engine.check_memory()


def _run_one(engine: Engine, ids: list[int], session: dict | None) -> tuple[list[int], list[float]]:
    o = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True, session_params=session)
    return o["output_ids"], [lp[0] for lp in o["meta_info"]["output_token_logprobs"]]


def test_float32_too(tiny_llama):
    params = [GREEDY] * PROBES + [{**GREEDY, "max_new_tokens": 1 + i % OUT} for i in range(len(OTHERS))]
    with _engine(tiny_llama, dtype="float32") as engine:
        alone = _alone(engine, [GREEDY] * PROBES)
    with _engine(tiny_llama, dtype="float32", chunked_prefill_size=16, page_size=16,
                 speculative_algorithm="NGRAM") as engine:
        assert _run(engine, PROBE_PROMPTS + OTHERS, params) == alone
        engine.check_memory()


def test_http_clients_at_once_get_what_one_alone_gets(reference, model):
    greedy, _ = reference
    with serve_checked(_engine(model)) as base:
        def generate(ids: list[int], max_new_tokens: int = OUT) -> tuple[list[int], list[float]]:
            r = httpx.post(base + "/generate", json={"input_ids": ids, "return_logprob": True,
                                                     "sampling_params": {**GREEDY, "max_new_tokens": max_new_tokens}},
                           timeout=120)
            r.raise_for_status()
            body = r.json()
            return body["output_ids"], [lp[0] for lp in body["meta_info"]["output_token_logprobs"]]

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            others = [pool.submit(generate, p, 8) for p in OTHERS[:16]]
            probes = [pool.submit(generate, p) for p in PROBE_PROMPTS]
            assert [f.result() for f in probes] == greedy
            for f in others:
                f.result()


def test_refused_where_the_step_does_not_run(tiny_llama):
    with pytest.raises(ValueError, match="--enable-deterministic-inference"):
        Engine(tiny_llama, enable_deterministic_inference=True, tp_size=2)
