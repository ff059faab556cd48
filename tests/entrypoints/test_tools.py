"""OpenAI tools on /v1/chat/completions (--tool-call-parser), through the official client: forced
and required calls valid for their schemas in every format, streamed as OpenAI streams them,
tool history rendered by the template, calls the model writes itself read back without markup,
and hostile tool requests refused. The parsers are checked on recorded outputs cut anywhere; the
grammars on the tokens of a tokenizer (what must pass, what must not)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from baby_sgl import Engine
from baby_sgl.entrypoints.tool_grammar import Tool, json_after_thinking, tool_grammar
from baby_sgl.entrypoints.tool_parsers import ToolCallParser, collect
from baby_sgl.server_args import ServerArgs
from entrypoints.conftest import serve_in_thread, wait_idle

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
SCHEMAS = {"get_weather": WEATHER, "now": {"type": "object", "properties": {}, "additionalProperties": False}}

RECORDED_NAMES = frozenset({"get_weather", "now", "search", "f"})  # the tools of the recorded outputs
RECORDED = {  # format -> [(output, content, [(name, arguments)])]
    "qwen25": [
        ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
         '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
         "Let me look.\n", [("get_weather", '{"city": "Paris", "days": 2}'), ("now", "{}")]),
        ('<tool_call>\n{"arguments": {"q": "a}b"}, "name": "search"}\n</tool_call>', "",
         [("search", '{"q": "a}b"}')]),
        ('<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>', "", [("f", '{"x": 1}')]),
        ("<tool_call>\nnot a call</tool_call> so text", "<tool_call>\nnot a call</tool_call> so text", []),
        ("Plain answer with <tags> and </tool_call>.", "Plain answer with <tags> and </tool_call>.", []),
    ],
    "llama3": [
        ('{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "now", "parameters": {}}', "",
         [("get_weather", '{"city": "Oslo"}'), ("now", "{}")]),
        ('<|python_tag|>{"name": "now", "parameters": {}}', "", [("now", "{}")]),
        ('{"answer": 42}', '{"answer": 42}', []),
        ("It is sunny.", "It is sunny.", []),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "now", "arguments": {}}]', "",
         [("get_weather", '{"city": "Rome"}'), ("now", "{}")]),
        ('[{"name": "now", "arguments": {}}]', "", [("now", "{}")]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}', "", [("get_weather", '{"city": "Nice"}')]),
        ("[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ],
    "pythonic": [
        ('[get_weather(city="Lima", days=3), now()]', "",
         [("get_weather", '{"city": "Lima", "days": 3}'), ("now", "{}")]),
        ('<|python_start|>[now(tz=null)]<|python_end|>', "", [("now", '{"tz": null}')]),
        ("[1, 2] is a list", "[1, 2] is a list", []),
        ("[f(1)] has a positional argument", "[f(1)] has a positional argument", []),
    ],
}


@pytest.mark.parametrize("fmt, output, content, calls",
                         [(fmt, *case) for fmt, cases in RECORDED.items() for case in cases])
def test_parsers_read_recorded_outputs_however_they_are_cut(fmt, output, content, calls):
    assert ToolCallParser(fmt, RECORDED_NAMES).parse(output) == (content, calls)
    for cut in range(len(output) + 1):  # in two pieces at every boundary
        p = ToolCallParser(fmt, RECORDED_NAMES)
        assert collect(p.feed(output[:cut]) + p.feed(output[cut:]) + p.flush()) == (content, calls), cut
    p = ToolCallParser(fmt, RECORDED_NAMES)  # a character at a time
    assert collect([e for ch in output for e in p.feed(ch)] + p.flush()) == (content, calls)


@pytest.fixture(scope="module")
def matcher(tiny_llama):
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[tok.eos_token_id])

    def accepts(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(lltok, llguidance.grammar_from("ebnf", grammar), log_level=0)
        assert not m.is_error(), m.get_error()
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    return accepts


GRAMMAR_CASES = [  # (format, forced, parallel, thinking, text, accepted)
    ("qwen25", True, True, None, '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', True),
    ("qwen25", True, False, None, '<tool_call>\n{"name": "get_weather", "arguments": {"days":2}}\n</tool_call>', False),
    ("qwen25", True, True, "may", '<think>hmm, </think>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
     True),
    ("qwen25", True, True, "may", "Just text", False),
    ("qwen25", False, True, None, "Just text", True),
    ("qwen25", False, True, None, 'Text <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', True),
    ("qwen25", False, True, None, 'Text <tool_call>\n{"name": "later", "arguments": {}}\n</tool_call>', False),
    ("llama3", True, True, "open", 'so</think>{"name": "now", "parameters": {}}; '
     '{"name": "get_weather", "parameters": {"city":"Rome","days":3}}', True),
    ("llama3", True, True, None, '{"name": "get_weather", "parameters": {"city":"Rome","days":9}}', False),
    ("llama3", False, True, None, '{"not": "a call"}', False),
    ("mistral", True, True, None, '[TOOL_CALLS][{"name": "now", "arguments": {}}]', True),
    ("mistral", False, True, None, 'Sure. [TOOL_CALLS][{"name": "now", "arguments": {}}]', True),
    ("pythonic", True, True, None, '[get_weather(city="Lima", days=3), now()]', True),
    ("pythonic", True, True, None, '[get_weather(days=3)]', False),
    ("pythonic", False, False, None, "Hello", True),
]


@pytest.mark.parametrize("fmt, forced, parallel, thinking, text, accepted", GRAMMAR_CASES)
def test_grammars_take_valid_calls_only(matcher, fmt, forced, parallel, thinking, text, accepted):
    tools = [Tool("get_weather", None, WEATHER), Tool("now", None, {"type": "object", "properties": {}}, strict=True)]
    assert matcher(tool_grammar(fmt, tools, forced, parallel, thinking), text) is accepted


def test_a_json_schema_holds_after_the_thinking(matcher):
    grammar = json_after_thinking(json.dumps(WEATHER), "may")
    assert matcher(grammar, '<think>{not json</think>\n{"city":"Oslo"}')
    assert matcher(grammar, '{"city":"Oslo"}')
    assert not matcher(grammar, '<think>ok</think>{"days":1}')


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="none")


def _check_calls(calls, names=None) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("fmt", ["qwen25", "llama3", "mistral", "pythonic"])
def test_forced_calls_are_valid_whole_and_streamed(tiny_llama, fmt):
    engine = Engine(tiny_llama, dtype="float32")
    with serve_in_thread(engine, ServerArgs(tool_call_parser=fmt)) as base:
        client = _client(base)
        messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
        for seed in range(2):
            r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required",
                                               max_tokens=120, seed=seed, temperature=1.0)
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            _check_calls(choice.message.tool_calls)
        named = {"type": "function", "function": {"name": "get_weather"}}
        pieces = list(client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice=named,
                                                     max_tokens=120, temperature=0, stream=True))
        deltas = [p.choices[0].delta for p in pieces if p.choices]
        calls = [c for d in deltas for c in d.tool_calls or []]
        assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
        assert all(c.index == 0 and c.function.name is None and c.id is None for c in calls[1:])  # then fragments
        assert not any(d.content for d in deltas)  # no markup leaks into content
        arguments = "".join(c.function.arguments or "" for c in calls)
        jsonschema.validate(json.loads(arguments), WEATHER)
        assert pieces[-1].choices[0].finish_reason == "tool_calls"
        whole = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice=named,
                                               max_tokens=120, temperature=0)
        assert [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls] == \
            [("get_weather", arguments)]  # a named function is called once
        wait_idle(base)


# A template that renders tools and tool calls itself (as Qwen2.5's and Llama 3.1's do).
TOOLS_TEMPLATE = (
    "{% if tools %}<s>tools: {% for t in tools %}{{ t.function.name }}{{ t.function.parameters | tojson }} "
    "{% endfor %}\n{% endif %}"
    "{% for m in messages %}<s>{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="module")
def hermes_server(tiny_llama, tmp_path_factory):
    template = tmp_path_factory.mktemp("tools-template") / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    engine = Engine(tiny_llama, dtype="float32", chat_template=str(template))
    with serve_in_thread(engine, ServerArgs(tool_call_parser="qwen25")) as base:
        yield base


def test_tool_results_in_the_history_are_rendered_by_the_template(hermes_server, tiny_llama):
    from transformers import AutoTokenizer

    client = _client(hermes_server)
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
                 {"role": "tool", "tool_call_id": call.id, "content": "12 C and sunny"}]
    second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    # The prompt is exactly the template's rendering, the tools and the call's arguments (as a
    # value) included: the byte-level tokenizer gives a token per byte, so any change shows.
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    rendered = tokenizer.apply_chat_template(
        [messages[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": json.loads(call.function.arguments)}}]},
         messages[2]], tools=TOOLS, chat_template=TOOLS_TEMPLATE, add_generation_prompt=True, tokenize=False)
    assert second.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert "(for call_" in rendered and "12 C and sunny" in rendered
    wait_idle(hermes_server)


def test_calls_the_model_writes_itself_are_read_without_markup(hermes_server):
    # tool_choice auto: the model decides. A regex stands for a model trained to call tools.
    client = _client(hermes_server)
    shape = {"regex": r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{3,6}"\}\}'
                      r'\n</tool_call>'}
    messages = [{"role": "user", "content": "Weather?"}]
    whole = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=120, temperature=0,
                                           extra_body=shape)
    message = whole.choices[0].message
    assert message.content == "Checking.\n" and whole.choices[0].finish_reason == "tool_calls"
    _check_calls(message.tool_calls, {"get_weather"})
    pieces = list(client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=120,
                                                 temperature=0, extra_body=shape, stream=True))
    deltas = [p.choices[0].delta for p in pieces if p.choices]
    assert "".join(d.content or "" for d in deltas) == "Checking.\n"
    calls = [c for d in deltas for c in d.tool_calls or []]
    assert "".join(c.function.arguments or "" for c in calls) == message.tool_calls[0].function.arguments
    # tool_choice none: the same output stays text
    none = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="none",
                                          max_tokens=120, temperature=0, extra_body=shape)
    assert none.choices[0].message.tool_calls is None and "<tool_call>" in none.choices[0].message.content
    wait_idle(hermes_server)


def test_strict_tools_hold_their_schema_under_auto(hermes_server):
    strict = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}}]
    client = _client(hermes_server)
    for seed in range(4):
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}], tools=strict,
                                           max_tokens=60, seed=seed, temperature=1.0)
        message = r.choices[0].message
        assert "<tool_call>" not in (message.content or "")
        if message.tool_calls:
            _check_calls(message.tool_calls, {"get_weather"})
    wait_idle(hermes_server)


def _post(base: str, body: dict) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=60)


RECURSIVE = {"type": "object", "properties": {"node": {"$ref": "#/$defs/n"}}, "required": ["node"],
             "$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}}


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize("change, needle", [
    ({"tools": [TOOLS[1]] * 129}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(40)}}]}, "deeper"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "same name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "missing"),
    ({"tool_choice": "required"}, "no tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "not both"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{not json"}}]}]}, "not valid JSON"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}]}, "assistant"),
])
def test_hostile_tool_requests_get_a_400(hermes_server, change, needle):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | change
    r = _post(hermes_server, body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    wait_idle(hermes_server)


def test_a_recursive_schema_gives_a_valid_call(hermes_server):
    # Checked by leaving the schema out of the forced-call grammar (`tool_grammar.tool_grammar`:
    # `schema = tool.parameters if constrained else _ANY_OBJECT` made `schema = _ANY_OBJECT`): the call's
    # arguments then fail the schema here, and (that check left out) the endless schema's request runs on to
    # its length limit instead of ending at once.
    tools = [{"type": "function", "function": {"name": "tree", "parameters": RECURSIVE}}]
    r = _post(hermes_server, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                              "tools": tools, "tool_choice": "required", "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]  # greedy on the tiny model: the grammar closes the call within 200 tokens
    assert choice["finish_reason"] == "tool_calls", choice
    jsonschema.validate(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]), RECURSIVE)
    # a schema no finite value meets: the grammar's error state ends the request alone, with no call
    endless = json.loads(json.dumps(RECURSIVE))
    endless["$defs"]["n"]["required"] = ["next"]
    r = _post(hermes_server, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                              "tools": [{"type": "function", "function": {"name": "tree", "parameters": endless}}],
                              "tool_choice": "required"})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and not choice["message"].get("tool_calls"), choice
    assert _post(hermes_server, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 2}).status_code == 200
    wait_idle(hermes_server)


def test_tools_need_a_parser(server):
    r = _post(server, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
    r = _post(server, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                       "tool_choice": "none", "max_tokens": 2})
    assert r.status_code == 200


def test_text_and_a_call_in_one_streamed_piece_both_reach_the_client():
    """A streamed piece that holds the text before a call and the whole call (several tokens per
    step) gives a delta with both the content and the call, and finish_reason tool_calls."""
    import asyncio

    from baby_sgl.entrypoints.chat import ChatReader
    from baby_sgl.entrypoints.openai_api import _no_logprobs, _openai_sse

    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "oslo"}}\n</tool_call>'
    meta = {"completion_tokens": len(text), "prompt_tokens": 3, "cached_tokens": 0,
            "finish_reason": {"type": "stop", "matched": None}}

    async def chunks():
        yield 0, {"text": text, "finished": True, "meta_info": meta}

    def reader(stream: bool) -> ChatReader:
        return ChatReader(None, "qwen25", frozenset({"get_weather"}), hold_calls=not stream)

    async def body() -> list[dict]:
        head = {"id": "chatcmpl-x", "created": 0, "model": "m"}
        events = _openai_sse(first=None, chunks=chunks(), head=head, kind="chat.completion", n=1, include_usage=False,
                             logprobs=_no_logprobs, echoed=None, chat=(reader, True))
        return [json.loads(e[len("data: "):]) async for e in events if e.startswith("data: {")]

    (choice,) = [c for e in asyncio.run(body()) for c in e["choices"]]
    assert choice["delta"]["content"] == "Checking.\n"
    assert [c["function"]["name"] for c in choice["delta"]["tool_calls"]] == ["get_weather"]
    assert json.loads(choice["delta"]["tool_calls"][0]["function"]["arguments"]) == {"city": "oslo"}
    assert choice["finish_reason"] == "tool_calls"
