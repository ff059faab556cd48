"""Per-request sampling parameters, with SGLang's names, validated by one model for the Engine
and the HTTP routes alike (see validation.py). Every field of SGLang's SamplingParams is
accepted; the few we do not implement only at their default (null), anything else is refused by
name (see `accept_defaults_only`)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Annotated, Any

import re2

from pydantic import Field, PrivateAttr, ValidationError, model_validator
from pydantic.json_schema import SkipJsonSchema

from baby_sgl.constrained.grammar import SERVER_EBNF, is_lark
from baby_sgl.validation import (INT64_MAX, INT64_MIN, MAX_N, MAX_STOP, MAX_STOP_LEN, Int32, NonNegInt32,
                                 StrictModel, Text, TokenId, accept_defaults_only, validate)

logger = logging.getLogger(__name__)

_EPS = 1e-6
StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_LEN)]
MAX_STOP_REGEX, MAX_STOP_REGEX_BYTES = 32, 256  # as SGLang
# Stops are looked for after every token in the last STOP_WINDOW characters only (the new text and
# what a match ending in it could have begun in before it), so what they cost a token does not grow
# with the output. A stop string is at most this long; a longer stop_regex match may be missed.
STOP_WINDOW = MAX_STOP_LEN
# RE2's memory for one stop_regex, its program and the DFA states it caches: a pattern too large
# for it is refused as it compiles, which this bounds (\p{L}{40}: 47,851 instructions, refused
# after 4.5 ms here against 38 ms to compile under 1 MiB; programs within MAX_STOP_REGEX_PROGRAM
# all fit). Patterns compile as a body is validated, on the event loop: a call's distinct
# patterns are bounded too (MAX_CALL_STOP_REGEX).
STOP_REGEX_MAX_MEM = 2**18
MAX_CALL_STOP_REGEX = 2 * MAX_STOP_REGEX
# What one request's stops cost at every token, all n samples together: characters of stop strings,
# and instructions of the stop_regex programs (an RE2 search costs up to its program's size a
# character when the pattern's DFA outgrows its memory: 8192 instructions x STOP_WINDOW ~ 6 ms).
MAX_STOP_CHARS = 2**16
MAX_STOP_REGEX_PROGRAM = 2**13
# Characters of a constraint. Compile time grows with size, so these are generous for real grammars
# (OpenAI's own schema limits are of this order) and keep one compile short.
MAX_GRAMMAR_CHARS = {"json_schema": 128 * 1024, "regex": 128 * 1024, "ebnf": 32 * 1024}
# An `ebnf` in GBNF syntax (not Lark) is converted by llguidance's gbnf_to_lark, in pure Python
# holding the GIL (the scheduler and event loop slow down meanwhile), quadratic in a chain of rules:
# `a::=""b` `b::=""c` ... took 0.07 s at 3 Ki, 0.11 s at 4 Ki, 0.6 s at 8 Ki, 13 s at 32 Ki. Far
# past real GBNF grammars (llama.cpp's are under 2 Ki); a larger one can be sent in Lark syntax.
MAX_GBNF_CHARS = 4 * 1024
# A grammar the server builds from what a client sent (its tools, or a json_schema to hold after the
# thinking: entrypoints/tool_grammar.py) writes each character of its source a bounded number of
# times, around a fixed part (the call format, the thinking): it may be this large, and no larger.
# The source is bounded by the request's own limits (the tools are in the prompt, which must fit
# the context), never by the client's ebnf limit, which the client did not use.
SERVER_GRAMMAR_BASE_CHARS = 4096
SERVER_GRAMMAR_CHARS_PER_SOURCE_CHAR = 32  # a pythonic call's argument `"a":{}` makes ~150 characters of rules
MAX_LOGIT_BIAS = 4096
Grammar = Annotated[Text, Field(min_length=1)]
LogitBias = Annotated[float, Field(ge=-100, le=100)]  # OpenAI's range
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")
# SGLang's fields we do not implement: accepted at these values only.
_DEFAULT_ONLY: dict[str, Any] = {"structural_tag": None, "custom_params": None, "beam_width": (None, 1), "watermark": None,
                 "choice": ([],)}


def check_grammar_chars(kind: str, text: str) -> None:
    """A client's own constraint of that kind within MAX_GRAMMAR_CHARS, and an ebnf in GBNF syntax
    within MAX_GBNF_CHARS; raises ValueError naming the limit."""
    if len(text) > MAX_GRAMMAR_CHARS[kind]:
        raise ValueError(f"{kind} is {len(text)} characters, more than the {MAX_GRAMMAR_CHARS[kind]} allowed")
    if kind == "ebnf" and len(text) > MAX_GBNF_CHARS and not is_lark(text):
        raise ValueError(f"ebnf in GBNF syntax is {len(text)} characters, more than the {MAX_GBNF_CHARS} allowed "
                         f"(its conversion is slow); in Lark syntax (a `start:` rule) up to "
                         f"{MAX_GRAMMAR_CHARS['ebnf']}")


@dataclass(frozen=True)
class ServerGrammar:
    """A Lark grammar (`ebnf`, `%llguidance`) this server built from source_chars characters of what
    the client sent as `source` (the field errors name). Bounded by its source's size (see
    SERVER_GRAMMAR_BASE_CHARS), not by MAX_GRAMMAR_CHARS, which bounds the client's own grammars."""

    ebnf: str
    source: str
    source_chars: int

    def __post_init__(self) -> None:
        limit = SERVER_GRAMMAR_BASE_CHARS + SERVER_GRAMMAR_CHARS_PER_SOURCE_CHAR * self.source_chars
        if len(self.ebnf) > limit:
            raise ValueError(f"the grammar built from {self.source} is {len(self.ebnf)} characters, more than the "
                             f"{limit} its {self.source_chars} characters allow")


