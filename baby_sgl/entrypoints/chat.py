"""A chat request made ready for the engine, and its output read back: what OpenAI's
/v1/chat/completions and Anthropic's /v1/messages share.

- The prompt: the chat template over the messages (OpenAI's shape: assistant `tool_calls`, `tool`
  results), with `tools` when the template renders them; a template that knows no tools gets
  them written into the system message instead, with the calls format the parser reads, and the
  assistant's earlier calls written in that format.
- The constraint: forced and strict tool calls become a grammar (tool_grammar.py); with a
  reasoning parser a json_schema constraint starts after the thinking.
- The output of each choice, piece by piece: reasoning, content, and tool calls. A call is given
  only once complete when its output is grammar-constrained (forced or strict calls: valid once
  complete) or whole; a call cut short (max_tokens) is dropped there. Unconstrained calls stream
  as the model writes them: one already begun when the output is cut stays begun, and the
  finish reason (`length`) says it was cut.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from jinja2.exceptions import TemplateError

from baby_sgl.core.sampling_params import GRAMMAR_KINDS, ServerGrammar, check_grammar_chars
from baby_sgl.engine import Engine
from baby_sgl.entrypoints.reasoning import REASONING_PARSERS, ReasoningSplitter, prompt_opens_reasoning
from baby_sgl.entrypoints.tool_grammar import Tool, json_after_thinking, tool_grammar
from baby_sgl.entrypoints.tool_parsers import (CallArgs, CallEnd, CallStart, Content, Event, ToolCallParser, collect,
                                               render_calls)
from baby_sgl.server_args import TOOL_CALL_PARSER_NAMES


@dataclass(frozen=True)
class Reasoning:
    text: str


ChatEvent = Reasoning | Event


@dataclass(frozen=True)
class NamedTool:
    """A tool_choice that names a function: the answer is one call to it."""

    name: str


# none: no calls; auto: the model decides; required: one call or more (parallel_tool_calls)
ToolChoice = Literal["none", "auto", "required"] | NamedTool


@dataclass
class ChatRequest:
    """What both APIs ask of a chat turn."""

    messages: list[dict[str, Any]]  # OpenAI's shape; assistant tool_calls' arguments as values
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True
    constraint: dict[str, str] = field(default_factory=dict)  # the request's own (json_schema, regex, ebnf)
    prefill: str = ""  # the answer starts with this text (Anthropic's last assistant message), continued


@dataclass
class ChatTurn:
    input_ids: list[int]
    constraint: dict[str, str]  # sampling params to add: the request's own constraint, if it stays as sent
    server_grammar: ServerGrammar | None  # the constraint built here instead (tools, json_schema after thinking)
    starts_inside: bool | None  # the reasoning parser's start (None: no split)
    tool_format: str | None  # the calls format to read (None: no tools)
    tool_names: frozenset[str]  # the functions a call may name
    constrained_calls: bool  # a grammar writes the calls (forced or strict tools)

    def reader(self, stream: bool) -> ChatReader:
        """A reader of one choice's output; a streamed one gives unconstrained calls as written."""
        return ChatReader(self.starts_inside, self.tool_format, self.tool_names,
                          hold_calls=self.constrained_calls or not stream)


def prepare(engine: Engine, settings: dict[str, Any], req: ChatRequest) -> ChatTurn:
    """The prompt and constraint of a chat turn (blocking: run it off the event loop)."""
    fmt: str | None = settings.get("tool_call_parser")
    tools = req.tools if req.tool_choice != "none" else []
    if tools and fmt is None:
        raise ValueError("tools need the server started with --tool-call-parser (one of "
                         f"{', '.join(TOOL_CALL_PARSER_NAMES)}: the format the model writes calls in)")
    named = req.tool_choice if isinstance(req.tool_choice, NamedTool) else None
    forced = named is not None or req.tool_choice == "required"
    if named is not None:
        tools = [t for t in tools if t.name == named.name]
        if not tools:
            raise ValueError(f"tool_choice names {named.name!r}, which is not among the tools")
    listed = req.tools if tools else []  # the model sees every tool, even when one is forced
    messages, template_tools = req.messages, None
    if not engine.chat_template_knows_tools():
        messages = _without_tool_markup(messages, fmt or "qwen25", listed)
    elif listed:
        template_tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                            "parameters": t.parameters}} for t in listed]
    ids = engine.apply_chat_template(messages, req.template_kwargs, template_tools)
    if req.prefill:  # the assistant's turn is open: the answer goes on from its text (bounded as a prompt)
        ids += engine.encode_prompt_text(req.prefill, add_special_tokens=False)

    reasoning_parser = settings.get("reasoning_parser")
    starts_inside = None
    if reasoning_parser is not None:
        # The template may have opened the thinking block already: the output then starts in it.
        # Only what the template added to open the answer counts (a user's text may hold a tag).
        starts_inside = REASONING_PARSERS[reasoning_parser] or prompt_opens_reasoning(
            _generation_prompt(engine, messages, req.template_kwargs, template_tools) + req.prefill)
    thinking = None if starts_inside is None else ("open" if starts_inside else "may")
    constraint, server_grammar = dict(req.constraint), None
    strict = any(t.strict for t in tools)
    if forced or strict:
        if constraint:
            raise ValueError("give response_format (or regex, ebnf, json_schema) or forced or strict tool calls, "
                             "not both")
        assert fmt is not None
        # a named function is called once; `required` and strict calls may be several, if parallel
        parallel = req.parallel_tool_calls and named is None
        source = sum(len(json.dumps({"name": t.name, "parameters": t.parameters})) for t in tools)
        server_grammar = ServerGrammar(tool_grammar(fmt, tools, forced, parallel, thinking), "tools", source)
    elif thinking is not None and "json_schema" in constraint:
        schema = constraint.pop("json_schema")
        check_grammar_chars("json_schema", schema)  # the client's own bound on what it sent
        server_grammar = ServerGrammar(json_after_thinking(schema, thinking), "json_schema", len(schema))
    assert set(constraint) <= set(GRAMMAR_KINDS)
    return ChatTurn(ids, constraint, server_grammar, starts_inside if req.separate_reasoning else None,
                    fmt if tools else None, frozenset(t.name for t in tools), forced or strict)


