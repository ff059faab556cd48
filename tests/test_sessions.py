"""Sessions through the offline Engine: streaming sessions keep their KV row between turns
(also when its length is not page-aligned), normal sessions build each turn from the request it
names; every turn equals generating from scratch on the whole conversation with transformers,
and the memory invariant (with session-held slots) holds with sessions open and after close."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from baby_sgl import Engine
from baby_sgl.managers.session_controller import MAX_TURN_CHAIN, FinishedTurn
from helpers import GREEDY, hf_greedy, wait_until

# Turn lengths chosen so the conversation is almost never page-aligned.
TURN_LENS = [37, 13, 22, 5, 29]
OUT_LENS = [9, 6, 11, 7, 8]


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def _turns(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in TURN_LENS]


def _idle_clean(engine: Engine) -> dict:
    counts = engine.check_memory()
    assert counts["session_held"] == 0 and counts["protected"] == 0, counts
    return counts


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_streaming_session_turns_equal_generation_from_scratch(tiny_llama, hf_model, page_size):
    _check_streaming_session(tiny_llama, hf_model, page_size)


@pytest.mark.parametrize("family", ["tiny_qwen3", "tiny_qwen3_moe", "tiny_mistral", "tiny_phi3", "tiny_gemma3"])
def test_streaming_session_turns_for_every_family(family, request):
    """The session's turns continue the KV already computed, by absolute position: also with q/k
    norms, experts, sliding windows (turns longer than the window) and Gemma's two ropes."""
    path = request.getfixturevalue(family)
    _check_streaming_session(path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), 4)


