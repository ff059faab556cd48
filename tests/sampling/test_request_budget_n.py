"""What a request costs, counted where the client cannot see it grow: a grammar the server builds
for its tools (or for a json_schema after the thinking) is bounded by what the client sent, not
by the client's own `ebnf` limit; and the lists that cost work at every step of every sample
(stop_token_ids, logit_bias, token_ids_logprob) are bounded over the n samples together."""

from __future__ import annotations

import json

import httpx
import pytest

from baby_sgl import Engine
from baby_sgl.core.sampling_params import (MAX_GRAMMAR_CHARS, MAX_LOGIT_BIAS, SERVER_GRAMMAR_BASE_CHARS,
                                           SERVER_GRAMMAR_CHARS_PER_SOURCE_CHAR, ServerGrammar)
from baby_sgl.entrypoints.tool_grammar import Tool, tool_grammar
from baby_sgl.managers import io_struct
from baby_sgl.managers.io_struct import MAX_LOGPROB_ENTRIES, MAX_TOKEN_IDS_LOGPROB
from baby_sgl.server_args import ServerArgs
from baby_sgl.validation import MAX_N, MAX_STOP, MAX_TOP_LOGPROBS
from entrypoints.conftest import serve_in_thread, thinking_server, wait_idle

USER = [{"role": "user", "content": "Call them."}]
# 24 functions of 10 arguments each: ~3.3k characters of schemas, whose pythonic grammar (a rule
# and two keyword rules per argument) is ~36k characters, past the client's ebnf limit.
MANY = [Tool(f"f{i}", None, {"type": "object", "properties": {chr(97 + j): {} for j in range(10)}})
        for i in range(24)]


def _tools_body(**extra) -> dict:
    tools = [{"type": "function", "function": {"name": t.name, "parameters": t.parameters}} for t in MANY]
    return {"model": "m", "messages": USER, "tools": tools, "max_tokens": 16, "temperature": 0} | extra


def _message(r: httpx.Response, status: int = 400) -> str:
    assert r.status_code == status, r.text
    return r.json()["error"]["message"]


@pytest.fixture(scope="module")
def pythonic_server(tiny_llama_long):
    # a long context: the tools are in the prompt (~4k one-byte tokens)
    engine = Engine(tiny_llama_long, dtype="float32", max_total_tokens=8192)
    with serve_in_thread(engine, ServerArgs(tool_call_parser="pythonic")) as base:
        yield base