_END_OF_MESSAGE = "5f0c9a1e-end-of-the-last-message"  # stands for the last message's text


def _generation_prompt(engine: Engine, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None,
                       tools: list[dict[str, Any]] | None) -> str:
    """The text the chat template writes after the last message's text to open the answer ("" when
    it does not write that text)."""
    marked = messages[:-1] + [messages[-1] | {"content": _END_OF_MESSAGE}] if messages else messages
    try:
        text = str(engine.tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False,
                                                        tools=cast(Any, tools), **(template_kwargs or {})))
    except TemplateError:
        return ""
    end = text.rfind(_END_OF_MESSAGE)
    return "" if end < 0 else text[end + len(_END_OF_MESSAGE):]


def _without_tool_markup(messages: list[dict[str, Any]], fmt: str, tools: list[Tool]) -> list[dict[str, Any]]:
    """Messages for a template that knows no tools: the tools and how to call them at the start
    of the system message, an assistant's calls written into its content."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = render_calls(fmt, [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]])
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + calls
        out.append(m)
    if tools:
        listing = "\n".join(json.dumps({"name": t.name, "description": t.description or "",
                                        "parameters": t.parameters}, ensure_ascii=False) for t in tools)
        example = render_calls(fmt, [("function_name", {"argument": "value"})])
        note = (f"You can call these functions:\n{listing}\n\nTo call functions, answer with only the calls, "
                f"written like this:\n{example}\n")
        if out and out[0].get("role") == "system":
            out[0] = out[0] | {"content": note + "\n" + (out[0].get("content") or "")}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out


class ChatReader:
    """One choice's output as events: Reasoning, Content, CallStart, CallArgs, CallEnd. feed each
    piece, flush at the end; any cut of an output into pieces gives the same joined events. hold_calls:
    each call is given whole once complete (its start and all its arguments), and a call the
    output cut short never; else calls stream as written. After flush, `cut` says whether the
    output ended inside a call."""

    def __init__(self, starts_inside: bool | None, tool_format: str | None, tool_names: frozenset[str],
                 hold_calls: bool) -> None:
        self.splitter = None if starts_inside is None else ReasoningSplitter(starts_inside)
        self.tools = None if tool_format is None else ToolCallParser(tool_format, tool_names)
        self.hold_calls = hold_calls
        self._open: dict[int, list[CallStart | CallArgs]] = {}  # calls begun, not complete: their held events
        self._numbers: dict[int, int] = {}  # the parser's index of a call given -> its index as given
        self.cut = False

    def feed(self, text: str) -> list[ChatEvent]:
        if self.splitter is None:
            return self._answer(text, final=False)
        thought, answer = self.splitter.feed(text)
        return ([Reasoning(thought)] if thought else []) + self._answer(answer, final=False)

    def flush(self) -> list[ChatEvent]:
        events: list[ChatEvent] = []
        answer = ""
        if self.splitter is not None:
            thought, answer = self.splitter.flush()
            events += [Reasoning(thought)] if thought else []
        return events + self._answer(answer, final=True)

    def _answer(self, text: str, final: bool) -> list[ChatEvent]:
        if self.tools is None:
            return [Content(text)] if text else []
        events = self.tools.feed(text) + (self.tools.flush() if final else [])
        out = self._calls(events)
        if final:
            self.cut, self._open = bool(self._open), {}
        return out

    def _calls(self, events: list[Event]) -> list[ChatEvent]:
        """The parser's events, calls numbered as given (CallEnd included); held until complete
        if holding."""
        out: list[ChatEvent] = []
        for e in events:
            if isinstance(e, Content | CallStart):
                # Calls come one after another, ended: one still open here broke off (its object
                # was no call) and the output went on. It was not cut, and is never given whole.
                self._open.clear()
            if isinstance(e, Content):
                out.append(e)
            elif isinstance(e, CallStart | CallArgs):
                held = self._open.setdefault(e.index, [])
                if self.hold_calls:
                    held.append(e)
                else:
                    out.append(self._give(e))
            else:
                held = self._open.pop(e.index)
                out += [self._give(h) for h in held] if self.hold_calls else []
                out.append(CallEnd(self._numbers[e.index]))
        return out

    def _give(self, e: CallStart | CallArgs) -> CallStart | CallArgs:
        if isinstance(e, CallStart):
            self._numbers[e.index] = len(self._numbers)
            return CallStart(self._numbers[e.index], e.name)
        return CallArgs(self._numbers[e.index], e.fragment)

    def read(self, text: str) -> tuple[str, str, list[tuple[str, str]]]:
        """A whole output: (reasoning, content, [(name, arguments)])."""
        return summarize(self.feed(text) + self.flush())


def summarize(events: list[ChatEvent]) -> tuple[str, str, list[tuple[str, str]]]:
    """Events joined: (reasoning, content, [(name, arguments)])."""
    content, calls = collect([e for e in events if not isinstance(e, Reasoning)])
    return "".join(e.text for e in events if isinstance(e, Reasoning)), content, calls