def stop_regex_matcher(pattern: str) -> re2._Regexp:
    """stop_regex compiled by RE2, which matches in linear time: Python's `re` can backtrack for
    exponential time on a short hostile pattern, in the scheduler thread. RE2 has no lookaround or
    backreferences; such a pattern is refused, as is one whose program outgrows STOP_REGEX_MAX_MEM."""
    compiled = _compile_stop_regex(pattern)
    if isinstance(compiled, str):
        raise ValueError(compiled)
    return compiled


@functools.lru_cache(maxsize=256)
def _compile_stop_regex(pattern: str) -> re2._Regexp | str:
    """The pattern compiled, or why it is refused: refusals are kept too, since a refused pattern
    can take milliseconds to fail, holding the interpreter all along, and a client sending it again
    and again would take that time from the scheduler's thread each time."""
    options = re2.Options()
    options.log_errors = False
    options.max_mem = STOP_REGEX_MAX_MEM
    try:
        return re2.compile(pattern, options)
    except re2.error as e:
        reason = e.args[0].decode() if e.args and isinstance(e.args[0], bytes) else str(e)
        if "too large" in reason:
            return f"stop_regex {pattern[:40]!r} is too large: its RE2 program outgrows {STOP_REGEX_MAX_MEM} bytes"
        return f"invalid stop_regex {pattern[:40]!r}: {reason} (RE2 syntax: no lookaround or backreferences)"


def check_copies_budget(field: str, count: int, n: int, limit: int) -> None:
    """A list-valued field that costs work at every step of each of the n samples (stop_token_ids,
    logit_bias, token_ids_logprob): its entries, all samples together, within what one sample may
    have. Raises ValueError naming the field."""
    if n * count > limit:
        raise ValueError(f"{field}: {n * count} entries (n={n} samples of {count}), more than the {limit} "
                         f"allowed per request")


def check_stop_budget(stop: list[str], stop_regex: list[str], n: int) -> list[re2._Regexp]:
    """Bounds what looking for a request's stops costs at every token, its n samples together
    (see MAX_STOP_CHARS); returns the stop_regex patterns compiled. Raises ValueError naming the
    field over its budget."""
    chars = n * sum(map(len, stop))
    if chars > MAX_STOP_CHARS:
        raise ValueError(f"stop: {chars} characters of stop strings (n={n} samples), more than the "
                         f"{MAX_STOP_CHARS} allowed per request")
    compiled, program = [], 0
    for pattern in stop_regex:
        if len(pattern.encode()) > MAX_STOP_REGEX_BYTES:
            raise ValueError(f"stop_regex {pattern[:40]!r} is over {MAX_STOP_REGEX_BYTES} bytes")
        compiled.append(stop_regex_matcher(pattern))  # raises ValueError naming the problem
        program += n * compiled[-1].programsize
        if program > MAX_STOP_REGEX_PROGRAM:  # checked as they compile: the rest need not
            raise ValueError(f"stop_regex: the patterns compile to more than {MAX_STOP_REGEX_PROGRAM} RE2 "
                             f"instructions (n={n} samples), the budget of one request")
    return compiled


