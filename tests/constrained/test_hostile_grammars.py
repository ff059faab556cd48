"""Constraints a hostile client might send: each ends its own request with a clear message, or
works; the engine keeps serving and loses nothing."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from baby_sgl.constrained import grammar as grammar_module
from baby_sgl.core.sampling_params import MAX_GBNF_CHARS


def test_a_long_ref_chain_compiles_on_a_deep_stack(engine):
    """A chain of 1000 $refs made the grammar library overflow an ordinary 8 MB thread stack
    (a segfault that took the server down); compile threads have room for any grammar the size
    limits admit, and the request is served under it."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
            for i in range(1000)}
    schema = {"$defs": defs | {"d1000": {"type": "integer", "minimum": 0, "maximum": 9}}, "$ref": "#/$defs/d0"}
    out = engine.generate("deep", {"json_schema": json.dumps(schema), "max_new_tokens": 4})
    assert out["meta_info"]["finish_reason"]["type"] == "length" and out["text"].startswith('{"x"')
    assert engine.generate("ok", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_a_regex_the_library_refuses_fails_at_submission(engine):
    """15000 alternatives and an unclosed group: refused when the request is made, with the
    library's reason cut short."""
    regex = "|".join(f"w{i:05d}" for i in range(15000)) + "("
    with pytest.raises(ValueError, match="^invalid regex") as err:
        engine.generate("x", {"regex": regex, "max_new_tokens": 4})
    assert len(str(err.value)) < 600


def test_size_limits_name_the_kind(engine):
    with pytest.raises(ValueError, match="ebnf is 40000 characters, more than the 32768 allowed"):
        engine.generate("x", {"ebnf": 'root ::= "a"' + " " * (40000 - 12)})


def _gbnf_chain(chars: int) -> str:
    """The worst case for converting GBNF to Lark (quadratic in a chain of rules): `root ::= r0`,
    `r0 ::= "0" r1`, ... each rule with its own literal, padded with blanks to exactly `chars`."""
    lines = ["root ::= r0"]
    while sum(map(len, lines)) + 2 * len(lines) + 20 < chars:
        i = len(lines) - 1
        lines.append(f'r{i} ::= "{i}" r{i + 1}')
    lines.append(f'r{len(lines) - 1} ::= "."')
    return "\n".join(lines).ljust(chars)


def test_a_gbnf_grammar_past_its_limit_is_refused_before_conversion(engine):
    """A 32 KiB chain of rules took ~1 s (13 s for the worst shape) to convert in pure Python,
    holding the GIL, and was accepted: GBNF (not Lark) is refused past MAX_GBNF_CHARS, by name."""
    within = _gbnf_chain(MAX_GBNF_CHARS)
    out = engine.generate("x", {"ebnf": within, "max_new_tokens": 4})
    assert out["meta_info"]["finish_reason"]["type"] == "length" and out["text"] == "0123"[:len(out["text"])]
    with pytest.raises(ValueError, match=f"ebnf in GBNF syntax is {MAX_GBNF_CHARS + 1} characters, more than the "
                                         f"{MAX_GBNF_CHARS} allowed .* in Lark syntax .* up to 32768$"):
        engine.generate("x", {"ebnf": _gbnf_chain(MAX_GBNF_CHARS + 1)})
    # The same size and more in Lark syntax is parsed by the library as it is, and served.
    lark = 'start: "a" x\nx: "b"\n'.ljust(4 * MAX_GBNF_CHARS)
    assert engine.generate("x", {"ebnf": lark, "max_new_tokens": 4})["text"] == "ab"


def test_telling_gbnf_from_lark_is_linear(engine):
    """llguidance's own test for Lark syntax backtracked over blank lines: 30000 newlines after a
    GBNF rule took ~10 s (holding the GIL) before the conversion even began."""
    start = time.perf_counter()
    with pytest.raises(ValueError, match="ebnf in GBNF syntax is 30012 characters"):
        engine.generate("x", {"ebnf": 'root ::= "a"' + "\n" * 30000})
    assert time.perf_counter() - start < 2
    assert grammar_module.is_lark("\n" * 30000 + ' \t start : "a"') and not grammar_module.is_lark(" x start: a")


def test_no_token_left_ends_the_request_with_a_clear_reason(engine):
    """The grammar allows only "1", which is also a stop token that min_new_tokens holds back."""
    one = engine.tokenizer.convert_tokens_to_ids("1")
    out = engine.generate("c", {"regex": "1", "stop_token_ids": [one], "min_new_tokens": 3, "max_new_tokens": 5})
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "cannot continue under its constraint" in reason["message"]
    assert "internal error" not in reason["message"] and engine.get_server_info()["num_failed_reqs"] == 0


def test_forbidden_tokens_have_a_finite_logprob(engine, tiny_llama):
    out = engine.generate("n", {"regex": "[0-9]", "temperature": 0}, return_logprob=True, top_logprobs_num=20,
                          token_ids_logprob=[5, 100])
    values = [v for row in out["meta_info"]["output_top_logprobs"] for v, _, _ in row]
    values += [v for row in out["meta_info"]["output_token_ids_logprobs"] for v, _, _ in row]
    assert all(math.isfinite(v) for v in values) and min(values) == -9999.0  # OpenAI's floor


def test_logit_bias_is_bounded(engine):
    with pytest.raises(ValueError, match="logit_bias"):
        engine.generate("x", {"logit_bias": {"5": 1e39}})
    with pytest.raises(ValueError, match="logit_bias keys are token ids"):
        engine.generate("x", {"logit_bias": {"٣": 1.0}})


def test_cache_is_bounded_by_text(engine, monkeypatch):
    monkeypatch.setattr(grammar_module, "_CACHE_TEXT_BUDGET", 30)
    engine.grammars.clear()
    for i in range(5):
        engine.grammars.get(("regex", f"cache-bound-{i}-[0-9]{{3}}"))  # 21 characters each
    assert len(engine.grammars) == 1


def test_json_schema_true_and_false(engine):
    assert engine.generate("t", {"json_schema": "true", "max_new_tokens": 8})["meta_info"]["completion_tokens"] >= 1
    with pytest.raises(ValueError, match="false allows no value"):
        engine.generate("t", {"json_schema": "false"})


@pytest.mark.parametrize("schema", [{"$ref": "#"}, {"anyOf": [{"$ref": "#"}]},
                                    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                     "$ref": "#/$defs/a"}], ids=["self", "anyOf", "two-defs"])
