"""Reasoning output (`--reasoning-parser`, SGLang's names): a thinking model's `<think>...</think>`
split from its answer, as OpenAI-style `reasoning_content` and `content`, whole or as it streams.

deepseek-r1: the chat template opens the thinking block itself, so the output starts inside it
(an opening tag the model writes anyway is dropped); qwen3: the model opens it, and answers
straight away when it does not (enable_thinking=False). Either way a prompt that already ends
inside an open block (the template opened it) starts the output in the reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from baby_sgl.server_args import REASONING_PARSER_NAMES

START, END = "<think>", "</think>"
# Characters of output held at most while a parser cannot yet tell what they are (spaces before
# an opening tag here; before calls, a separator or an end marker in tool_parsers.py): past this
# they are read as content. Each piece rescans what is held, so this bounds a piece's work (a
# stream of spaces cost time quadratic in its length).
UNDECIDED_MAX = 1024
# parser name -> whether the output starts inside the reasoning block
REASONING_PARSERS = {"deepseek-r1": True, "qwen3": False}
assert set(REASONING_PARSERS) == set(REASONING_PARSER_NAMES), "one list of parsers"


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """The rendered prompt ends inside a thinking block (the template opened it)."""
    return prompt_text.rfind(START) > prompt_text.rfind(END)


@dataclass
class ReasoningSplitter:
    """Splits one output into (reasoning, content), whole (split) or piece by piece (feed): the
    same text gives the same split however it is cut into pieces."""

    in_reasoning: bool  # inside the block (at first: the output starts there)
    _pending: str = ""  # text held back: it may be the start of a tag
    _seen_start: bool = False  # past the point where an opening tag may come
    _done: bool = False  # past the reasoning (closed, or never opened)
    _after_end: bool = False  # just closed: the newlines before the answer are dropped

    def split(self, text: str) -> tuple[str, str]:
        reasoning, content = self.feed(text)
        tail_reasoning, tail_content = self.flush()
        return reasoning + tail_reasoning, content + tail_content

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content this piece adds."""
        text, self._pending = self._pending + text, ""
        reasoning = content = ""
        while text:
            if self._done:
                if self._after_end:
                    text = text.lstrip("\n")
                    if not text:
                        break
                    self._after_end = False
                content += text
                break
            if not self._seen_start:  # an opening tag may still come (or, inside, a redundant one)
                stripped = text.lstrip()
                if len(stripped) < len(START) and START.startswith(stripped) and len(text) <= UNDECIDED_MAX:
                    self._pending = text
                    break
                self._seen_start = True
                if stripped.startswith(START):
                    self.in_reasoning, text = True, stripped[len(START):]
                    continue
                if not self.in_reasoning:  # no reasoning in this output: all of it is the answer
                    self._done = True
                    continue
            end = text.find(END)
            if end >= 0:
                reasoning, text = reasoning + text[:end], text[end + len(END):]
                self.in_reasoning, self._done, self._after_end = False, True, True
                continue
            keep = partial_suffix(text, END)
            reasoning, self._pending = reasoning + text[: len(text) - keep], text[len(text) - keep :]
            break
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What was held back, at the end of the output."""
        pending, self._pending = self._pending, ""
        if self.in_reasoning:
            return pending, ""
        return "", pending.lstrip("\n") if self._after_end else pending


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
