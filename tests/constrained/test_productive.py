"""The check that every reachable part of a grammar can produce something (constrained/productive.py),
which keeps grammars the library would loop on from reaching it: what it refuses, what it lets
through (every grammar the server builds itself included), and that it reads large grammars in
linear time."""

from __future__ import annotations

import json
import time

import pytest
from llguidance.gbnf_to_lark import gbnf_to_lark

from baby_sgl.constrained.grammar import GrammarCache
from baby_sgl.constrained.productive import lark_fault, schema_fault
from baby_sgl.entrypoints.tool_grammar import Tool, json_after_thinking, tool_grammar

HEADER = "%llguidance {}\n"
NEVER = "never produce"


@pytest.fixture(scope="module")
def empty(tiny_llama):
    """Whether a regex matches no text, as the server asks it: of the library, on the tiny model's vocabulary."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    return GrammarCache("llguidance", tokenizer, len(tokenizer), [tokenizer.eos_token_id])._regex_is_empty


@pytest.mark.parametrize("grammar, fault", [
    ('start: "x" a\na: a "y"\n', "rule 'a' never produces any text"),
    ('start: "x" a?\na: b\nb: a\n', "rules 'a', 'b' never produce any text"),
    ('start: "x" (a | "q")\na: b "c"\nb: a\n', "rules 'a', 'b' never produce"),
    ('start: "x" a*\na: "q" a\n', "rule 'a' never produces"),  # optional where used, broken all the same
    ("start: a\na: a\n", "rule 'a' never produces"),
    ('start: "x" | b\nb: "y" b\n', "rule 'b' never produces"),  # beside an alternative that produces
    ('start: "x" j\nj: %json {"$ref": "#"}\n', "the JSON schema at # only leads back to itself"),
    ('start: "x" /\\n+/ a\na.2[lazy]: a "y"\n', "rule 'a' never produces"),  # a priority and attributes
    ('start: "x" /\\n+/ /[^\\s\\S]/\n', "the regex /[^\\s\\S]/ matches no text"),
    ('start: "x" T\nT: "q" U\nU: /[^\\x00-\\U0010ffff]+/\n', "the regex /[^\\x00-\\U0010ffff]+/ matches no text"),
    ('start: "x" T\nT: /[0-9]/ & /[a-z]/\n', "this server reads Lark grammars to check them, and could not read "
                                               "this one (token T combines regexes with & or ~)"),
])
def test_what_never_produces_text_is_named(grammar, fault, empty):
    assert (lark_fault(HEADER + grammar, empty) or "").startswith(fault)


@pytest.mark.parametrize("grammar", [
    'start: "x" a\na: a "y" | "z"\n',  # left recursion with a way out
    'start: "x" a\na: "q" a | "r"\nunused: unused\n',  # a broken rule nothing reaches
    'start: a+ B\na: "q" | a "q"\nB: /[0-9]+/ "x" ~ 2\n',  # a token, read as a rule
    'start: "x" a{0,3} b~2..4\na: "a" a?\nb: "b" // a comment\n%ignore /[ \\t]+/\n',  # repetitions
    'start: <|im_end|> "y"i /z/s "\\"q\\"" %regex {"substring_words": "a b"}\n',
])
def test_grammars_that_produce_text_pass(grammar, empty):
    assert lark_fault(HEADER + grammar, empty) is None


@pytest.mark.parametrize("schema, where", [
    ({"$ref": "#"}, "#"),
    ({"anyOf": [{"$ref": "#"}]}, "#"),
    ({"allOf": [{"type": "string"}, {"$ref": "#"}]}, "#"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"$ref": "#/$defs/x"}}},
     "#/properties/a"),
    ({"type": "array", "prefixItems": [{"oneOf": [{"$ref": "#/prefixItems/0"}]}]}, "#/prefixItems/0"),
])
def test_schemas_that_only_refer_to_themselves_are_named(schema, where):
    assert schema_fault(schema) == (
        f"the JSON schema at {where} only leads back to itself through $ref, anyOf, oneOf or allOf: it never "
        "describes a value")


@pytest.mark.parametrize("schema", [
    {"anyOf": [{"$ref": "#"}, {"type": "string"}]},
    {"type": "array", "items": {"$ref": "#"}},  # recursion through a value: finite values exist
    {"type": "string", "$defs": {"x": {"$ref": "#/$defs/x"}}},  # a broken definition nothing uses
    {"enum": [{"$ref": "#"}]},  # data, not a schema
    True,
])
def test_schemas_that_describe_values_pass(schema):
    assert schema_fault(schema) is None


def test_a_ref_the_check_cannot_follow_is_refused():
    for ref in ("https://example.com/schema.json", "#/$defs/missing"):
        assert schema_fault({"$ref": ref}) == (
            f"the JSON schema's $ref {ref!r} names no part of the schema (only local references are followed)")


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}


@pytest.mark.parametrize("fmt", ["qwen25", "llama3", "mistral", "pythonic"])
@pytest.mark.parametrize("reasoning", [None, "open", "may"])
@pytest.mark.parametrize("forced", [True, False])
def test_the_servers_own_grammars_are_read_and_pass(fmt, reasoning, forced, empty):
    tools = [Tool("get_weather", None, WEATHER, True), Tool("now", None, {"type": "object", "properties": {}})]
    assert lark_fault(tool_grammar(fmt, tools, forced, True, reasoning), empty, combined_tokens=True) is None
    looping = Tool("loop", None, {"type": "object", "properties": {"x": {"$ref": "#/$defs/y"}}, "required": ["x"],
                                  "$defs": {"y": {"anyOf": [{"$ref": "#/$defs/y"}]}}}, True)
    fault = lark_fault(tool_grammar(fmt, [looping], forced, True, reasoning), empty, combined_tokens=True)
    if fmt != "pythonic":  # the JSON formats embed the whole schema; pythonic each argument's, without $defs
        assert fault is not None and "only leads back to itself" in fault
    if reasoning is not None:
        thinking = json_after_thinking(json.dumps(WEATHER), reasoning)
        assert lark_fault(thinking, empty, combined_tokens=True) is None
        assert "combines regexes" in (lark_fault(thinking, empty) or "")  # not from a client
        looping_json = json_after_thinking('{"$ref": "#"}', reasoning)
        assert "only leads back" in (lark_fault(looping_json, empty, combined_tokens=True) or "")


def test_converted_gbnf_is_read(empty):
    lark = gbnf_to_lark('root ::= "a" item* [0-9]+ (x | "q")?\nitem ::= "b" | "c"{2,3} | item "d"\nx ::= "z" x?\n')
    assert lark_fault(lark, empty) is None
    assert NEVER in (lark_fault(gbnf_to_lark('root ::= "a" x\nx ::= x "z"\n'), empty) or "")


@pytest.mark.parametrize("pattern, nothing", [
    (r"[^\s\S]", True), (r"[^\d\D]+", True), (r"(?:[^\w\W]|[^\x00-\x{10FFFF}])", True), (r"a[^\s\S]", True),
    (r"\P{Any}", True), (r"[[^\s\S]]", True), (r"[^[:ascii:][:^ascii:]]", True), (r"(?x)[^\s\S]#|a", True),
    (r"[a&&b]", True), (r"[^\d\P{Nd}]", True),
    (r"[^a]", False), (r"\n*", False), (r"x[^\w\W]?", False), (r"(?:[^\s\S]|b)", False), (r"a{0}|[^\s\S]", False),
    (r"--[a-z]+", False), (r"\p{L}+[^\p{L}]", False), (r"(?<y>[0-9]+)", False), (r"abc(?i)def", False),
])
def test_a_regex_that_matches_nothing_is_told_apart(empty, pattern, nothing):
    """The library's own reading of each regex alone (Rust's syntax: classes intersected, nested,
    POSIX, Unicode, comments under the x flag)."""
    assert empty(pattern) is nothing


# Found by an adversarial search: each passed an earlier version of the check, and each made the
# library spin (in the compile, or in the scheduler thread where it sat behind a choice).
BYPASSES = [
    'aB\na: a "y"\nB: "z"\n',  # the library reads `aB` as rule a, then token B
    '_j\n_j: %json {"$ref": "#"}\n',  # a rule named with a leading underscore
    "/[a&&b]/\n", "/[\\p{L}&&\\P{L}]/\n", "/[^\\x00-\\x{10FFFF}]/\n",  # the library's regex syntax
    "<[^0-49151]>\n",  # every token excluded
    'a\na[suffix=/[^\\s\\S]/]: /y/\n', 'a\na[stop=/[^\\s\\S]/]: /y/\n',  # an attribute's regex
    'j\nj: %json {"$ref": ""}\n',  # every way a $ref names its own schema
    'j\nj: %json {"$ref": "#L", "$defs": {"L": {"$anchor": "L", "$ref": "#L"}}}\n',
    'j\nj: %json {"$ref": "urn:l", "$defs": {"L": {"$id": "urn:l", "$ref": "urn:l"}}}\n',
    'j\nj: %json {"$ref": "#/%24defs/L", "$defs": {"L": {"$ref": "#/%24defs/L"}}}\n',
    # a second search: what a directive's line hid, and a $ref read from a nested $id
    'a\n%import common.WS a: a "y"\n', 'T\n%import common.WS T: /a/ & /b/\n', 'a %if true a: a "y"\n',
    'a\n%ignore WS a: a "y"\n',
    'j\nj: %json {"$ref": "urn:b", "$defs": {"a": {"type": "string"}, "b": {"$id": "urn:b", "$ref": "#/$defs/a", '
    '"$defs": {"a": {"$ref": "#/$defs/a"}}}}}\n',
]


@pytest.mark.parametrize("tail", BYPASSES)
@pytest.mark.parametrize("head", ['start: "x" /\\n+/ ', 'start: "q" | "x" /\\n+/ '])
def test_what_got_past_an_earlier_check_is_refused(head, tail, empty):
    assert lark_fault(HEADER + head + tail, empty) is not None


@pytest.mark.parametrize("grammar", [
    'start: "a" # a comment\n', "start: my-rule\nmy-rule: \"q\"\n", 'start: LETTER+\nLETTER: "a".."z"\n',
    'start: a -> renamed\na: "q"\n', '?start: value\nvalue: "v"\n', "start: /--[a-z]+/ /[0-9]{4}-[0-9]{2}/\n",
    'start: MY-TOK\nMY-TOK: "a"\n', 'start: j\nj: %json\n  {"type": "string"}\n',
    'start: WORD (WS WORD)*\n%import common.WS\n%import common (WORD, NUMBER)\n%ignore WS\n',
])
def test_ordinary_lark_it_once_refused_passes(grammar, empty):
    assert lark_fault(HEADER + grammar, empty) is None


def test_what_cannot_be_read_is_refused(empty):
    fault = lark_fault(HEADER + 'start: "a" %lark { start: "b" }\n', empty)
    assert fault is not None and fault.startswith("this server reads Lark grammars to check them")
    deep = HEADER + "start: " + "(" * 20000 + '"a"' + ")" * 20000 + "\n"
    assert lark_fault(deep, empty) == "the grammar's groups or %json are nested too deeply to check"


def test_a_large_grammar_is_read_in_linear_time(empty):
    props = {f"p{i}": {"type": ["string", "integer"][i % 2]} for i in range(3000)}
    schema = {"type": "object", "properties": props}
    grammar = tool_grammar("pythonic", [Tool("f", None, schema, True)], True, False, None)
    chain = HEADER + "start: r0\n" + "".join(f'r{i}: "x" r{i + 1} | r{i + 1} "y"\n' for i in range(20000)) + 'r20000: "z"\n'
    for text in (grammar, chain):
        start = time.perf_counter()
        assert lark_fault(text, empty) is None
        assert time.perf_counter() - start < 5, len(text)