class SamplingParams(StrictModel):
    # 0 means prefill only: the prompt is computed (and cached), nothing is generated.
    max_new_tokens: NonNegInt32 = 128
    min_new_tokens: NonNegInt32 = 0
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: Int32 = -1  # -1: the whole vocabulary
    min_p: float = Field(0.0, ge=0, le=1)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    n: int = Field(1, ge=1, le=MAX_N)
    # Constrained decoding (constrained/): at most one of these; json_schema is a JSON string.
    json_schema: Grammar | None = None
    regex: Grammar | None = None
    ebnf: Grammar | None = None
    # Generation stops where the output text matches one of these (searched by RE2, see stop_regex_matcher).
    stop_regex: list[Annotated[Text, Field(min_length=1)]] = Field(default_factory=list, max_length=MAX_STOP_REGEX)
    # token id (as a string, SGLang's JSON form) -> added to its logit before sampling
    logit_bias: dict[str, LogitBias] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS)
    spaces_between_special_tokens: bool = True
    stream_interval: int | None = Field(None, ge=1, le=2**20)  # stream every k tokens (None: every one)
    # The server's own constraint (chat tools, json_schema after thinking): given by the chat layer
    # through from_dict, never by a client (a JSON body cannot hold a ServerGrammar): not in the API
    # schema, never dumped.
    server_grammar: SkipJsonSchema[ServerGrammar | None] = Field(None, exclude=True)
    _stop_regexes: list[re2._Regexp] = PrivateAttr(default_factory=list)  # stop_regex compiled

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        """null means "not given" (SGLang's clients send every field); SGLang spells the seed
        sampling_seed; a single stop string stands for a list of one."""
        if not isinstance(data, dict):
            return data
        data = accept_defaults_only(data, _DEFAULT_ONLY)
        for kind in GRAMMAR_KINDS:
            if data.get(kind) == "":  # SGLang: an empty grammar means none
                data.pop(kind)
        if "sampling_seed" in data:
            if "seed" in data:
                raise ValueError("give seed or sampling_seed, not both")
            data["seed"] = data.pop("sampling_seed")
        for key in ("stop", "stop_regex"):
            if isinstance(data.get(key), str):
                data[key] = [data[key]]
        return data

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens "
                             f"({self.max_new_tokens})")
        kinds = [k for k in GRAMMAR_KINDS if getattr(self, k) is not None]
        if kinds and self.server_grammar is not None:
            raise ValueError(f"give {kinds[0]} or {self.server_grammar.source}, not both: the server builds a "
                             f"grammar from {self.server_grammar.source}")
        if len(kinds) > 1:
            raise ValueError(f"give at most one of json_schema, regex, ebnf; got {' and '.join(kinds)}")
        for kind in kinds:
            check_grammar_chars(kind, getattr(self, kind))
        self._stop_regexes = check_stop_budget(self.stop, self.stop_regex, self.n)
        check_copies_budget("stop_token_ids", len(self.stop_token_ids), self.n, MAX_STOP)
        check_copies_budget("logit_bias", len(self.logit_bias), self.n, MAX_LOGIT_BIAS)
        for key in self.logit_bias:
            if not (key.isascii() and key.isdigit()) or int(key) > INT64_MAX:
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
        return self

    def check_vocab(self, vocab_size: int) -> None:
        """The checks that need the model: token ids in logit_bias and stop_token_ids."""
        for field, ids in (("logit_bias", [int(k) for k in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{field} holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")

    @property
    def stop_regexes(self) -> list[re2._Regexp]:
        """stop_regex compiled, in its order."""
        return self._stop_regexes

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the request's constraint, if any: the grammar cache's key."""
        if self.server_grammar is not None:
            return SERVER_EBNF, self.server_grammar.ebnf
        return next(((k, getattr(self, k)) for k in GRAMMAR_KINDS if getattr(self, k) is not None), None)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SamplingParams | None, defaults: dict[str, Any] | None = None,
                  server_grammar: ServerGrammar | None = None) -> SamplingParams:
        """Builds and validates; raises ValueError naming the offending field. Fields the
        request leaves out (or sets to null) take the model's defaults, then ours. server_grammar:
        the constraint the server built for the request, if any."""
        if isinstance(d, SamplingParams):
            server_grammar = server_grammar or d.server_grammar  # not dumped
            d = d.model_dump(exclude_unset=True)
        if d is not None and not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        merged = dict(defaults or {})
        merged.update({k: v for k, v in (d or {}).items() if v is not None})
        if server_grammar is not None:
            merged["server_grammar"] = server_grammar
        return validate(cls, merged, "sampling_params")

    @classmethod
    def usable_defaults(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The entries of a model's generation config that are valid sampling parameters."""
        out = {}
        for key, value in config.items():
            if key not in cls.model_fields:
                continue
            try:
                cls.model_validate({key: value})
                out[key] = value
            except ValidationError:
                logger.warning("ignoring the model's default %s=%r: not a valid sampling parameter", key, value)
        return out

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)