def test_a_schema_that_only_refers_to_itself_is_refused_in_plain_words(engine, schema):
    """A $ref cycle that never says what a value is: the library's own name for it
    ("NoExtensionBias") told a client nothing; the refusal now says what is wrong, and where."""
    with pytest.raises(ValueError, match=r"^invalid json_schema: the JSON schema at # only leads back to itself"):
        engine.generate("x", {"json_schema": json.dumps(schema), "max_new_tokens": 4})
    assert engine.generate("ok", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


# Grammars the library's mask computation never returned from (a compile thread, or the scheduler
# thread once the output reached the part, at 100% CPU for good): a rule or schema that never
# produces anything, after a regex lexeme.
LOOPING = [
    ("start: /\\n*/ a\n" 'a: a "y"\n', "rule 'a' never produces any text"),
    ('start: "x" /\\n+/ a\n' 'a: b "y"\n' "b: a\n", "rules 'a', 'b' never produce any text"),
    ("start: /\\n*/ j\n" 'j: %json {"$ref": "#"}\n', "the JSON schema at # only leads back to itself"),
    ('start: "x" /\\n*/ j\n' 'j: %json {"anyOf": [{"$ref": "#"}]}\n', "the JSON schema at # only leads back"),
    ("start: /\n*/ a\n" 'a: a "y"\n', "rule 'a' never produces any text"),  # a newline in the regex itself
    ('start: "x" /\\n+/ /[^\\s\\S]/\n', "the regex /[^\\s\\S]/ matches no text"),
    ('start: "x" /\\n+/ T\n' "T: /a/ & /b/\n", "this server reads Lark grammars to check them, and could not read this "
                                             "one (token T combines regexes with & or ~)"),
    # regexes whose emptiness only the library's own syntax shows: asked of the library, each alone
    ('start: "q" | "x" /\\n+/ /\\P{Any}/\n', "the regex /\\P{Any}/ matches no text"),
    ('start: "x" /\\n+/ /[[^\\s\\S]]/\n', "the regex /[[^\\s\\S]]/ matches no text"),
    ('start: "x" /\\n+/ /[^[:ascii:][:^ascii:]]/\n', "the regex /[^[:ascii:][:^ascii:]]/ matches no text"),
    ('start: "x" /\\n+/ /[^\\s\\S]#|a/x\n', "the regex /(?x)[^\\s\\S]#|a/ matches no text"),
    ('start: "x" /\\n+/ /[^\\d\\P{Nd}]/\n', "the regex /[^\\d\\P{Nd}]/ matches no text"),
]


def test_grammars_the_library_would_loop_on_are_refused_first(tiny_llama):
    """Checked in a child process with a time limit, so that a regression fails instead of hanging
    the suite: each grammar is refused at compile time, naming the part that produces nothing."""
    script = (
        "import json, sys\n"
        "from transformers import AutoTokenizer\n"
        "from baby_sgl.constrained.grammar import GrammarCache\n"
        "tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "cache = GrammarCache('llguidance', tokenizer, len(tokenizer), [tokenizer.eos_token_id])\n"
        "for grammar in json.loads(sys.argv[2]):\n"
        "    try:\n"
        "        cache.get(('ebnf', grammar))\n"
        "        print('compiled', flush=True)\n"
        "    except ValueError as e:\n"
        "        print(str(e).replace('\\n', ' '), flush=True)\n"
    )
    grammars = ["%llguidance {}\n" + grammar for grammar, _ in LOOPING]
    done = subprocess.run([sys.executable, "-c", script, tiny_llama, json.dumps(grammars)],
                          capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert len(lines) == len(LOOPING), (done.stdout, done.stderr[-2000:])
    for line, (_, reason) in zip(lines, LOOPING):
        assert line.startswith("invalid ebnf: " + reason), line
