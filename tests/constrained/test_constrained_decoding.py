"""Constrained decoding through the public Engine: every output of a regex, JSON schema or EBNF
request matches its constraint, under every cache and scheduling setting, greedy and sampled;
bad grammars fail their own request only.

The tiny model is random, so the constraints generated here are bounded (every repeat has an
upper bound, objects take no extra keys): the grammar itself then ends every output, and each
one can be checked whole with re.fullmatch or jsonschema."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baby_sgl import Engine
from helpers import CONFIGS, random_prompts

MAX_NEW = 96  # more than any generated constraint's longest output (one token per byte here)

# ---- bounded regexes, in the subset Python's re and the grammar library read alike -----------
_ATOMS = st.one_of(
    st.sampled_from(list("abcxyz019-_ ")),
    st.sampled_from(["[a-c]", "[0-9]", "[A-Z]", "[xyz]", r"\.", "[^\n]"]),
)


@st.composite
def _regex(draw, depth: int = 0) -> str:
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["atom", "atom", "repeat", "alt"] if depth < 2 else ["atom", "repeat"]))
        if kind == "atom":
            parts.append(draw(_ATOMS))
        elif kind == "repeat":
            lo = draw(st.integers(0, 2))
            parts.append(f"{draw(_ATOMS)}{{{lo},{lo + draw(st.integers(0, 3))}}}")
        else:
            options = draw(st.lists(_regex(depth + 1), min_size=2, max_size=3))
            parts.append("(" + "|".join(options) + ")")
    return "".join(parts)


# ---- bounded JSON schemas ------------------------------------------------------------------
_LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.integers(-50, 50).map(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 100}),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.one_of(st.text("abc", max_size=3), st.integers(0, 9)), min_size=1, max_size=3, unique=True)
    .map(lambda xs: {"enum": xs}),
)


@st.composite
def _schema(draw, depth: int = 0) -> dict:
    if depth >= 2 or draw(st.booleans()):
        leaf = draw(_LEAVES)
        if draw(st.integers(0, 4)) == 0:
            return {"type": "array", "items": leaf, "maxItems": draw(st.integers(0, 3))}
        return leaf
    names = draw(st.lists(st.sampled_from(["id", "name", "ok", "tags", "kind", "n"]), min_size=1, max_size=3,
                          unique=True))
    props = {name: draw(_schema(depth + 1)) for name in names}
    required = [n for n in names if draw(st.booleans())]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _check(text: str, kind: str, spec) -> None:
    if kind == "regex":
        assert re.fullmatch(spec, text), f"{text!r} does not match {spec!r}"
    else:
        jsonschema.validate(json.loads(text), spec)


def _params(kind: str, spec, greedy: bool, seed: int) -> dict:
    constraint = {"regex": spec} if kind == "regex" else {"json_schema": json.dumps(spec)}
    sampling = {"temperature": 0} if greedy else {"temperature": 1.0, "top_p": 0.95, "seed": seed}
    return {**constraint, **sampling, "max_new_tokens": MAX_NEW}


def _assert_closed(out: dict) -> None:
    """The grammar, not the length limit, ended the output."""
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]["finish_reason"]


_HYPOTHESIS = settings(max_examples=12, deadline=None, derandomize=True,
                       suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@_HYPOTHESIS
@given(regexes=st.lists(_regex(), min_size=2, max_size=4), greedy=st.booleans())
def test_regex_outputs_match(engine, regexes, greedy):
    prompts = random_prompts(len(regexes), 259, 3, 20, seed=len(regexes))
    outs = engine.generate(input_ids=prompts, sampling_params=[_params("regex", r, greedy, i)
                                                               for i, r in enumerate(regexes)])
    for regex, out in zip(regexes, outs):
        _assert_closed(out)
        _check(out["text"], "regex", regex)


@_HYPOTHESIS
@given(schemas=st.lists(_schema(), min_size=2, max_size=4), greedy=st.booleans())
def test_json_schema_outputs_validate(engine, schemas, greedy):
    prompts = random_prompts(len(schemas), 259, 3, 20, seed=len(schemas) + 7)
    outs = engine.generate(input_ids=prompts, sampling_params=[_params("json", s, greedy, i)
                                                               for i, s in enumerate(schemas)])
    for schema, out in zip(schemas, outs):
        _assert_closed(out)
        _check(out["text"], "json", schema)


# One fixed mix of constraints, run under every cache and scheduling setting.
_MIX = [
    ("regex", r"(yes|no|maybe)"),
    ("regex", r"[0-9]{3}-[0-9]{2,4}"),
    ("regex", r"[a-z]{1,8}@[a-z]{2,5}\.(com|org)"),
    ("json", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "maxItems": 2}},
              "required": ["name", "age"], "additionalProperties": False}),
    ("json", {"enum": ["red", "green", "blue"]}),
]
_SETTINGS = ["radix", "no-radix", "page16", "chunked", "retract", "mixed-chunk-retract"]


@pytest.fixture(scope="module")
def mix_results(tiny_llama):
    """Greedy and sampled outputs of the mix (3 copies, prompts long enough to chunk and, with the
    small pools, to force retraction) under each setting."""
    prompts = random_prompts(len(_MIX) * 3, 259, 30, 60, seed=11)
    results = {}
    for name in _SETTINGS:
        with Engine(tiny_llama, dtype="float32", **CONFIGS[name]) as engine:
            for greedy in (True, False):
                params = [_params(kind, spec, greedy, i) for i, (kind, spec) in enumerate(_MIX * 3)]
                results[name, greedy] = engine.generate(input_ids=prompts, sampling_params=params)
            results[name, "stats"] = engine.get_server_info()
            engine.check_memory()
    return results


@pytest.mark.parametrize("name", _SETTINGS)
def test_every_setting_keeps_the_constraints(mix_results, name):
    for greedy in (True, False):
        for (kind, spec), out in zip(_MIX * 3, mix_results[name, greedy]):
            _assert_closed(out)
            _check(out["text"], kind, spec)


def test_settings_give_identical_constrained_outputs(mix_results):
    """The mask depends only on the output so far, so greedy ids are the same under every
    setting, retraction and chunked prefill included (the matcher is neither reset nor replayed)."""
    base = [o["output_ids"] for o in mix_results["radix", True]]
    for name in _SETTINGS:
        assert [o["output_ids"] for o in mix_results[name, True]] == base, name
        # Seeded sampling draws per request, so it does not depend on the setting either.
        assert [o["output_ids"] for o in mix_results[name, False]] == [o["output_ids"] for o in
                                                                        mix_results["radix", False]], name


def test_retraction_really_happened(mix_results):
    assert mix_results["retract", "stats"]["num_retractions"] > 0
    assert mix_results["mixed-chunk-retract", "stats"]["mixed_steps"] > 0


def test_ebnf(engine):
    grammar = 'root ::= "SELECT " col ("," col)? " FROM " tbl ";"\ncol ::= [a-c]{1,3}\ntbl ::= "t" [0-9]'
    outs = engine.generate(["q1", "q2", "q3"], [{"ebnf": grammar, "temperature": 1.0, "seed": s, "max_new_tokens": 64}
                                                for s in range(3)])
    for out in outs:
        _assert_closed(out)
        assert re.fullmatch(r"SELECT [a-c]{1,3}(,[a-c]{1,3})? FROM t[0-9];", out["text"]), out["text"]


@pytest.mark.parametrize("params, error", [
    ({"regex": "(("}, "invalid regex"),
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"json_schema": '{"type": "nonsense"}'}, "invalid json_schema"),
    ({"ebnf": "root ::= undefined_rule"}, "invalid ebnf"),
    ({"regex": "a", "json_schema": "{}"}, "at most one of json_schema, regex, ebnf"),
])
def test_bad_grammar_fails_its_request_only(engine, params, error):
    with pytest.raises(ValueError, match=error):
        engine.generate("x", params)
    outs = engine.generate(["ok", "bad"], [{"regex": "(a|b)", "max_new_tokens": 8}, params])
    assert re.fullmatch("(a|b)", outs[0]["text"]) and error in outs[1]["error"]


def test_grammar_cache_compiles_once(engine):
    regex = r"cache-[0-9]{2}"
    first = engine.grammars.get(("regex", regex))
    engine.generate(["a", "b"], {"regex": regex, "max_new_tokens": 16})
    assert engine.grammars.get(("regex", regex)) is first


def test_no_grammar_backend_refuses_constraints(tiny_llama):
    with Engine(tiny_llama, dtype="float32", grammar_backend="none") as engine:
        with pytest.raises(ValueError, match="--grammar-backend none"):
            engine.generate("x", {"regex": "a"})
        assert engine.generate("x", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_stop_regex(engine):
    out = engine.generate("s", {"regex": "ab[0-9]{6}", "stop_regex": [r"[0-9]{2}"], "max_new_tokens": 32})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "[0-9]{2}"}
    assert out["text"].startswith("ab") and re.search("[0-9]{2}", out["text"]) and len(out["text"]) == 4


def test_logit_bias_and_constraint(engine):
    """The mask comes before logit_bias (as SGLang): a bias cannot revive a forbidden token, and
    among the allowed ones it decides."""
    b = engine.tokenizer.convert_tokens_to_ids("b")
    z = engine.tokenizer.convert_tokens_to_ids("z")
    out = engine.generate("x", {"regex": "(a|b)", "logit_bias": {str(b): 100.0, str(z): 100.0}, "temperature": 0})
    assert out["text"] == "b"


def test_objects_take_only_their_properties(engine):
    """As SGLang (xgrammar's strict mode): listed properties and no others, unless the schema
    allows others; a property named like a keyword is just a name."""
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {"enum": [1]}}},
                                               "b": {"type": "boolean"}}}
    b = engine.tokenizer.convert_tokens_to_ids('"')
    for seed in range(6):  # a favoured quote opens keys wherever one may start
        out = engine.generate("o", {"json_schema": json.dumps(schema), "temperature": 1.0, "seed": seed,
                                    "max_new_tokens": 96, "logit_bias": {str(b): 3.0}})
        _assert_closed(out)
        value = json.loads(out["text"])
        assert set(value) <= {"properties", "b"} and set(value.get("properties", {})) <= {"x"}


def test_stop_regex_cannot_backtrack_for_ever(engine):
    """A pattern that makes a backtracking matcher take exponential time is matched in linear
    time (RE2); lookaround, which RE2 lacks, is refused by name."""
    out = engine.generate("b", {"regex": "a{60}", "stop_regex": r"(a|aa)*c$", "max_new_tokens": 80})
    assert out["text"] == "a" * 60 and out["meta_info"]["finish_reason"]["matched"] != r"(a|aa)*c$"
    with pytest.raises(ValueError, match="invalid stop_regex.*no lookaround"):
        engine.generate("x", {"stop_regex": "(?=a)b"})


def test_a_constraint_after_unconstrained_rows_of_a_batch(engine):
    """Constrained rows between unconstrained ones in one batch: each mask on its own row (the
    free rows give their outputs alone, the constrained ones match their patterns)."""
    free = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    alone = engine.generate("free", free)["output_ids"]
    outs = engine.generate(["free", "q", "free", "r"],
                           [free, {"regex": "[0-9]{3}", "temperature": 0}, free,
                            {"regex": "(yes|no)", "temperature": 0}])
    assert outs[0]["output_ids"] == alone and outs[2]["output_ids"] == alone
    assert re.fullmatch("[0-9]{3}", outs[1]["text"]) and re.fullmatch("(yes|no)", outs[3]["text"])
