"""Anthropic's prefill: a last assistant message is the start of the answer, which the model
continues (the prompt ends with its text, in the assistant's turn, and the reply holds only what
follows); a prefill the answer cannot continue is refused."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from transformers import AutoTokenizer

from entrypoints import test_anthropic_api
from entrypoints.conftest import wait_idle
from entrypoints.test_anthropic_api import GREEDY, KEY, USER

base = test_anthropic_api.base  # the fixture: a server with --tool-call-parser qwen25 and an API key

PREFILL = "The answer is"


@pytest.fixture
def anthropic_client(base):
    yield anthropic.Anthropic(base_url=base, api_key=KEY)
    wait_idle(base, headers={"x-api-key": KEY})


def test_the_answer_continues_the_prefill(base, anthropic_client, tiny_llama):
    # Before: anthropic_api.py:_Conversation.chat_request rendered the assistant message as a
    # finished turn and opened a new one after it.
    messages = USER + [{"role": "assistant", "content": PREFILL}]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False) + PREFILL
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    count = anthropic_client.messages.count_tokens(model="m", messages=messages)
    assert count.input_tokens == len(ids)
    reply = anthropic_client.messages.create(model="m", max_tokens=12, messages=messages, extra_body=GREEDY)
    native = httpx.post(base + "/generate", headers={"x-api-key": KEY}, timeout=60, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}).json()
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == native["text"]
    assert reply.usage.input_tokens == len(ids)
    with anthropic_client.messages.stream(model="m", max_tokens=12, messages=messages, extra_body=GREEDY) as stream:
        assert stream.get_final_message().content[0].text == native["text"]


@pytest.mark.parametrize("content, needle", [
    ("The answer is ", "trailing whitespace"),
    ([{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}], "text blocks only"),
])
def test_a_prefill_that_cannot_be_continued_is_refused(anthropic_client, content, needle):
    with pytest.raises(anthropic.BadRequestError, match=needle):
        anthropic_client.messages.create(model="m", max_tokens=4, messages=USER + [
            {"role": "assistant", "content": content}])


def test_a_prefill_past_the_prompt_limit_is_refused_by_its_start(base, anthropic_client):
    """A prefill is tokenized as a prompt is: one longer than the prompt limit can hold is refused
    after reading its first characters (counting too), not tokenized whole. Before, 10 MB of words
    took 22 s of a prepare thread and 1.7 GB, and count_tokens answered 200."""
    context = httpx.get(base + "/get_server_info", headers={"x-api-key": KEY}, timeout=30).json()["context_len"]
    messages = USER + [{"role": "assistant", "content": "word " * (20 * context) + "end"}]
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        anthropic_client.messages.count_tokens(model="m", messages=messages)
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        anthropic_client.messages.create(model="m", max_tokens=4, messages=messages)
