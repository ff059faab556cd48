"""How a choice with tool calls ends: a call the output abandoned (its object broke off after its
name, and the output went on) is not a call the output was cut inside, so the calls made before
it still end the choice with finish_reason tool_calls."""

from __future__ import annotations

import openai
import pytest

from baby_sgl import Engine
from baby_sgl.server_args import ServerArgs
from entrypoints.conftest import serve_checked
from entrypoints.test_tools import TOOLS

# A model that calls `now`, then writes an object that breaks off after its name (`x` is no key).
CALL_THEN_BROKEN = {"regex": r'<tool_call>\n\{"name": "now", "arguments": \{\}\}\n</tool_call>\n'
                             r'<tool_call>\n\{"name": "now", "arguments": \{\}, x\}\n</tool_call>'}


@pytest.fixture(scope="module")
def qwen25_server(tiny_llama):
    with serve_checked(Engine(tiny_llama, dtype="float32"), ServerArgs(tool_call_parser="qwen25")) as base:
        yield base


def test_a_call_that_broke_off_does_not_count_as_cut(qwen25_server):
    # Before: chat.py:ChatReader._answer set `cut` from every call begun and never ended
    # (`self.cut = bool(self._open)`), the abandoned one too, so _chat_finish said "stop".
    client = openai.OpenAI(base_url=qwen25_server + "/v1", api_key="none")
    messages = [{"role": "user", "content": "What time is it?"}]
    whole = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=120,
                                           temperature=0, extra_body=CALL_THEN_BROKEN)
    choice = whole.choices[0]
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("now", "{}")]
    assert choice.finish_reason == "tool_calls"
    pieces = list(client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=120,
                                                 temperature=0, extra_body=CALL_THEN_BROKEN, stream=True))
    assert pieces[-1].choices[0].finish_reason == "tool_calls"
