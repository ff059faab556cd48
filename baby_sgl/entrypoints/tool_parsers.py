"""Tool calls in a model's output (`--tool-call-parser`, SGLang's names), read as the text streams.

Formats:
- qwen25 (also `qwen`, `hermes`): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call; text before and between them is the answer's content.
- llama3: `{"name": ..., "parameters": {...}}` as the whole output or after `<|python_tag|>`,
  several separated by `;`.
- mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (the marker is a special token,
  so the text may start at `[`) or `[TOOL_CALLS]name[ARGS]{...}`.
- pythonic: `[get_weather(city="Paris"), ...]` as the whole output (Llama 3.2/4), or between
  `<|python_start|>` and `<|python_end|>`.

ToolCallParser turns pieces of output into events: content text, a call's start (its name) and
fragments of its arguments (a JSON object's text, streamed as the model writes it once the name
is known) and its end (the call is complete). Complete output is one piece: any cut of a text
into pieces gives the same content, names and arguments. Markup that turns out not to be a call
(no name, not JSON, not a call expression, a function that is not among the tools) comes back as
content, as written.
"""

from __future__ import annotations

import ast
import io
import itertools
import json
import keyword
import re
import tokenize
from dataclasses import dataclass
from typing import Any

from baby_sgl.entrypoints.reasoning import UNDECIDED_MAX, partial_suffix
from baby_sgl.server_args import TOOL_CALL_PARSER_NAMES


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # the call's place among this output's calls
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    fragment: str  # the arguments' JSON text continues with this


@dataclass(frozen=True)
class CallEnd:
    index: int  # the call is complete: its arguments are all given


Event = Content | CallStart | CallArgs | CallEnd


