"""SGLang's whole /generate request surface, read from the installed sglang package's own HTTP
contract (sglang/api/v1/api_types.py, parsed, never imported): every field at its default is
accepted, a non-default value of one we do not implement is refused by name; and the SGLang and
OpenAI features built on it (structured output, echo with logprobs, streaming logprobs)."""

from __future__ import annotations

import ast
import json

import httpx
import jsonschema
import openai
import pytest

from baby_sgl import Engine
from baby_sgl.server_args import ServerArgs
from entrypoints.conftest import serve_checked
from helpers import sglang_package_dir


def _contract(cls_name: str) -> dict:
    """Field -> default of one msgspec Struct in SGLang's HTTP contract."""
    path = sglang_package_dir() / "api" / "v1" / "api_types.py"
    tree = ast.parse(open(path).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    return {n.target.id: ast.literal_eval(n.value) if n.value is not None else None
            for n in cls.body if isinstance(n, ast.AnnAssign)}


SAMPLING = _contract("SamplingParams")
GENERATE = _contract("GenerateRequest")


def test_the_contract_was_read():
    assert {"regex", "json_schema", "stop_regex", "logit_bias", "spaces_between_special_tokens"} <= set(SAMPLING)
    assert {"text", "logprob_start_len", "image_data", "lora_path", "return_text_in_logprobs"} <= set(GENERATE)


def test_every_field_at_its_default_is_accepted(server):
    body = {**GENERATE, "text": "hi", "sampling_params": {**SAMPLING, "max_new_tokens": 4}}
    r = httpx.post(server + "/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] <= 4
    # Null for everything (SGLang's clients send nulls for unused fields) is accepted too.
    nulls = {k: None for k in GENERATE} | {"text": "hi", "sampling_params": {k: None for k in SAMPLING}}
    r = httpx.post(server + "/generate", json=nulls)
    assert r.status_code == 200, r.text


_UNSUPPORTED = {
    "image_data": "aGk=", "lora_path": "adapter", "return_hidden_states": True, "session_id": "s",
    "custom_logit_processor": "x", "extra_key": "k", "priority": 3, "routing_key": "r",
}
_UNSUPPORTED_SAMPLING = {"structural_tag": "{}", "custom_params": {"a": 1}, "beam_width": 4, "choice": ["a"]}


@pytest.mark.parametrize("field, value", list(_UNSUPPORTED.items()))
def test_an_unsupported_field_is_refused_by_name(server, field, value):
    r = httpx.post(server + "/generate", json={"text": "hi", field: value})
    assert r.status_code == 400 and field in r.json()["error"]["message"] and "not supported" in r.text


@pytest.mark.parametrize("field, value", list(_UNSUPPORTED_SAMPLING.items()))
def test_an_unsupported_sampling_field_is_refused_by_name(server, field, value):
    r = httpx.post(server + "/generate", json={"text": "hi", "sampling_params": {field: value}})
    assert r.status_code == 400 and field in r.json()["error"]["message"] and "not supported" in r.text


def test_router_and_client_extras(server):
    ok = httpx.post(server + "/generate", json={"text": "hi", "model": "anything", "sampling_params":
                                                {"max_new_tokens": 2}, "return_prompt_token_ids": True})
    ids = ok.json()["prompt_token_ids"]
    assert ok.status_code == 200 and len(ids) == ok.json()["meta_info"]["prompt_tokens"] and all(isinstance(t, int) for t in ids)
    assert httpx.put(server + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}).status_code == 200
    assert httpx.get(server + "/flush_cache", headers={"content-type": "application/json"}).status_code == 200
    r = httpx.post(server + "/concate_and_append_request", json={"src_rids": ["a", "b"], "dst_rid": "c"})
    assert r.status_code == 200
    bad = httpx.post(server + "/concate_and_append_request", json={"src_rids": "a"})
    assert bad.status_code == 400


def test_constraint_and_invalid_grammar_over_http(server):
    r = httpx.post(server + "/generate", json={"text": "n", "sampling_params": {"regex": "[0-9]{2}"}})
    assert r.status_code == 200 and len(r.json()["text"]) == 2 and r.json()["text"].isdigit()
    bad = httpx.post(server + "/generate", json={"text": "n", "sampling_params": {"regex": "[0-9"}})
    assert bad.status_code == 400 and "invalid regex" in bad.json()["error"]["message"]


def test_streamed_text_is_cumulative_and_logprobs_incremental(server):
    """As SGLang's default stream, which its frontend's test_stream_logprobs checks: every event
    carries the text and ids so far, and only its own tokens' output logprobs (the prompt's come
    once, in the first event), so the stream's bytes grow with its output."""
    body = {"text": "st", "stream": True, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True, "stream_interval": 2}}
    events = []
    with httpx.stream("POST", server + "/generate", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                events.append(json.loads(line[5:]))
    lengths = [len(e["output_ids"]) for e in events]
    assert lengths == [1, 3, 5]  # the first token at once, then every stream_interval tokens
    for before, e in zip([0] + lengths, events):
        assert [t for _, t, _ in e["meta_info"]["output_token_logprobs"]] == e["output_ids"][before:]
    prompt = events[0]["meta_info"]["input_token_logprobs"]
    assert len(prompt) == 2 and prompt[0][0] is None
    assert not any("input_token_logprobs" in e["meta_info"] for e in events[1:])
    assert events[-1]["text"].startswith(events[0]["text"])


def test_every_streamed_event_has_new_text(server):
    """A token that ends inside a character (the tiny tokenizer has one token per byte, so "é"
    takes two) adds no text: its event is held and the next one carries it, as SGLang's frontend
    refuses an event without new text. meta_info counts the output logprobs as SGLang's does,
    and the held token's entry comes with the next event."""
    body = {"text": "accent:", "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "regex": "(é){3}"}}
    with httpx.stream("POST", server + "/generate", json=body) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and line != "data: [DONE]"]
    texts = [e["text"] for e in events]
    assert texts[-1] == "ééé" and all(a < b and b.startswith(a) for a, b in zip([""] + texts, texts))
    assert [len(e["output_ids"]) for e in events] == [2, 4, 6]  # each after the character's second byte
    for before, e in zip([0, 2, 4], events):
        meta = e["meta_info"]
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"] == len(e["output_ids"])
        assert len(meta["output_token_logprobs"]) == len(e["output_ids"]) - before  # its own tokens' entries


@pytest.fixture(scope="module")
def incremental_server(tiny_llama):
    engine = Engine(tiny_llama, dtype="float32", max_total_tokens=2048)
    with serve_checked(engine, ServerArgs(incremental_streaming_output=True)) as base:
        yield base


def _events(base: str, body: dict) -> list[dict]:
    with httpx.stream("POST", base + "/generate", json=body) as r:
        assert r.status_code == 200
        return [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and line != "data: [DONE]"]


def test_incremental_streaming_output_sends_deltas(server, incremental_server):
    """--incremental-streaming-output: each event carries only the new text, ids and output
    logprob entries (SGLang's frontend joins them); the totals stay totals. Joined, the events
    equal the default stream's last event (its logprobs joined too), and a held event (a
    character's first byte) is carried by the next one."""
    for prompt, params in (("st", {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True, "stream_interval": 2}),
                           ("accent:", {"max_new_tokens": 6, "temperature": 0, "regex": "(é){3}"})):
        body = {"text": prompt, "stream": True, "return_logprob": True, "top_logprobs_num": 2,
                "sampling_params": params}
        deltas, cumulative = _events(incremental_server, body), _events(server, body)
        whole = cumulative[-1]
        assert len(deltas) > 1 and all(e["text"] for e in deltas)
        assert "".join(e["text"] for e in deltas) == whole["text"]
        assert sum((e["output_ids"] for e in deltas), []) == whole["output_ids"]
        done = 0
        for e in deltas:
            meta = e["meta_info"]
            assert [t for _, t, _ in meta["output_token_logprobs"]] == e["output_ids"]
            assert len(meta["output_top_logprobs"]) == len(e["output_ids"])
            done += len(e["output_ids"])
            assert meta["completion_tokens"] == meta["output_token_logprobs_length"] == done
        joined = sum((e["meta_info"]["output_token_logprobs"] for e in deltas), [])
        # from another server: a cached prefix, other kernels
        expected = sum((e["meta_info"]["output_token_logprobs"] for e in cumulative), [])
        assert [t for _, t, _ in joined] == [t for _, t, _ in expected]
        assert [v for v, _, _ in joined] == pytest.approx([v for v, _, _ in expected], abs=1e-4)


def _bias(model_path: str, char: str, value: float) -> dict[str, float]:
    """logit_bias for one character of the test tokenizer (one token per byte character)."""
    from transformers import AutoTokenizer

    return {str(AutoTokenizer.from_pretrained(model_path).convert_tokens_to_ids(char)): value}


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "rank"], "additionalProperties": False}