def test_the_grammar_built_for_many_tools_is_served(pythonic_server):
    """The old code bounded the server's own grammar by the client's ebnf limit
    (entrypoints/chat.py:_built: "the grammar built from the tools' schemas is ... characters,
    more than the 32768 a request may compile"): a 400 for valid tools the client could not shrink."""
    grammar = tool_grammar("pythonic", MANY, True, True, None)
    assert len(grammar) > MAX_GRAMMAR_CHARS["ebnf"]
    for choice in ("required", {"type": "function", "function": {"name": "f3"}}):
        r = httpx.post(pythonic_server + "/v1/chat/completions", json=_tools_body(tool_choice=choice), timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("tool_calls", "length")
    # The same text sent by the client as its own grammar is over the client's limit, by name.
    own = httpx.post(pythonic_server + "/v1/chat/completions",
                     json={"model": "m", "messages": USER, "max_tokens": 4, "ebnf": grammar}, timeout=60)
    assert _message(own).endswith(f"ebnf is {len(grammar)} characters, more than the 32768 allowed")
    generate = httpx.post(pythonic_server + "/generate", json={"text": "x", "sampling_params": {"ebnf": grammar}})
    assert "ebnf is" in _message(generate) and "32768" in _message(generate)
    # A client cannot hand its grammar in as the server's.
    forged = httpx.post(pythonic_server + "/generate", json={"text": "x", "sampling_params": {
        "server_grammar": {"ebnf": grammar, "source": "tools", "source_chars": 10**6}}})
    assert "server_grammar" in _message(forged)
    wait_idle(pythonic_server)


def test_a_server_grammar_is_bounded_by_its_source():
    limit = SERVER_GRAMMAR_BASE_CHARS + SERVER_GRAMMAR_CHARS_PER_SOURCE_CHAR * 100
    ServerGrammar("x" * limit, "tools", 100)
    with pytest.raises(ValueError, match=f"the grammar built from tools is {limit + 1} characters, more than "
                                         f"the {limit} its 100 characters allow"):
        ServerGrammar("x" * (limit + 1), "tools", 100)


def test_a_json_schema_after_the_thinking_keeps_the_clients_json_schema_limit(tiny_llama, tmp_path_factory):
    """A 40k json_schema (the client may send 128k) became a grammar over the ebnf limit
    (entrypoints/chat.py:_built): a 400 with reasoning on, 200 without."""
    schema = {"type": "object", "properties": {f"p{i:05d}": {"type": "integer"} for i in range(1400)}}
    text = json.dumps(schema)
    assert MAX_GRAMMAR_CHARS["ebnf"] < len(text) < MAX_GRAMMAR_CHARS["json_schema"]
    with thinking_server(tiny_llama, tmp_path_factory.mktemp("think")) as base:
        body = {"model": "m", "messages": USER, "max_tokens": 8, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}}
        assert httpx.post(base + "/v1/chat/completions", json=body, timeout=120).status_code == 200
        huge = {"type": "object", "properties": {f"p{i:05d}": {"type": "integer"} for i in range(6000)}}
        body["response_format"]["json_schema"]["schema"] = huge  # over the client's json_schema limit
        assert _message(httpx.post(base + "/v1/chat/completions", json=body, timeout=60)).startswith(
            f"json_schema is {len(json.dumps(huge))} characters, more than the 131072 allowed")
        wait_idle(base)


# ---- lists that cost work at every step of every sample ----------------------------------------

def _ids(count: int) -> list[int]:
    return list(range(3, 3 + count))  # past <unk>, <s>, </s>: in the tiny vocabulary (512)


def _list_field(field: str, count: int) -> tuple[dict, dict]:
    """(sampling params, logprob options) holding `count` entries of field."""
    if field == "token_ids_logprob":
        return {}, {field: _ids(count)}
    return {field: {str(t): -1.0 for t in _ids(count)} if field == "logit_bias" else _ids(count)}, {}


LIMITS = {"stop_token_ids": MAX_STOP, "logit_bias": MAX_LOGIT_BIAS, "token_ids_logprob": MAX_TOKEN_IDS_LOGPROB}


@pytest.mark.parametrize("field", list(LIMITS))
def test_per_step_lists_are_bounded_over_the_samples(engine, field):
    """n samples together may have what one may: the lists are read at every step of each. The
    old code bounded each list per sample only (core/sampling_params.py:SamplingParams._check
    for the first two, managers/io_struct.py:LogprobOptions for the third), so n=16 copies of the
    maximum cost 16 times it at every step."""
    limit = LIMITS[field]
    shared = limit // MAX_N
    params, options = _list_field(field, shared)
    outs = engine.generate("x", params | {"n": MAX_N, "max_new_tokens": 1}, **options)
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [1] * MAX_N
    params, options = _list_field(field, shared + 1)
    total = MAX_N * (shared + 1)
    with pytest.raises(ValueError, match=rf"{field}: {total} entries \(n={MAX_N} samples of {shared + 1}\), more "
                                         rf"than the {limit} allowed per request$"):
        engine.generate("x", params | {"n": MAX_N, "max_new_tokens": 1}, **options)
    assert engine.generate("x", params | {"max_new_tokens": 1}, **options)["meta_info"]["completion_tokens"] == 1


@pytest.fixture(scope="module")
def server(tiny_llama):
    with serve_in_thread(Engine(tiny_llama, dtype="float32", max_total_tokens=4096)) as base:
        yield base