class _JsonScan:
    """Where a JSON text stands, a character at a time: nesting depth and strings."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_str = self.escape = False

    def step(self, ch: str) -> bool:
        """Advances; True when ch closed a string (a key or a value may be complete)."""
        if self.in_str:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_str = False
                return True
        elif ch == '"':
            self.in_str = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
        return False


class _ObjectCall:
    """One call written as a JSON object, {"name": ..., "arguments" (or "parameters"): ...} in
    either order. Its arguments stream once the name is known, if they are an object; arguments
    given as a JSON string (some models encode them twice) are decoded when the object closes."""

    ARG_KEYS = ("arguments", "parameters")

    def __init__(self) -> None:
        self.raw: list[str] = []
        self.scan = _JsonScan()
        self.str_start = 0
        self.expect = "key"  # at the top level: key, colon, value or comma
        self.key: object = None
        self.name: object = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.sent: int | None = None  # where the arguments not yet handed out start in raw
        self.done = self.broken = False

    def feed(self, ch: str) -> None:
        i, scan = len(self.raw), self.scan
        self.raw.append(ch)
        top = scan.depth == 1 and not scan.in_str
        if scan.in_str or ch.isspace():
            if scan.step(ch) and scan.depth == 1:
                self._top_string(i)
            return
        if i == 0 and ch != "{" or scan.depth == 0 and i > 0:
            self.broken = True
            return
        if top and self.expect == "value":
            if self.key in self.ARG_KEYS and self.args_start is None:
                self.args_start = i
            self.expect = "comma"
            if ch == '"':
                self.str_start = i
        elif top and ch == ":" and self.expect == "colon":
            self.expect = "value"
        elif top and ch == "," and self.expect == "comma":
            self._end_args(i)
            self.expect = "key"
        elif top and ch == '"' and self.expect == "key":
            self.str_start = i
        elif top and ch == "}":
            self._end_args(i)
        elif top and ch not in "{[" and not (self.expect == "comma" and self._in_primitive(i)):
            self.broken = True
            return
        scan.step(ch)
        if scan.depth == 1 and ch in "}]" and self.args_start is not None and self.args_end is None:
            self.args_end = i + 1
        if scan.depth == 0 and i > 0:
            self.done = True
            self.broken = not isinstance(self.name, str)

    def _in_primitive(self, i: int) -> bool:
        return i > 0 and self.raw[i - 1] not in '"}]' and not self.raw[i - 1].isspace()

    def _top_string(self, i: int) -> None:
        try:
            value = json.loads("".join(self.raw[self.str_start : i + 1]))
        except json.JSONDecodeError:
            self.broken = True
            return
        if self.expect == "key":
            self.key, self.expect = value, "colon"
        elif self.key == "name" and self.name is None:
            self.name = value

    def _end_args(self, i: int) -> None:
        if self.args_start is not None and self.args_end is None:
            self.args_end = i

    def new_arguments(self) -> str:
        """The arguments' text written since the last call that can be sent (the rest of it once
        the object closed): each character is handed out once."""
        if self.args_start is None:  # none given: {} once the object closed
            if not self.done or self.sent is not None:
                return ""
            self.sent = len(self.raw)
            return "{}"
        if self.raw[self.args_start] not in "{[":  # a string (or another value): whole, at the close
            if not self.done or self.sent is not None:
                return ""
            self.sent = len(self.raw)
            text = "".join(self.raw[self.args_start : self.args_end]).strip()
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                return text
            return value if isinstance(value, str) else json.dumps(value)
        start = self.args_start if self.sent is None else self.sent
        self.sent = self.args_end if self.args_end is not None else len(self.raw)
        return "".join(self.raw[start : self.sent])


class ToolCallParser:
    """One output's content and tool calls, piece by piece: feed each piece, flush at the end."""

    def __init__(self, fmt: str, names: frozenset[str]) -> None:
        """names: the functions that may be called (the request's tools)."""
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool call parser {fmt!r}; one of {', '.join(TOOL_CALL_PARSER_NAMES)}")
        self.fmt = FORMATS[fmt]
        self.names = names
        self.calls = 0  # calls started so far
        self._text = ""  # not yet consumed
        self._at_start = True  # nothing but spaces seen: the output itself may be the calls
        self._section: _Section | None = None
        self._after_section = False  # spaces right after calls are not content

    def feed(self, text: str) -> list[Event]:
        self._text += text
        return self._run(final=False)

    def flush(self) -> list[Event]:
        return self._run(final=True)

    def parse(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        """Complete output: (content, [(name, arguments)])."""
        return collect(self.feed(text) + self.flush())

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self._section is not None:
                rest = self._section.feed(self._text, out, self)
                if rest is None:  # the section goes on past this text
                    self._text = ""
                    if final:
                        self._section.finish(out)
                        self._section = None
                    break
                self._text, self._after_section = rest, self._section.had_calls()
                self._section = None
                continue
            if self._after_section:
                stripped = self._text.lstrip()
                if not stripped:
                    self._text = ""
                    break
                self._text, self._after_section = stripped, False
            if self._at_start:
                stripped = self._text.lstrip()
                decide = final or len(self._text) > UNDECIDED_MAX
                opens = self.fmt.opens_output(stripped, decide) if stripped or decide else None
                if opens is None:  # cannot tell yet
                    break
                self._at_start = False
                if opens:
                    self._section, self._text = self.fmt.section(""), stripped
                    continue
            pos, marker = self.fmt.find_marker(self._text)
            if marker is not None:
                if pos:
                    out.append(Content(self._text[:pos]))
                self._section, self._text = self.fmt.section(marker), self._text[pos + len(marker):]
                continue
            keep = 0 if final else max(partial_suffix(self._text, m) for m in self.fmt.markers)
            if len(self._text) > keep:
                out.append(Content(self._text[: len(self._text) - keep]))
                self._text = self._text[len(self._text) - keep:]
            break
        return _merge(out)


class _Section:
    """Output that holds calls, from its marker on."""

    def __init__(self, marker: str) -> None:
        self.raw = [marker]  # read so far, in pieces (given back as content if it holds no call)

    def text(self, start: int = 0) -> str:
        return "".join(self.raw[start:])

    def feed(self, text: str, out: list[Event], parser: ToolCallParser) -> str | None:
        """Consumes text; returns what follows the section once it has ended (None: not yet)."""
        raise NotImplementedError

    def finish(self, out: list[Event]) -> None:
        """The output ended inside the section."""
        raise NotImplementedError

    def had_calls(self) -> bool:
        raise NotImplementedError


class _JsonCalls(_Section):
    """Calls as JSON objects: `before` (e.g. "["), the objects separated by `sep`, then `end`."""

    before = sep = end = ""

    def __init__(self, marker: str) -> None:
        super().__init__(marker)
        self.phase = "before" if self.before else "object"  # before, object, after
        self.call: _ObjectCall | None = None
        self.call_raw = 0  # where the current object starts in raw
        self.index: int | None = None  # the parser's index of the current call, once begun
        self.began = 0  # calls begun in this section
        self.pending = ""  # spaces, or the start of a separator or of the end, after an object

    def feed(self, text: str, out: list[Event], parser: ToolCallParser) -> str | None:
        text, self.pending, k = self.pending + text, "", 0
        while k < len(text):
            ch = text[k]
            if self.phase == "after":  # a separator, the end, or text that is not ours
                rest = text[k:]
                stripped = rest.lstrip()
                if (not stripped or any(len(stripped) < len(m) and m.startswith(stripped) for m in (self.sep, self.end)
                                        if m)) and len(rest) <= UNDECIDED_MAX:
                    self.pending = rest  # a separator or the end may be coming
                    return None
                skip = len(rest) - len(stripped)
                if self.sep and stripped.startswith(self.sep):
                    self.raw.append(rest[: skip + len(self.sep)])
                    self.phase, k = "object", k + skip + len(self.sep)
                    continue
                if self.end and stripped.startswith(self.end):
                    return stripped[len(self.end):]
                return rest  # the calls ended without their closing markup
            k += 1
            self.raw.append(ch)
            if self.phase == "before":
                if not ch.isspace():
                    if ch != self.before:
                        return self._broken(out, text[k:])
                    self.phase = "object"
                continue
            if self.call is None:
                if ch.isspace():
                    continue
                self.call, self.call_raw = _ObjectCall(), len(self.raw) - 1
            self._feed_call(ch, out, parser)
            if self.call is not None and self.call.broken:
                return self._broken(out, text[k:])
        if self.call is not None and self.index is not None:
            self._send_args(out)
        return None

    def _feed_call(self, ch: str, out: list[Event], parser: ToolCallParser) -> None:
        call = self.call
        assert call is not None
        call.feed(ch)
        if call.broken:
            return
        if self.index is None and isinstance(call.name, str):
            if call.name not in parser.names:  # not a function of ours: the object is text
                call.broken = True
                return
            self.index = parser.calls
            parser.calls += 1
            self.began += 1
            out.append(CallStart(self.index, call.name))
        if call.done:
            assert self.index is not None  # a done call without a name is broken
            self._send_args(out)
            out.append(CallEnd(self.index))
            self.call, self.index, self.phase = None, None, "after"

    def _send_args(self, out: list[Event]) -> None:
        assert self.call is not None and self.index is not None
        if args := self.call.new_arguments():
            out.append(CallArgs(self.index, args))

    def _broken(self, out: list[Event], rest: str) -> str:
        """Not a call: the broken object's text (the whole section's if no call began in it) is
        content, and so is what follows. A call already announced stays as far as it went."""
        if self.index is None:
            out.append(Content(self.text(self.call_raw if self.began else 0)))
        self.call = self.index = None
        return rest

    def had_calls(self) -> bool:
        return self.began > 0

    def finish(self, out: list[Event]) -> None:
        if self.call is not None and self.index is None:  # cut off before its name: not a call
            out.append(Content(self.text(self.call_raw if self.began else 0)))
        elif not self.began:
            out.append(Content(self.text()))


class _Qwen25(_JsonCalls):
    end = "</tool_call>"


class _Llama3(_JsonCalls):
    sep = ";"


class _MistralArray(_JsonCalls):
    before, sep, end = "[", ",", "]"


class _MistralNamed(_Section):
    """`name[ARGS]{...}` after the marker, one call."""

    MAX_HEAD = 128  # a function name (64 at most) and [ARGS], with spaces

    def __init__(self, marker: str) -> None:
        super().__init__(marker)
        self.head = ""  # after the marker, until the name and [ARGS] are read
        self.name: str | None = None
        self.scan = _JsonScan()
        self.index: int | None = None

    def feed(self, text: str, out: list[Event], parser: ToolCallParser) -> str | None:
        for k, ch in enumerate(text):
            if self.name is None:
                self.head += ch
                named = re.fullmatch(r"\s*([\w.\-]+)\[ARGS\]", self.head)
                if named and named[1] in parser.names:
                    self.name, self.index = named[1], parser.calls
                    parser.calls += 1
                    out.append(CallStart(self.index, self.name))
                elif named or len(self.head) > self.MAX_HEAD or not (
                        (m := re.fullmatch(r"\s*[\w.\-]*(\[.*)?", self.head)) and "[ARGS]".startswith(m[1] or "")):
                    out.append(Content(self.text() + self.head))  # not name[ARGS] with a name of ours
                    return text[k + 1:]
                continue
            assert self.index is not None
            if self.scan.depth == 0 and ch.isspace():
                continue
            self.scan.step(ch)
            out.append(CallArgs(self.index, ch))
            if self.scan.depth == 0 and not self.scan.in_str:
                out.append(CallEnd(self.index))
                return text[k + 1:]
        return None

    def had_calls(self) -> bool:
        return self.name is not None

    def finish(self, out: list[Event]) -> None:
        if self.name is None:
            out.append(Content(self.text() + self.head))


class _Mistral(_Section):
    """After [TOOL_CALLS]: an array of calls, or a name and its [ARGS]."""

    def __init__(self, marker: str) -> None:
        super().__init__(marker)
        self.inner: _Section | None = None

    def feed(self, text: str, out: list[Event], parser: ToolCallParser) -> str | None:
        if self.inner is None:
            if not text.strip():
                self.raw.append(text)
                return None
            self.inner = (_MistralArray if text.lstrip().startswith("[") else _MistralNamed)(self.text())
        return self.inner.feed(text, out, parser)

    def had_calls(self) -> bool:
        return self.inner is not None and self.inner.had_calls()

    def finish(self, out: list[Event]) -> None:
        if self.inner is None:
            out.append(Content(self.text()))
        else:
            self.inner.finish(out)


class _Pythonic(_Section):
    """A Python list of calls, read whole once its brackets close; `<|python_end|>` may follow."""

    END = "<|python_end|>"

    def __init__(self, marker: str) -> None:
        super().__init__(marker)
        self.depth = 0
        self.quote = ""  # the open string's quote character
        self.escape = False
        self.calls = 0  # calls read (the list has closed)
        self.pending = ""  # after the list: spaces or the start of the end marker

    def feed(self, text: str, out: list[Event], parser: ToolCallParser) -> str | None:
        if self.calls:  # after the list: its end marker may follow
            text, self.pending = self.pending + text, ""
            stripped = text.lstrip()
            if (not stripped or len(stripped) < len(self.END) and self.END.startswith(stripped)) \
                    and len(text) <= UNDECIDED_MAX:
                self.pending = text
                return None
            return stripped[len(self.END):] if stripped.startswith(self.END) else text
        for k, ch in enumerate(text):
            self.raw.append(ch)
            if self.quote:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == self.quote:
                    self.quote = ""
            elif ch in "'\"":
                self.quote = ch
            elif ch in "[({":
                self.depth += 1
            elif ch in "])}":
                self.depth -= 1
                if self.depth == 0:
                    calls = _python_calls(self.text(1).strip())  # after the marker
                    if calls is None or any(name not in parser.names for name, _ in calls):
                        out.append(Content(self.text()))
                        return text[k + 1:]
                    for name, args in calls:
                        out.append(CallStart(parser.calls, name))
                        out.append(CallArgs(parser.calls, args))
                        out.append(CallEnd(parser.calls))
                        parser.calls += 1
                    self.calls = len(calls)
                    return self.feed(text[k + 1:], out, parser)
        return None

    def had_calls(self) -> bool:
        return self.calls > 0

    def finish(self, out: list[Event]) -> None:
        if not self.calls:
            out.append(Content(self.text()))


_PY_CONSTANTS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _python_calls(text: str) -> list[tuple[str, str]] | None:
    """[f(a=1), g()] as [(name, arguments as JSON)], or None when it is not such a list. JSON's
    true, false and null are read as Python's (a grammar may write arguments as JSON)."""
    renamed: dict[str, str] = {}
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        text, renamed = _keyword_arguments_renamed(text)
        try:
            tree = ast.parse(text, mode="eval").body
        except (SyntaxError, ValueError, RecursionError):
            return None
    except (ValueError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(name := _dotted(node.func), str):
            return None
        args = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            try:
                args[renamed.get(kw.arg, kw.arg)] = _literal(kw.value)
            except (ValueError, TypeError, RecursionError):
                return None
        calls.append((name, json.dumps(args, ensure_ascii=False)))
    return calls


def _keyword_arguments_renamed(text: str) -> tuple[str, dict[str, str]]:
    """An argument may be named as a Python keyword is (`from=`, `class=`: JSON schemas allow
    any name), which Python's parser refuses: each such name becomes one the text does not hold.
    Returns the text and {new name: argument name}."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        return text, {}
    line_starts = list(itertools.accumulate(map(len, text.splitlines(keepends=True)), initial=0))
    # An alias only has to differ from the names: the same letters inside a string are no clash.
    # (Looking for it in the whole text made `from` and a string of n underscores cost n^2.)
    names = {tok.string for tok in tokens if tok.type == tokenize.NAME}
    aliases: dict[str, str] = {}
    edits = []
    for tok, after in zip(tokens, tokens[1:]):
        if tok.type == tokenize.NAME and keyword.iskeyword(tok.string) and after.exact_type == tokenize.EQUAL:
            if tok.string not in aliases:
                alias = tok.string + "_"
                while alias in names or alias in aliases.values():
                    alias += "_"
                aliases[tok.string] = alias
            start = line_starts[tok.start[0] - 1] + tok.start[1]
            edits.append((start, start + len(tok.string), aliases[tok.string]))
    for start, end, alias in reversed(edits):
        text = text[:start] + alias + text[end:]
    return text, {alias: name for name, alias in aliases.items()}


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (head := _dotted(node.value)):
        return f"{head}.{node.attr}"
    return None


def _literal(node: ast.expr):
    if isinstance(node, ast.Name) and node.id in _PY_CONSTANTS:
        return _PY_CONSTANTS[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {str(_literal(k)): _literal(v) for k, v in zip(node.keys, node.values) if k is not None}
    value = ast.literal_eval(node)
    if not isinstance(value, str | int | float | bool | type(None)):
        raise ValueError("not a JSON value")
    return value


@dataclass(frozen=True)
class _Format:
    markers: tuple[str, ...]  # where calls start in the middle of the output
    sections: tuple[type[_Section], ...]  # the section each marker opens
    start: re.Pattern | None = None  # the whole output is calls when it starts like this...
    start_prefix: re.Pattern | None = None  # ...which text matching this may still become
    start_section: type[_Section] | None = None

    def opens_output(self, text: str, final: bool) -> bool | None:
        """Whether output starting with text (spaces stripped) is calls; None: cannot tell yet."""
        if self.start is None:
            return False
        if self.start.match(text):
            return True
        return None if not final and self.start_prefix and self.start_prefix.fullmatch(text) else False

    def section(self, marker: str) -> _Section:
        if not marker:
            assert self.start_section is not None
            return self.start_section("")
        return self.sections[self.markers.index(marker)](marker)

    def find_marker(self, text: str) -> tuple[int, str | None]:
        hits = [(text.find(m), m) for m in self.markers if m in text]
        return min(hits) if hits else (0, None)


_QWEN = _Format(("<tool_call>",), (_Qwen25,))
FORMATS = {
    "qwen25": _QWEN, "qwen": _QWEN, "hermes": _QWEN,
    "llama3": _Format(("<|python_tag|>",), (_Llama3,), re.compile(r"\{"), None, _Llama3),
    "mistral": _Format(("[TOOL_CALLS]",), (_Mistral,), re.compile(r"\[\s*\{"), re.compile(r"\[\s*"), _MistralArray),
    "pythonic": _Format(("<|python_start|>",), (_Pythonic,), re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\("),
                        re.compile(r"\[\s*([A-Za-z_][\w.]*\s*)?"), _Pythonic),
}
assert set(FORMATS) == set(TOOL_CALL_PARSER_NAMES), "one list of parsers"


def collect(events: list[Event]) -> tuple[str, list[tuple[str, str]]]:
    """Events joined: (content, [(name, arguments)]), the calls that are complete only."""
    content, calls, ended = "", [], set()
    for ev in events:
        if isinstance(ev, Content):
            content += ev.text
        elif isinstance(ev, CallStart):
            calls.append([ev.name, ""])
        elif isinstance(ev, CallArgs):
            calls[ev.index][1] += ev.fragment
        else:
            ended.add(ev.index)
    return content, [(name, args) for i, (name, args) in enumerate(calls) if i in ended]


def _merge(events: list[Event]) -> list[Event]:
    """Adjacent content joined, and adjacent fragments of one call's arguments; no empty text."""
    out: list[Event] = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, Content):
            if not ev.text:
                continue
            if isinstance(last, Content):
                out[-1] = Content(last.text + ev.text)
                continue
        elif isinstance(ev, CallArgs) and isinstance(last, CallArgs) and last.index == ev.index:
            out[-1] = CallArgs(ev.index, last.fragment + ev.fragment)
            continue
        out.append(ev)
    return out


def render_calls(fmt: str, calls: list[tuple[str, Any]]) -> str:
    """Calls (name, arguments as a value) written as the format writes them: what a template
    that knows no tools gets for an assistant's earlier calls, and the example the model is shown."""
    if fmt == "llama3":
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)
    if fmt == "mistral":
        return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)
    if fmt == "pythonic":
        def call(name: str, args: Any) -> str:
            items = args.items() if isinstance(args, dict) else []
            return f"{name}(" + ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in items) + ")"
        return "[" + ", ".join(call(n, a) for n, a in calls) + "]"
    return "\n".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + "\n</tool_call>"
                     for n, a in calls)
