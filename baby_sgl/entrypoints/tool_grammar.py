"""Grammars that make tool calls valid by construction, and that leave a model's thinking free.

A forced call (tool_choice `required` or a named function) and the calls to `strict` tools are
written in the tool call parser's own format with each function's JSON schema for its
arguments, as a Lark grammar for the grammar backend (SGLang's way of passing one: an `ebnf`
constraint that starts with `%llguidance {}`). So even a model never trained for tools returns a
call the parser reads and that matches the schema. With a reasoning parser, the grammar first
lets the model think: `<think>` (or nothing, when the prompt opened the block) and any text up to
the first `</think>`; a json_schema constraint is wrapped the same way, so it holds for the answer.
Parallel calls are bounded (MAX_PARALLEL_TOOL_CALLS): a model that never stops calling ends there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from baby_sgl.constrained.grammar import closed_objects

LARK_HEADER = "%llguidance {}\n"
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
MAX_PARALLEL_TOOL_CALLS = 16  # calls in one answer, when parallel


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON schema of the arguments
    strict: bool = False


def _lit(text: str) -> str:
    return json.dumps(text)  # a Lark string literal


def _json_rule(name: str, schema: Any) -> str:
    if isinstance(schema, dict):
        schema = closed_objects(schema) | {"x-guidance": {"whitespace_flexible": False}}
    return f"{name}: %json {json.dumps(schema)}"


def _think_prefix(rules: list[str], reasoning: str | None) -> str:
    """The rule before the answer: `think?` when the model may open a block, `think` when the
    prompt opened it; "" without a reasoning parser."""
    if reasoning is None:
        return ""
    if reasoning == "open":
        rules.append(r"THINK: /(?s:.*)<\/think>/ & ~/(?s:.*)<\/think>(?s:.+)/")
        rules.append(r"think: THINK /\n*/")
        return "think "
    rules.append(r"THINK: /<think>(?s:.*)<\/think>/ & ~/<think>(?s:.*)<\/think>(?s:.+)/")
    rules.append(r"think: THINK /\n*/")
    return "think? "


def json_after_thinking(schema_text: str, reasoning: str) -> str:
    """A json_schema constraint that applies after the thinking. reasoning: "open" (the output
    starts inside the block) or "may" (the model may open one)."""
    try:
        schema = json.loads(schema_text)
        rules: list[str] = []
        think = _think_prefix(rules, reasoning)
        rules.append("start: " + think + "answer")
        rules.append(_json_rule("answer", schema if schema is not True else {}))
    except json.JSONDecodeError as e:
        raise ValueError(f"json_schema is not valid JSON: {e}") from None
    except RecursionError:  # the decoder or _json_rule recurses per level: a 400, not a 500
        raise ValueError("json_schema is nested too deeply") from None
    return LARK_HEADER + "\n".join(rules) + "\n"


def _pythonic_any_kwargs(rules: list[str], i: int) -> str:
    """f(...)'s keyword arguments, any names and JSON values."""
    rules.append(f"kwv{i}: %json {{}}")
    item = f'/[A-Za-z_][A-Za-z0-9_]*/ "=" kwv{i}'
    rules.append(f'kwany{i}: "" | {item} (", " {item})*')
    return f"kwany{i}"


def _pythonic_kwargs(rules: list[str], i: int, schema: dict[str, Any]) -> str:
    """f(...)'s keyword arguments in the schema's order, each required one present."""
    props: dict[str, Any] = schema["properties"] if isinstance(schema.get("properties"), dict) else {}
    required = set(schema.get("required") or [])
    names = list(props)
    for j, name in enumerate(names):
        if not name.isidentifier():
            raise ValueError(f"pythonic tool calls need argument names that are Python identifiers, got {name!r}")
        rules.append(_json_rule(f"a{i}_{j}", props[name]))
    # kw{i}_{j}_{first}: the arguments from the j-th on; first: none written yet (no comma)
    for j in range(len(names), -1, -1):
        for first in (0, 1):
            if j == len(names):
                body = '""'
            else:
                item = ("" if first else '", " ') + f'"{names[j]}=" a{i}_{j} kw{i}_{j + 1}_0'
                body = item if names[j] in required else f"{item} | kw{i}_{j + 1}_{first}"
            rules.append(f"kw{i}_{j}_{first}: {body}")
    return f"kw{i}_0_1"