@pytest.mark.parametrize("field", list(LIMITS))
def test_the_http_routes_count_every_sample(server, field):
    """OpenAI's n choices are n engine requests of n=1 each, which the engine's own check cannot
    see (entrypoints/protocol.py:_OpenAISampling bounded only the stops over n); /generate's n
    is the engine's."""
    limit, over = LIMITS[field], LIMITS[field] // MAX_N + 1
    expected = (f"{field}: {MAX_N * over} entries (n={MAX_N} samples of {over}), more than the {limit} "
                f"allowed per request")
    params, options = _list_field(field, over)
    r = httpx.post(server + "/generate", json={"text": "x", "sampling_params": params | {"n": MAX_N,
                                                                                         "max_new_tokens": 1}} | options)
    assert _message(r).endswith(expected)
    if field != "token_ids_logprob":  # not an OpenAI field
        body = {"model": "m", "messages": USER, "max_tokens": 1} | params
        assert _message(httpx.post(server + "/v1/chat/completions", json=body | {"n": MAX_N})).endswith(expected)
        assert httpx.post(server + "/v1/chat/completions", json=body).status_code == 200
    wait_idle(server)


def test_logprob_entries_are_bounded_per_call(engine, monkeypatch):
    """Each logprob entry is a Python list built in the scheduler's thread, then JSON: a batch of
    256 prompts of 8000 tokens scored from the start with 20 top logprobs and 256 token ids asked
    for ~570M of them (~60 GB). Now a call's requests share MAX_LOGPROB_ENTRIES (here made small),
    counted before anything runs; a request that does not fit is refused by name, alone."""
    assert MAX_LOGPROB_ENTRIES >= 8000 * 16 * (1 + MAX_TOP_LOGPROBS)  # long answers' logprobs fit
    budget = 100_000
    monkeypatch.setattr(io_struct, "MAX_LOGPROB_ENTRIES", budget)
    prompt = list(range(3, 103))  # 100 tokens
    wide = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": MAX_TOP_LOGPROBS,
            "token_ids_logprob": _ids(MAX_TOKEN_IDS_LOGPROB)}
    each = (100 + 1) * (1 + MAX_TOP_LOGPROBS + MAX_TOKEN_IDS_LOGPROB)  # positions x entries a position
    outs = engine.generate(input_ids=[prompt] * 4, sampling_params={"max_new_tokens": 1}, **wide)
    fit = budget // each
    for out in outs[:fit]:
        meta = out["meta_info"]
        assert len(meta["input_token_logprobs"]) == 100 and len(meta["input_top_logprobs"][1]) == MAX_TOP_LOGPROBS
        assert len(meta["output_token_ids_logprobs"][0]) == MAX_TOKEN_IDS_LOGPROB
    assert outs[fit]["error"] == (
        f"request {fit}: logprobs: this asks for {each} logprob entries (scored positions x (1 + top_logprobs_num + "
        f"len(token_ids_logprob)) x n), more than the {budget - fit * each} left of the {budget} one call may have: "
        "score fewer prompt positions (logprob_start_len), ask for fewer tokens or top logprobs, or split the batch")
    # n samples count n times; output tokens count as scored positions.
    with pytest.raises(ValueError, match=rf"^logprobs: this asks for {4 * (100 + 300) * (1 + MAX_TOP_LOGPROBS + 64)} "):
        engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 300, "n": 4},
                        **wide | {"token_ids_logprob": _ids(64)})
    # At most what the context leaves, whatever max_new_tokens says.
    room = engine.context_len - len(prompt)
    with pytest.raises(ValueError, match=rf"^logprobs: this asks for {room * (1 + MAX_TOP_LOGPROBS + 256)} "):
        engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 10**6}, return_logprob=True,
                        top_logprobs_num=MAX_TOP_LOGPROBS, token_ids_logprob=_ids(256))
