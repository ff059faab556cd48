"""--reasoning-parser: a thinking model's <think>...</think> split into reasoning_content and
content on /v1/chat/completions, whole and streamed (the official OpenAI client), with
separate_reasoning / stream_reasoning and chat_template_kwargs. The tiny model does not think, so
a regex makes it write the tags; the splitting itself is checked on recorded outputs cut at every
pair of points."""

from __future__ import annotations

import openai
import pytest

from baby_sgl.entrypoints.reasoning import UNDECIDED_MAX, ReasoningSplitter, prompt_opens_reasoning
from baby_sgl.server_args import ServerArgs
from entrypoints.conftest import thinking_server, wait_idle

RECORDED = [  # (starts inside the block, output, reasoning, content)
    (True, "The user wants 2 + 2.\nThat is 4.\n</think>\n\nThe answer is **4**.",
     "The user wants 2 + 2.\nThat is 4.\n", "The answer is **4**."),
    (True, "<think>\nRedundant tag, then thoughts.</think>Done.", "\nRedundant tag, then thoughts.", "Done."),
    (False, "<think>\nCount the letters: r, r, r.\n</think>\n\nThere are 3.", "\nCount the letters: r, r, r.\n",
     "There are 3."),
    (False, "Straight to the answer: Paris.", "", "Straight to the answer: Paris."),
    (True, "Cut off while still thinking about </th", "Cut off while still thinking about </th", ""),
    (False, "<think></think>\n\nEmpty thoughts.", "", "Empty thoughts."),
]


@pytest.mark.parametrize("inside, text, reasoning, content", RECORDED)
def test_the_split_does_not_depend_on_how_the_output_is_cut(inside, text, reasoning, content):
    assert ReasoningSplitter(inside).split(text) == (reasoning, content)
    for a in range(len(text) + 1):
        for b in range(a, len(text) + 1):
            s = ReasoningSplitter(inside)
            parts = [s.feed(text[:a]), s.feed(text[a:b]), s.feed(text[b:]), s.flush()]
            assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == (reasoning, content), (a, b)


def test_a_prompt_that_opens_the_block():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


THINK = {"regex": "<think>[a-z]{4,8}</think>[a-z]{3,6}", "temperature": 0}


@pytest.fixture(scope="module")
def qwen3_server(tiny_llama, tmp_path_factory):
    with thinking_server(tiny_llama, tmp_path_factory.mktemp("template")) as base:
        yield base


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="none")


def test_reasoning_content_whole_and_streamed(qwen3_server):
    client = _client(qwen3_server)
    messages = [{"role": "user", "content": "think first"}]
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=40, extra_body=THINK)
    msg = whole.choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning and reasoning.isalpha() and msg.content.isalpha() and "<" not in msg.content
    pieces = list(client.chat.completions.create(model="m", messages=messages, max_tokens=40, stream=True,
                                                 extra_body=THINK))
    deltas = [p.choices[0].delta for p in pieces if p.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == msg.content
    wait_idle(qwen3_server)


def test_separate_and_stream_reasoning_flags(qwen3_server):
    client = _client(qwen3_server)
    messages = [{"role": "user", "content": "think first"}]
    kept = client.chat.completions.create(model="m", messages=messages, max_tokens=40,
                                          extra_body={**THINK, "separate_reasoning": False})
    assert kept.choices[0].message.content.startswith("<think>")
    assert kept.choices[0].message.model_extra.get("reasoning_content") is None
    pieces = list(client.chat.completions.create(model="m", messages=messages, max_tokens=40, stream=True,
                                                 extra_body={**THINK, "stream_reasoning": False}))
    with_reasoning = [i for i, p in enumerate(pieces) if p.choices and (p.choices[0].delta.model_extra or {}).get(
        "reasoning_content")]
    assert len(with_reasoning) == 1 and pieces[with_reasoning[0]].choices[0].finish_reason is not None
    wait_idle(qwen3_server)


def test_chat_template_kwargs_reach_the_template(qwen3_server):
    """enable_thinking opens the block in the prompt: the output then starts in the reasoning."""
    client = _client(qwen3_server)
    out = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=30,
        extra_body={"regex": "[a-z]{4,8}</think>[a-z]{3,6}", "temperature": 0,
                    "chat_template_kwargs": {"enable_thinking": True}})
    msg = out.choices[0].message
    assert msg.model_extra["reasoning_content"].isalpha() and msg.content.isalpha()
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"x": {"nested": [1]}}})
    wait_idle(qwen3_server)


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerArgs(reasoning_parser="nope")


def test_spaces_before_an_opening_tag_are_held_only_so_far():
    """Spaces that may come before `<think>` were held, each piece rescanning them (8000 pieces:
    1.25 s of the event loop). Past UNDECIDED_MAX of them no opening tag is looked for: the output
    has no reasoning."""
    splitter, reasoning, content = ReasoningSplitter(False), "", ""
    for _ in range(4 * UNDECIDED_MAX // 64):
        r, c = splitter.feed(" " * 64)
        reasoning, content = reasoning + r, content + c
    assert reasoning == "" and 3 * UNDECIDED_MAX - 64 <= len(content)
    r, c = splitter.feed("<think>x</think>y")
    assert (reasoning + r, content + c) == ("", " " * 4 * UNDECIDED_MAX + "<think>x</think>y")
    # Within the bound, an opening tag after spaces still opens the reasoning.
    assert ReasoningSplitter(False).split(" " * (UNDECIDED_MAX // 2) + "<think>x</think>y") == ("x", "y")
