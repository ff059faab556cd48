"""The OpenAI-compatible routes, driven by the official openai client."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from baby_sgl import Engine, ServerArgs
from entrypoints.conftest import serve_checked

CHAT = [{"role": "user", "content": "hi"}]


def test_models(client):
    models = client.models.list().data
    assert len(models) == 1 and models[0].id
    assert abs(models[0].created - time.time()) < 24 * 3600  # a real time (when the server started)


def test_served_model_name_is_the_models_name_everywhere(tiny_llama):
    """--served-model-name (SGLang's): /v1/models lists it, an answer to a request that names no
    model carries it, and so do the metrics' model_name labels."""
    engine = Engine(tiny_llama, dtype="float32", max_total_tokens=256)
    with serve_checked(engine, ServerArgs(served_model_name="team/chat-v2")) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == ["team/chat-v2"]
        r = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "team/chat-v2"
        metrics = httpx.get(base + "/metrics", timeout=10).text
        assert 'model_name="team/chat-v2"' in metrics and tiny_llama.rsplit("/", 1)[-1] not in metrics


def test_completion_usage_and_cached_tokens(client):
    kw = dict(model="m", prompt="Hello", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens == 5 and r.usage.total_tokens == 10
    again = client.completions.create(**kw)
    assert again.choices[0].text == r.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens >= 4  # the prefix cache served the prompt


def test_completion_stream_equals_non_stream(client):
    kw = dict(model="m", prompt="Stream me", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    parts = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == full
    assert parts[-2].choices[0].finish_reason == "length"
    assert parts[-1].choices == [] and parts[-1].usage.completion_tokens == 12


def test_completion_batch_n2_and_token_prompt(client):
    r = client.completions.create(model="m", prompt=["one", "two!"], n=2, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text
    assert r.usage.prompt_tokens == 3 + 4  # each prompt counts once, not once per choice
    assert r.usage.completion_tokens == 12
    ids = client.completions.create(model="m", prompt=[40, 41, 42], max_tokens=2)
    assert ids.usage.prompt_tokens == 3


def test_completion_logprobs(client):
    r = client.completions.create(model="m", prompt="lp", max_tokens=3, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and all(len(top) >= 1 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    # streamed: each piece's offsets go on from the text before it
    pieces = [p.choices[0] for p in client.completions.create(model="m", prompt="lp", max_tokens=3, temperature=0,
                                                               logprobs=2, stream=True, extra_body={"ignore_eos": True})
              if p.choices and p.choices[0].logprobs and p.choices[0].logprobs.tokens]
    assert [o for p in pieces for o in p.logprobs.text_offset] == lp.text_offset


def test_chat_n2_usage(client):
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=6, temperature=0, n=2)
    assert len(r.choices) == 2 and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy
    single = client.chat.completions.create(model="m", messages=CHAT, max_completion_tokens=6, temperature=0)
    assert single.choices[0].message.content == r.choices[0].message.content
    assert r.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once for n=2
    assert r.usage.completion_tokens == 2 * single.usage.completion_tokens


def test_chat_stream_and_seed(client):
    kw = dict(model="m", messages=[{"role": "user", "content": "tell"}], max_tokens=10, temperature=0.9, seed=11)
    full = client.chat.completions.create(**kw).choices[0].message.content
    assert client.chat.completions.create(**kw).choices[0].message.content == full  # the seed reproduces
    parts = list(client.chat.completions.create(**kw, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == full
    assert parts[-1].choices[0].finish_reason in ("stop", "length")


def test_seeded_n2_gives_different_choices(client):
    kw = dict(model="m", messages=CHAT, max_tokens=12, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    one = client.chat.completions.create(**kw).choices[0].message.content
    two = client.chat.completions.create(**kw, n=2).choices
    assert two[0].message.content == one and two[1].message.content != one


def test_chat_content_parts(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    kw = dict(model="m", max_tokens=4, temperature=0)
    assert client.chat.completions.create(messages=parts, **kw).choices[0].message.content == \
        client.chat.completions.create(messages=CHAT, **kw).choices[0].message.content


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "lp"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and len(content[0].top_logprobs) == 2
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)


def test_stop_string(client):
    kw = dict(model="m", prompt="abc", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    pairs = (text[i:i + 2] for i in range(3, len(text) - 1))
    stop = next(p for p in pairs if p.strip() and "\ufffd" not in p)  # greedy: always the same pair
    r = client.completions.create(**kw, stop=stop)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[: text.index(stop)]
    streamed = "".join(p.choices[0].text for p in client.completions.create(**kw, stop=[stop], stream=True))
    assert streamed == r.choices[0].text


def test_openai_client_errors(client, server):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="m", prompt="x", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="prompt is too long"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 3000}])
    r = httpx.post(server + "/v1/chat/completions", json={"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_cached_tokens_never_cover_the_whole_prompt(client):
    """cached_tokens counts the prompt tokens the prefix cache served: a repeated prompt is served
    all but its last token (which must be run for the next token's logits), never more."""
    kw = dict(model="m", prompt="Cache me", max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    client.completions.create(**kw)
    again = client.completions.create(**kw)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_batched_choices_keep_their_own_text_logprobs_and_usage_streamed(client):
    """Two prompts, echoed with logprobs: each choice's logprobs are its own (its tokens join to
    its text), and streamed, each index's pieces join to that choice's whole text and offsets, the
    echoed prompt sent once, with the same usage as the whole answer."""
    kw = dict(model="m", prompt=["one", "two!"], max_tokens=4, temperature=0, echo=True, logprobs=1,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1]
    for c, prompt in zip(whole.choices, ["one", "two!"]):
        assert c.text.startswith(prompt) and "".join(c.logprobs.tokens) == c.text
    parts = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    for c in whole.choices:
        pieces = [p.choices[0] for p in parts if p.choices and p.choices[0].index == c.index]
        assert "".join(p.text for p in pieces) == c.text
        assert [o for p in pieces if p.logprobs for o in p.logprobs.text_offset] == c.logprobs.text_offset
        assert pieces[-1].finish_reason == "length"
    assert parts[-1].choices == [] and parts[-1].usage == whole.usage