def _check_streaming_session(path: str, hf_model, page_size: int) -> None:
    # Chunks (16 tokens) smaller than most turns: a turn's prefill is split across steps.
    with Engine(path, dtype="float32", page_size=page_size, chunked_prefill_size=16, debug_memory_check=True) as engine:
        sid = engine.open_session(1000, streaming=True)
        context: list[int] = []
        prev_rid = None
        for i, (turn, n_out) in enumerate(zip(_turns(page_size), OUT_LENS)):
            params = {"id": sid} if prev_rid is None else {"id": sid, "rid": prev_rid}
            out = engine.generate(input_ids=turn, sampling_params={**GREEDY, "max_new_tokens": n_out},
                                  session_params=params)
            prev_context_len = len(context)
            context = context + turn
            assert out["meta_info"]["prompt_tokens"] == len(context)
            assert out["output_ids"] == hf_greedy(hf_model, [context], n_out)[0], f"turn {i}, page {page_size}"
            if i:
                # Everything the previous turn computed (its context less its last token) is reused.
                assert out["meta_info"]["cached_tokens"] >= prev_context_len - 1
            context = context + out["output_ids"]
            prev_rid = out["meta_info"]["id"]
            counts = engine.check_memory()  # idle, the session open: it holds one row
            held = len(context) - 1  # the last output token has no KV yet
            assert counts["session_held"] == -(-(held - held // page_size * page_size) // page_size) * page_size
            assert counts["protected"] == held // page_size * page_size
        engine.close_session(sid)
        _idle_clean(engine)
        with pytest.raises(ValueError, match="is not open"):
            engine.generate(input_ids=[5, 6], session_params={"id": sid})


def test_streaming_session_with_radix_cache_off(tiny_llama, hf_model):
    with Engine(tiny_llama, dtype="float32", page_size=4, disable_radix_cache=True, debug_memory_check=True) as engine:
        sid = engine.open_session(1000, streaming=True)
        context: list[int] = []
        for turn, n_out in zip(_turns(7)[:3], OUT_LENS):
            out = engine.generate(input_ids=turn, sampling_params={**GREEDY, "max_new_tokens": n_out},
                                  session_params={"id": sid})
            if context:
                assert out["meta_info"]["cached_tokens"] == len(context) - 1
            context += turn
            assert out["output_ids"] == hf_greedy(hf_model, [context], n_out)[0]
            context += out["output_ids"]
            assert engine.check_memory()["session_held"] == -(-(len(context) - 1) // 4) * 4
        engine.close_session(sid)
        _idle_clean(engine)


@pytest.fixture(scope="module")
def session_engine(tiny_llama):
    with Engine(tiny_llama, dtype="float32", page_size=4, chunked_prefill_size=16, max_total_tokens=4096,
                debug_memory_check=True) as eng:
        yield eng


def _gen(engine, ids, n_out, **session_params):
    return engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": n_out},
                           session_params=session_params)


def test_normal_session_offset_replace_and_drop_previous_output(session_engine, hf_model):
    engine = session_engine
    t = _turns(11)
    sid = engine.open_session(1000)
    r1 = _gen(engine, t[0], 8, id=sid, rid=None)
    ctx1 = t[0] + r1["output_ids"]
    assert r1["output_ids"] == hf_greedy(hf_model, [t[0]], 8)[0]

    r2 = _gen(engine, t[1], 6, id=sid, rid=r1["meta_info"]["id"])  # plain append
    assert r2["output_ids"] == hf_greedy(hf_model, [ctx1 + t[1]], 6)[0]
    assert r2["meta_info"]["cached_tokens"] >= (len(ctx1) - 1) // 4 * 4  # the radix cache serves the context

    r3 = _gen(engine, t[2], 6, id=sid, rid=r2["meta_info"]["id"])
    r2_ctx = ctx1 + t[1] + r2["output_ids"]
    assert r3["output_ids"] == hf_greedy(hf_model, [r2_ctx + t[2]], 6)[0]

    r4 = _gen(engine, t[3], 5, id=sid, rid=r1["meta_info"]["id"], offset=20)  # cut the context
    assert r4["meta_info"]["prompt_tokens"] == 20 + len(t[3])
    assert r4["output_ids"] == hf_greedy(hf_model, [ctx1[:20] + t[3]], 5)[0]

    r5 = _gen(engine, t[4], 5, id=sid, rid=r1["meta_info"]["id"], drop_previous_output=True)
    assert r5["output_ids"] == hf_greedy(hf_model, [t[0] + t[4]], 5)[0]

    # replace: r1's continuations (r2, r3, r4, r5) are dropped; the new turn continues r1.
    r6 = _gen(engine, t[2], 6, id=sid, rid=r1["meta_info"]["id"], replace=True)
    assert r6["output_ids"] == hf_greedy(hf_model, [ctx1 + t[2]], 6)[0]
    for dropped in (r2, r3, r4, r5):
        with pytest.raises(ValueError, match="has no request"):
            _gen(engine, [7], 2, id=sid, rid=dropped["meta_info"]["id"])
    engine.close_session(sid)
    _idle_clean(engine)



def test_turns_keep_their_own_tokens_and_refer_to_the_rest(session_engine, hf_model):
    """Before: session_controller.py:FinishedTurn.of kept a copy of each turn's whole context, so
    1023 one-token turns after a context-long one kept 1023 contexts (32 GiB over a server's
    sessions at an 8k context). Each turn now keeps its own tokens and refers to the turn it
    continued, a chain of at most MAX_TURN_CHAIN; the contexts are what they were."""
    engine = session_engine
    sid = engine.open_session(1000)
    context = random.Random(5).choices(range(3, 512), k=300)
    rid = None
    for turn in range(MAX_TURN_CHAIN + 6):
        new = context if turn == 0 else [7 + turn % 50]
        out = _gen(engine, new, 2, id=sid, rid=rid)
        context = (context if turn == 0 else context + new) + out["output_ids"]
        assert out["meta_info"]["prompt_tokens"] == len(context) - 2
        rid = out["meta_info"]["id"]
    assert out["output_ids"] == hf_greedy(hf_model, [context[:-2]], 2)[0]
    turns = engine.scheduler.sessions.sessions[sid].reqs.values()
    kept = sum(len(t.own) for t in turns if isinstance(t, FinishedTurn))
    assert kept < 2 * len(context)  # one copy when the chain is cut at MAX_TURN_CHAIN, and the turns' own 3 tokens
    engine.close_session(sid)
    _idle_clean(engine)


def test_invalid_session_operations_are_refused(session_engine):
    engine = session_engine
    with pytest.raises(ValueError, match="is not open"):
        _gen(engine, [5, 6], 2, id="no-such-session")
    with pytest.raises(ValueError, match="capacity_of_str_len"):
        engine.open_session(-1)
    engine.close_session(engine.open_session(0))  # SGLang's own client sends 0: accepted, as SGLang
    sid = engine.open_session(100, session_id="s-invalid", streaming=True)
    with pytest.raises(ValueError, match="already open"):
        engine.open_session(100, session_id="s-invalid")
    for bad in ({"replace": True}, {"offset": 3}, {"drop_previous_output": True}):
        with pytest.raises(ValueError, match="append-only"):
            _gen(engine, [5, 6], 2, id=sid, **bad)
    with pytest.raises(ValueError, match="unknown field .session_params"):
        _gen(engine, [5, 6], 2, id=sid, bogus=1)
    with pytest.raises(ValueError, match="one request"):
        engine.generate(input_ids=[5, 6], sampling_params={"n": 2, "max_new_tokens": 2},
                        session_params={"id": sid})

    # A second request while one is in flight on a streaming session.
    done = threading.Event()
    first = engine.submit(input_ids=[9] * 10, sampling_params={**GREEDY, "max_new_tokens": 400},
                          on_output=lambda c: c["finished"] and done.set(), session_params={"id": sid})[0]
    with pytest.raises(ValueError, match="already has a request in flight"):
        _gen(engine, [5, 6], 2, id=sid)
    engine.abort_request(first.rid)
    assert done.wait(30)

    # Appending to a request that is still running (normal session).
    nsid = engine.open_session(100)
    done.clear()
    running = engine.submit(input_ids=[8] * 10, sampling_params={**GREEDY, "max_new_tokens": 400},
                            on_output=lambda c: c["finished"] and done.set(), session_params={"id": nsid})[0]
    with pytest.raises(ValueError, match="still running"):
        _gen(engine, [5, 6], 2, id=nsid, rid=running.rid)
    with pytest.raises(ValueError, match="already used"):
        engine.generate(input_ids=[5], rid=running.rid, session_params={"id": nsid})
    engine.abort_request(running.rid)
    assert done.wait(30)
    for s in (sid, nsid):
        engine.close_session(s)
    with pytest.raises(ValueError, match="is not open"):
        engine.close_session(sid)
    _idle_clean(engine)


def test_aborted_streaming_turn_frees_its_kv_and_the_session_goes_on(session_engine, hf_model):
    engine = session_engine
    t = _turns(5)
    sid = engine.open_session(1000, streaming=True)
    a = _gen(engine, t[0], 6, id=sid)
    chunks = []
    for chunk in engine.generate(input_ids=t[1], sampling_params={**GREEDY, "max_new_tokens": 400},
                                 stream=True, session_params={"id": sid}):
        chunks.append(chunk)
        if len(chunks) == 3:
            engine.abort_request(chunk["meta_info"]["id"])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    partial = [tok for c in chunks for tok in c["output_ids"]]
    # An aborted turn gives its KV back (whole pages stay in the radix cache).
    assert engine.check_memory()["session_held"] == 0
    c = _gen(engine, t[2], 7, id=sid)
    context = t[0] + a["output_ids"] + t[1] + partial + t[2]
    assert c["meta_info"]["prompt_tokens"] == len(context)
    assert c["output_ids"] == hf_greedy(hf_model, [context], 7)[0]
    engine.close_session(sid)
    _idle_clean(engine)


def test_close_while_a_turn_runs_takes_effect_when_it_ends(session_engine, hf_model):
    engine = session_engine
    sid = engine.open_session(1000, streaming=True)
    first = _gen(engine, [11] * 30, 4, id=sid)
    stream = engine.generate(input_ids=[12] * 7, sampling_params={**GREEDY, "max_new_tokens": 40}, stream=True,
                             session_params={"id": sid})
    chunks = [next(stream)]  # the turn is running: it has produced a token
    engine.close_session(sid)
    with pytest.raises(ValueError, match="is not open"):
        _gen(engine, [5], 2, id=sid)
    chunks += list(stream)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"  # the turn ran to its end, undisturbed
    context = [11] * 30 + first["output_ids"] + [12] * 7
    assert [t for c in chunks for t in c["output_ids"]] == hf_greedy(hf_model, [context], 40)[0]
    _idle_clean(engine)


def test_idle_session_times_out_and_releases_its_kv(session_engine):
    engine = session_engine
    sid = engine.open_session(1000, streaming=True, timeout=0.5)
    _gen(engine, [13] * 21, 5, id=sid)
    assert engine.check_memory()["session_held"] > 0
    wait_until(lambda: engine.check_memory()["session_held"] == 0, "the idle session to give its KV back")
    with pytest.raises(ValueError, match="is not open"):
        _gen(engine, [5], 2, id=sid)
    _idle_clean(engine)


def test_streaming_session_alongside_retraction(tiny_llama, hf_model):
    """A pool so small that decode retracts requests, while a streaming session holds a row."""
    prompts = [[random.Random(i).randrange(3, 512) for _ in range(40)] for i in range(8)]
    with Engine(tiny_llama, dtype="float32", max_total_tokens=320, page_size=4, schedule_conservativeness=0.0,
                debug_memory_check=True) as engine:
        sid = engine.open_session(1000, streaming=True)
        context: list[int] = []
        for k, turn in enumerate(_turns(3)[:3]):
            done = threading.Event()
            got = {}
            engine.submit(input_ids=turn, sampling_params={**GREEDY, "max_new_tokens": 12},
                          on_output=lambda c, got=got, done=done: c["finished"] and (got.update(c), done.set()),
                          session_params={"id": sid})
            others = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 16})
            assert done.wait(60)
            context += turn
            assert got["output_ids"] == hf_greedy(hf_model, [context], 12)[0], f"turn {k}"
            context += got["output_ids"]
            if k == 0:
                expected = hf_greedy(hf_model, prompts, 16)
            assert [o["output_ids"] for o in others] == expected
        assert engine.get_server_info()["num_retractions"] > 0
        engine.close_session(sid)
        _idle_clean(engine)