def test_openai_response_format_json_schema(client):
    for api in ("chat", "completions"):
        fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
        if api == "chat":
            r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a city"}],
                                               response_format=fmt, max_tokens=64)
            text = r.choices[0].message.content
        else:
            r = client.completions.create(model="m", prompt="a city", extra_body={"response_format": fmt},
                                          max_tokens=64)
            text = r.choices[0].text
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


def test_openai_response_format_json_object(client, tiny_llama):
    """Any JSON object: the random model would write one long key, so logit_bias favours a
    closing brace, which the grammar allows only where an object may end."""
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "json"}],
                                       response_format={"type": "json_object"}, max_tokens=64, temperature=0,
                                       logit_bias=_bias(tiny_llama, "}", 30.0))
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_openai_response_format_errors(client):
    with pytest.raises(openai.BadRequestError, match="json_schema.schema is required"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(openai.BadRequestError, match="not both"):
        client.completions.create(model="m", prompt="x", extra_body={"regex": "a", "response_format":
                                                                     {"type": "json_object"}})


def test_openai_completion_echo_with_logprobs(client):
    r = client.completions.create(model="m", prompt="echo me", max_tokens=3, temperature=0, echo=True, logprobs=2,
                                  extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.text.startswith("echo me")
    lp = choice.logprobs
    assert len(lp.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert lp.top_logprobs[0] is None and all(len(t) >= 1 for t in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    # each token's text starts where the ones before it end, the echoed prompt counted
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert choice.text[lp.text_offset[-1]:] == lp.tokens[-1]
    plain = client.completions.create(model="m", prompt="echo me", max_tokens=3, temperature=0, echo=True,
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None


def test_openai_echo_streamed(client):
    pieces = client.completions.create(model="m", prompt="abc", max_tokens=3, temperature=0, echo=True, stream=True,
                                       extra_body={"ignore_eos": True})
    text = "".join(p.choices[0].text for p in pieces if p.choices)
    assert text.startswith("abc") and len(text) > 3


def test_http_logprobs_of_a_constrained_request_are_valid_json(server):
    body = {"text": "Answer:", "top_logprobs_num": 20, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "regex": "[0-9]{3}"}}
    r = httpx.post(server + "/generate", json=body)
    assert r.status_code == 200 and json.loads(r.text)["meta_info"]["output_top_logprobs"]
    with httpx.stream("POST", server + "/generate", json=body | {"stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                json.loads(line[5:], parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
