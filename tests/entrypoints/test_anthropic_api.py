"""Anthropic's Messages API through the official `anthropic` client: text whole and streamed,
stop_sequences and max_tokens as stop reasons, tools (any, a named tool, tool results in the
history), thinking blocks, count_tokens, x-api-key, and errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from baby_sgl import Engine
from baby_sgl.server_args import ServerArgs
from entrypoints.conftest import serve_in_thread, thinking_server, wait_idle

KEY = "test-key"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "the forecast", "input_schema": WEATHER}]
USER = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def base(tiny_llama):
    engine = Engine(tiny_llama, dtype="float32")
    with serve_in_thread(engine, ServerArgs(tool_call_parser="qwen25", api_key=KEY)) as url:
        yield url


@pytest.fixture
def client(base):
    yield anthropic.Anthropic(base_url=base, api_key=KEY)
    wait_idle(base, headers={"x-api-key": KEY})


def test_text_whole_and_streamed(client):
    whole = client.messages.create(model="m", max_tokens=12, messages=USER, system="Be brief.", extra_body=GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert [b.type for b in whole.content] == ["text"] and whole.stop_reason == "max_tokens"
    assert whole.usage.output_tokens == 12 and whole.usage.input_tokens > 0
    with client.messages.stream(model="m", max_tokens=12, messages=USER, system="Be brief.", extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 12


def test_a_stop_sequence_is_named(client):
    text = client.messages.create(model="m", max_tokens=24, messages=USER, extra_body=GREEDY).content[0].text
    stop = text[8:11]
    r = client.messages.create(model="m", max_tokens=24, messages=USER, extra_body=GREEDY, stop_sequences=[stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[: text.index(stop)]


def test_count_tokens_is_the_prompt(client):
    counted = client.messages.count_tokens(model="m", messages=USER, system="Be brief.", tools=TOOLS)
    made = client.messages.create(model="m", max_tokens=1, messages=USER, system="Be brief.", tools=TOOLS)
    assert counted.input_tokens == made.usage.input_tokens > 0


def test_tools_any_named_and_tool_results(client):
    for temperature in (0.0, 1.0):  # sampling fields of older clients (today's send none)
        r = client.messages.create(model="m", max_tokens=150, messages=USER, tools=TOOLS,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                   extra_body={"temperature": temperature, "top_k": 50})
        assert r.stop_reason == "tool_use" and r.content
        for block in r.content:
            assert block.type == "tool_use" and block.id.startswith("toolu_") and block.name == "get_weather"
            jsonschema.validate(block.input, WEATHER)
    with client.messages.stream(model="m", max_tokens=150, messages=USER, tools=TOOLS, extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        partial = "".join(e.delta.partial_json for e in stream
                          if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["tool_use"] and final.stop_reason == "tool_use"
    assert json.loads(partial) == final.content[0].input
    jsonschema.validate(final.content[0].input, WEATHER)
    follow = USER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": final.content[0].id,
                                                   "content": "12 C"}, {"type": "text", "text": "And tomorrow?"}]}]
    r = client.messages.create(model="m", max_tokens=4, messages=follow, tools=TOOLS, tool_choice={"type": "none"})
    assert r.content[0].type == "text" and r.stop_reason == "max_tokens"
    counted = client.messages.count_tokens(model="m", messages=follow, tools=TOOLS, tool_choice={"type": "none"})
    # the earlier call and its result are in the prompt
    assert r.usage.input_tokens == counted.input_tokens > client.messages.count_tokens(
        model="m", messages=USER).input_tokens + len(json.dumps(final.content[0].input).encode()) + len("12 C")


@pytest.mark.parametrize("body, needle", [
    ({"messages": USER}, "max_tokens"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4}, "image"),
    ({"messages": USER, "max_tokens": 4, "tools": TOOLS, "tool_choice": {"type": "tool"}}, "name"),
    ({"messages": USER, "max_tokens": 4, "tool_choice": {"type": "any"}}, "needs tools"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
      "max_tokens": 4}, "tool_result"),
    ({"messages": USER, "max_tokens": 4, "tools": TOOLS * 129}, "tools"),
    ({"messages": USER, "max_tokens": 4, "temperature": 1.5}, "temperature"),
])
def test_bad_requests_get_anthropic_errors(base, client, body, needle):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.post("/v1/messages", body={"model": "m"} | body, cast_to=httpx.Response)
    error = caught.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert needle in error["error"]["message"], error


def test_the_key_comes_as_x_api_key(base):
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic.Anthropic(base_url=base, api_key="wrong").messages.create(model="m", max_tokens=2, messages=USER)
    assert caught.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(base + "/v1/messages", json={"model": "m", "max_tokens": 2, "messages": USER},
                   headers={"x-api-key": KEY})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 2
    wait_idle(base, headers={"x-api-key": KEY})


@pytest.fixture(scope="module")
def thinking_base(tiny_llama, tmp_path_factory):
    with thinking_server(tiny_llama, tmp_path_factory.mktemp("think")) as url:
        yield url


def test_thinking_comes_as_a_thinking_block(thinking_base):
    client = anthropic.Anthropic(base_url=thinking_base, api_key="none")
    thinking = {"type": "enabled", "budget_tokens": 1024}
    whole = client.messages.create(model="m", max_tokens=30, messages=USER, thinking=thinking, extra_body=GREEDY,
                                   stop_sequences=["</think>"])
    # the template opened the block and the output stopped at its end: all of it is thinking
    assert [b.type for b in whole.content] == ["thinking"] and whole.stop_reason in ("stop_sequence", "max_tokens")
    with client.messages.stream(model="m", max_tokens=30, messages=USER, thinking=thinking, extra_body=GREEDY,
                                stop_sequences=["</think>"]) as stream:
        final = stream.get_final_message()
    assert final.content[0].thinking == whole.content[0].thinking
    plain = client.messages.create(model="m", max_tokens=8, messages=USER, extra_body=GREEDY)
    assert [b.type for b in plain.content] == ["text"]
    wait_idle(thinking_base)


def test_the_system_prompt_reaches_the_model(client):
    """The system prompt is part of the prompt: it adds tokens (counted and used), and the
    streamed message_start reports the same input_tokens as the whole answer."""
    bare = client.messages.count_tokens(model="m", messages=USER).input_tokens
    counted = client.messages.count_tokens(model="m", messages=USER, system="Be brief.").input_tokens
    assert counted > bare
    made = client.messages.create(model="m", max_tokens=1, messages=USER, system="Be brief.", extra_body=GREEDY)
    assert made.usage.input_tokens == counted
    with client.messages.stream(model="m", max_tokens=1, messages=USER, system="Be brief.", extra_body=GREEDY) as s:
        start = next(e for e in s if e.type == "message_start")
        for _ in s:
            pass
    assert start.message.usage.input_tokens == counted
