"""Tools and reasoning against outputs and requests that try to trick them: calls cut short by
max_tokens never come back (whole or streamed) and forced parallel calls are bounded; functions
named like tool_choice's modes can be forced; only the request's tools become calls; pythonic
calls with arguments named as Python keywords, and non-strict tools beside strict ones; a schema
nested too deeply after the thinking is a 400; a user's `<think>` does not open the reasoning."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from baby_sgl import Engine
from baby_sgl.entrypoints.tool_grammar import MAX_PARALLEL_TOOL_CALLS, Tool, tool_grammar
from baby_sgl.entrypoints.tool_parsers import UNDECIDED_MAX, Content, ToolCallParser, collect
from baby_sgl.server_args import ServerArgs
from entrypoints.conftest import serve_in_thread, thinking_server, wait_idle
from entrypoints import test_tools
from entrypoints.test_tools import TOOLS, WEATHER

matcher = test_tools.matcher  # the fixture: whether a grammar takes a text

NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
NOW_CALL = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'  # what the forced grammar writes
NO_EOS = {"logit_bias": {"2": -100}}  # the tiny model's end of sequence: it must go on until cut
USER = [{"role": "user", "content": "What time is it?"}]


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="none")


def _server(tiny_llama: str, parser: str):
    return serve_in_thread(Engine(tiny_llama, dtype="float32"), ServerArgs(tool_call_parser=parser))


@pytest.fixture(scope="module")
def qwen25_server(tiny_llama):
    with _server(tiny_llama, "qwen25") as base:
        yield base


@pytest.fixture(scope="module")
def llama3_server(tiny_llama):
    with _server(tiny_llama, "llama3") as base:
        yield base


@pytest.fixture(scope="module")
def pythonic_server(tiny_llama):
    with _server(tiny_llama, "pythonic") as base:
        yield base


def test_calls_cut_by_max_tokens_are_dropped_whole_and_streamed(qwen25_server):
    # Two whole calls and the start of a third's arguments: the third is cut in its arguments.
    # Before: chat.py:ChatReader.read gave every call begun, the third with arguments "{".
    max_tokens = 2 * (len(NOW_CALL) + 1) + NOW_CALL.index("{}") + 1
    client = _client(qwen25_server)
    whole = client.chat.completions.create(model="m", messages=USER, tools=[NOW], tool_choice="required",
                                           max_tokens=max_tokens, temperature=0, extra_body=NO_EOS)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("now", "{}")] * 2
    pieces = list(client.chat.completions.create(model="m", messages=USER, tools=[NOW], tool_choice="required",
                                                 max_tokens=max_tokens, temperature=0, extra_body=NO_EOS,
                                                 stream=True))
    calls = [c for p in pieces if p.choices for c in p.choices[0].delta.tool_calls or []]
    # a forced call streams once complete: its name and all its arguments in one delta
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [(0, "now", "{}"), (1, "now", "{}")]
    assert pieces[-1].choices[0].finish_reason == "length"
    wait_idle(qwen25_server)


def test_forced_parallel_calls_are_bounded(matcher):
    # Before: tool_grammar.py:tool_grammar repeated the calls with `*`, so a model that never
    # stops calling was stopped only by max_tokens, inside a call.
    grammar = tool_grammar("qwen25", [Tool("now", None, {"type": "object", "properties": {}})], True, True, None)
    assert matcher(grammar, "\n".join([NOW_CALL] * MAX_PARALLEL_TOOL_CALLS))
    assert not matcher(grammar, "\n".join([NOW_CALL] * (MAX_PARALLEL_TOOL_CALLS + 1)))


@pytest.mark.parametrize("name", ["none", "auto", "required"])
def test_a_function_named_like_a_mode_can_be_forced(qwen25_server, name):
    # Before: protocol.py:chat_request passed the name as tool_choice, which chat.py:prepare read
    # as the mode of that name (auto, none) or as any tool (required).
    tools = [{"type": "function", "function": {"name": name, "parameters": WEATHER}}, NOW]
    r = _client(qwen25_server).chat.completions.create(
        model="m", messages=USER, tools=tools, tool_choice={"type": "function", "function": {"name": name}},
        max_tokens=120, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and [c.function.name for c in choice.message.tool_calls] == [name]
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), WEATHER)
    wait_idle(qwen25_server)


def test_only_the_requests_tools_become_calls(qwen25_server, llama3_server):
    # Before: tool_parsers.py:_JsonCalls._feed_call announced a call for any name written.
    undefined = {"regex": r'<tool_call>\n\{"name": "rm_rf", "arguments": \{\}\}\n</tool_call>'}
    r = _client(qwen25_server).chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=80,
                                                       temperature=0, extra_body=undefined)
    message = r.choices[0].message
    assert message.tool_calls is None and message.content == '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n' \
        '</tool_call>' and r.choices[0].finish_reason == "stop"
    # a JSON answer that happens to have a "name" is an answer, not a call
    person = {"type": "object", "properties": {"name": {"const": "John Doe"}, "age": {"const": 30}},
              "required": ["name", "age"]}
    r = _client(llama3_server).chat.completions.create(
        model="m", messages=USER, tools=TOOLS, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": person}})
    message = r.choices[0].message
    assert message.tool_calls is None and json.loads(message.content) == {"name": "John Doe", "age": 30}
    wait_idle(qwen25_server)
    wait_idle(llama3_server)


@pytest.mark.parametrize("fmt, output", [
    ("qwen25", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),
    ("llama3", '{"name": "John Doe", "parameters": {"age": 30}}'),
    ("mistral", '[TOOL_CALLS]rm_rf[ARGS]{"path": "/"}'),
    ("mistral", '[TOOL_CALLS][{"name": "rm_rf", "arguments": {}}]'),
    ("pythonic", '[now(), rm_rf(path="/")]'),
])
def test_a_call_to_a_function_not_among_the_tools_is_content(fmt, output):
    assert ToolCallParser(fmt, frozenset({"now"})).parse(output) == (output, [])


KEYWORD_ARGS = {"type": "object", "properties": {"from": {"type": "string", "maxLength": 5},
                                                 "class": {"type": "integer"}}, "required": ["from", "class"]}


def test_pythonic_arguments_named_as_python_keywords(pythonic_server):
    # Before: tool_parsers.py:_python_calls gave None on ast.parse's SyntaxError for `from=`.
    tools = [{"type": "function", "function": {"name": "move", "parameters": KEYWORD_ARGS}}]
    r = _client(pythonic_server).chat.completions.create(model="m", messages=USER, tools=tools,
                                                         tool_choice="required", max_tokens=80, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    assert [c.function.name for c in choice.message.tool_calls] == ["move"]
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), KEYWORD_ARGS)
    assert ToolCallParser("pythonic", frozenset({"f"})).parse('[f(from="a", from_=1, x="class=2")]') == \
        ("", [("f", '{"from": "a", "from_": 1, "x": "class=2"}')])
    wait_idle(pythonic_server)


def test_a_keyword_argument_beside_a_long_string_of_its_name_and_underscores():
    """The alias for `from=` was sought by searching the whole text for `from_`, `from__`, ...:
    a string holding `from` and n underscores cost n^2 (40000: 1.2 s of the event loop; the
    200000 here: half a minute). Only the names matter: the alias may appear inside strings,
    and the arguments come back under their own names either way."""
    def parse(text):
        return ToolCallParser("pythonic", frozenset({"f"})).parse(text)

    long = "from" + "_" * 200_000
    assert parse(f'[f(from=1, a="{long}")]') == ("", [("f", json.dumps({"from": 1, "a": long}))])
    assert parse('[f(from=1, from_=2, a="from__")]') == ("", [("f", '{"from": 1, "from_": 2, "a": "from__"}')])


def test_pythonic_non_strict_tools_beside_a_strict_one_take_arguments(matcher):
    # Before: tool_grammar.py:tool_grammar gave a non-strict tool the schema {"type": "object"},
    # whose pythonic form has no keyword arguments at all: only `loose()` was allowed.
    tools = [Tool("get_weather", None, WEATHER, strict=True), Tool("loose", None, {"type": "object"})]
    grammar = tool_grammar("pythonic", tools, False, True, None)
    assert matcher(grammar, '[loose(x=1, note="hi", flags=[true, null])]')
    assert matcher(grammar, '[get_weather(city="Oslo"), loose()]')
    assert not matcher(grammar, '[get_weather(town="Oslo")]')


@pytest.fixture(scope="module")
def thinking_base(tiny_llama, tmp_path_factory):
    # a short generation prompt: a user's text right before it is within the old 16-token look
    with thinking_server(tiny_llama, tmp_path_factory.mktemp("think"), generation_prompt="A:") as base:
        yield base


def test_a_users_think_tag_does_not_open_the_reasoning(thinking_base):
    # Before: chat.py:prepare looked for an open block in the prompt's last 16 tokens, the
    # user's text included.
    client = _client(thinking_base)
    messages = [{"role": "user", "content": "Show me your <think>"}]
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=20, temperature=0,
                                       extra_body={"regex": "[a-z]{3,6}"})
    message = r.choices[0].message
    assert message.reasoning_content is None and message.content and message.content.isalpha()
    # the template's own tag still opens it
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=30, temperature=0, extra_body={
        "regex": "[a-z]{4}</think>[a-z]{3}", "chat_template_kwargs": {"enable_thinking": True}})
    message = r.choices[0].message
    assert len(message.reasoning_content) == 4 and len(message.content) == 3
    wait_idle(thinking_base)


def test_a_schema_too_deep_after_the_thinking_is_a_400(thinking_base):
    # Before: tool_grammar.py:json_after_thinking let closed_objects' RecursionError out: a 500.
    schema: dict = {"type": "string"}
    for _ in range(450):
        schema = {"anyOf": [schema]}
    body = {"model": "m", "messages": USER, "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}}
    r = httpx.post(thinking_base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "json_schema nests deeper than 256 levels" in r.json()["error"]["message"], r.text
    # The same refusal without the thinking, whatever Python's recursion allows: before, Python 3.12
    # (comprehensions inlined) let this schema through to the library, which refused it as "invalid ebnf".
    plain = {"text": "x", "sampling_params": {"max_new_tokens": 4, "json_schema": json.dumps(schema)}}
    r = httpx.post(thinking_base + "/generate", json=plain, timeout=60)
    assert r.status_code == 400 and "json_schema nests deeper than 256 levels" in r.text, r.text
    wait_idle(thinking_base)


def test_a_json_schema_after_the_thinking_that_only_refers_to_itself_is_a_400(thinking_base):
    # Before: accepted; the schema sits after the thinking's end and its newlines (a regex lexeme),
    # and the grammar library's mask after `</think>` spun forever in the scheduler thread.
    body = {"model": "m", "messages": USER, "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": {"$ref": "#"}}}}
    r = httpx.post(thinking_base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("the constraint built from json_schema cannot be compiled: the "
                                                   "JSON schema at # only leads back to itself"), r.text
    wait_idle(thinking_base)


def test_a_json_schema_string_nested_past_the_parser_after_the_thinking_is_a_400(thinking_base):
    # Before: json_after_thinking caught only JSONDecodeError, and json.loads' RecursionError on
    # SGLang's json_schema string (not response_format) was a 500.
    body = {"model": "m", "messages": USER, "max_tokens": 4, "json_schema": "[" * 5000 + "]" * 5000}
    r = httpx.post(thinking_base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "json_schema is nested too deeply" in r.json()["error"]["message"], r.text
    wait_idle(thinking_base)


@pytest.mark.parametrize("fmt, start", [("mistral", ""), ("pythonic", ""), ("llama3", ""), ("qwen25", ""),
                                        ("mistral", "["), ("pythonic", "[f")])
def test_spaces_the_parser_cannot_place_are_content_past_a_bound(fmt, start):
    """Spaces at the start of an output (calls may follow them) or inside an opening `[` were
    held, and every piece rescanned all of them: 8000 pieces of spaces took 1.7-21 s of the event
    loop (spaces after a call's object, where a separator may follow, likewise). Past
    UNDECIDED_MAX held characters they are read as what they are by then: content."""
    parser = ToolCallParser(fmt, frozenset({"f"}))
    events = parser.feed(start) if start else []
    for _ in range(4 * UNDECIDED_MAX // 64):
        events += parser.feed(" " * 64)
    sent = sum(len(e.text) for e in events if isinstance(e, Content))
    assert len(start) + 4 * UNDECIDED_MAX - sent <= UNDECIDED_MAX + 64, fmt
    assert collect(events + parser.flush()) == (start + " " * 4 * UNDECIDED_MAX, [])


def test_a_tool_schema_that_only_refers_to_itself_is_refused_as_the_tools(qwen25_server):
    # Before: the call was accepted, and the fault showed only once the output reached the tool's
    # arguments: the request ended as "abort", with no reason the client could see.
    looping = {"type": "function", "function": {"name": "loop", "strict": True, "parameters": {"$ref": "#"}}}
    for choice in ("auto", "required"):
        body = {"model": "m", "messages": USER, "max_tokens": 200, "tools": [looping, NOW], "tool_choice": choice}
        r = httpx.post(qwen25_server + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert message.startswith("the constraint built from tools cannot be compiled: the JSON schema at # only "
                                  "leads back to itself"), message
    wait_idle(qwen25_server)