def tool_grammar(fmt: str, tools: list[Tool], forced: bool, parallel: bool, reasoning: str | None) -> str:
    """A Lark grammar for the output: forced, one call (several when parallel) to one of tools,
    each to its schema; not forced, free text (without the format's call markup) or calls, the
    strict tools' arguments to their schemas and the others' any object."""
    rules: list[str] = []
    think = _think_prefix(rules, reasoning)
    alternatives = []
    for i, tool in enumerate(tools):
        constrained = forced or tool.strict
        schema = tool.parameters if constrained else _ANY_OBJECT
        name = tool.name
        if fmt == "pythonic":
            if not name.replace(".", "_").isidentifier():
                raise ValueError(f"pythonic tool calls need function names that are Python identifiers, got {name!r}")
            kwargs = _pythonic_kwargs(rules, i, schema) if constrained else _pythonic_any_kwargs(rules, i)
            alternatives.append(f"{_lit(name + '(')} {kwargs} \")\"")
            continue
        rules.append(_json_rule(f"args{i}", schema))
        key = "parameters" if fmt == "llama3" else "arguments"
        alternatives.append(f'{_lit(json.dumps({"name": name})[:-1] + f", {json.dumps(key)}: ")} args{i} "}}"')
    rules.append("call: " + " | ".join(alternatives))
    # the format: (the call list's opening, separator, closing); qwen25 wraps each call instead
    repeat = f"{{0,{MAX_PARALLEL_TOOL_CALLS - 1}}}"  # the calls after the first
    if fmt in ("qwen25", "qwen", "hermes"):
        rules.append(r'unit: "<tool_call>\n" call "\n</tool_call>"')
        rules.append("calls: unit" + (r' ("\n" unit)' + repeat if parallel else ""))
        marker: str | None = "<tool_call>"
        rest = r'"\n" call "\n</tool_call>"' + (r' ("\n" unit)' + repeat if parallel else "")
    else:
        opening, sep, closing = {"llama3": ("", "; ", ""), "mistral": ("[TOOL_CALLS][", ", ", "]"),
                                 "pythonic": ("[", ", ", "]")}[fmt]
        more = f" ({_lit(sep)} call){repeat}" if parallel else ""
        rules.append("calls: " + (f"{_lit(opening)} " if opening else "") + "call" + more + (f" {_lit(closing)}"
                                                                                         if closing else ""))
        marker = "[TOOL_CALLS]" if fmt == "mistral" else None
        rest = '"[" call' + more + ' "]"'
    if forced:
        rules.append("start: " + think + "calls")
    elif marker is not None:  # any text without the marker, or text up to it and the calls
        m = json.dumps(marker)[1:-1].replace("/", r"\/").replace("[", r"\[").replace("]", r"\]").replace("|", r"\|")
        rules.append(f"TEXT: /(?s:.*)/ & ~/(?s:.*){m}(?s:.*)/")
        rules.append(f"LEAD: /(?s:.*){m}/ & ~/(?s:.*){m}(?s:.+)/")
        rules.append(f"start: {think}(TEXT | LEAD {rest})")
    else:  # the calls are the whole output: text is what does not start as they do
        opening_char = {"llama3": "{", "pythonic": "["}[fmt]
        rules.append(rf"TEXT: /(?s:.*)/ & ~/\s*\{opening_char}(?s:.*)/")
        rules.append(f"start: {think}(TEXT | calls)")
    return LARK_HEADER + "\n".join(rules) + "\n"
