"""Constrained decoding: a request's `regex`, `json_schema` or `ebnf` becomes a grammar over the
tokenizer's vocabulary, and at every step only the tokens that keep the output inside the
grammar may be sampled.

The grammar library is llguidance (`--grammar-backend llguidance`, the default; `none` turns
constraints off). It was chosen by measurement against xgrammar (SGLang's default) and
outlines-core on SmolLM2's 49k vocabulary: a JSON schema compiles in ~1 ms (xgrammar 8 ms), the
masks of 32 requests fill in ~0.4 ms a step (xgrammar 0.2 ms), and it is one 8 MB wheel with no
dependencies, where xgrammar needs triton (hundreds of MB); outlines-core has no EBNF. See
docs/structured_output.md.

Life of a constraint: `GrammarCache` compiles it on its own threads (never the scheduler's; the
HTTP server awaits the compile without holding a worker thread), remembers it by its text (an
invalid one too, with its error), and each request gets its own matcher, a copy of the compiled
one. In the scheduler thread, the sampler
asks every constrained request's matcher for its allowed tokens (a bitmask) and sets the rest of
the logits to -inf, after every other operation on them (see sampling/sampler.py); the scheduler
then feeds the chosen token to the matcher.

The library's limits (LLParserLimits: lexer fuel, Earley items and lexer states per step, grammar
size) bound what a compile and a step cost; past one, a matcher enters its error state. It is
checked after every mask and every token, and ends that request alone (finish_reason abort, the
library's reason), never quietly. The copies of a grammar share its lexer's tables, and with them
the budget of lexer expressions, so a grammar that failed while in use is dropped from the cache:
the next request with it compiles it afresh. The matcher lives on the
request, so retraction (which keeps the output) and chunked prefill (which samples nothing until
the prompt is done) leave it where it was. When the grammar can take no further token the request
finishes (`stop`, matched on that token).
"""

from __future__ import annotations

import json
import logging
import queue
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from baby_sgl.constrained.productive import lark_fault, schema_fault
from baby_sgl.validation import check_nesting

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

logger = logging.getLogger(__name__)

GRAMMAR_BACKENDS = ("llguidance", "none")
_CACHE_SIZE = 1024  # compiled grammars kept, least recently used dropped first...
_CACHE_TEXT_BUDGET = 4 * 2**20  # ...and at most this many characters of grammar text (a compiled
# 1 MiB regex held ~35 MB, so the budget bounds the cache's memory to a few hundred MB)
_COMPILE_THREADS = 2
# The library recurses over nested rules and $ref chains in native code: a compile thread's stack
# is large (reserved, not committed, until used), so any grammar within the size limits compiles or
# fails there, instead of overflowing a default 8 MB stack and killing the process.
_COMPILE_STACK_BYTES = 512 * 2**20
# Dicts and lists inside one another in a json_schema (128 levels of anyOf): far past any real
# schema, and within what the rewrite's recursion and the library's compiler take.
MAX_SCHEMA_NESTING = 256
_MAX_ERROR_CHARS = 400  # a library message may quote the whole grammar
# llguidance's test for Lark syntax (gbnf_to_lark.is_lark_syntax): a line that starts, after blanks,
# with `%llguidance` or `start:` (here also `?start:`, Lark's inlined start rule, which that test
# sent to the GBNF converter). Its `^\s*` lets every line start scan all the blank lines after it,
# quadratic (32 Ki newlines took 13 s); blanks without the newline find the same lines.
_LARK_SYNTAX = re.compile(r"(?m)^[^\S\n]*(?:%llguidance\b|[?!]?start\s*:)")
# JSON the model writes under a schema: compact separators, no free whitespace. Free whitespace
# lets a model pad forever (a grammar cannot end while spaces are still allowed).
_JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}
# The cache's kind for a grammar the server built (a ServerGrammar): Lark, which may use what only
# the server's own grammars may (productive.py: tokens that combine regexes with & or ~).
SERVER_EBNF = "ebnf (built by the server)"
# The library's names for what a client got wrong, in words a client can act on.
_PLAIN_WORDS = {
    # A rule or schema that only leads back to itself (productive.py refuses those it can read).
    "NoExtensionBias": "a rule or $ref leads back to itself before anything is produced",
}


class ConstraintError(ValueError):
    """The sampled token does not fit the request's grammar (nothing did: the constraint and
    min_new_tokens, stop_token_ids or logit_bias left no token allowed), or the grammar could not
    go on."""


class GrammarError(ValueError):
    """A constraint that cannot be compiled: its kind and the reason (the library's words, its
    internal names put in plain ones), so a front end that built the grammar can name what the
    client sent instead."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"invalid {kind}: {reason}")
        self.reason = reason


class GrammarMatcher:
    """One request's position in its grammar (scheduler thread only)."""

    def __init__(self, matcher: Any, compiled: CompiledGrammar) -> None:
        self._m, self._compiled = matcher, compiled

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)
        if self._m.is_error():  # the library then allows only EOS: say why instead of ending quietly
            self._fail(_library_error(self._m.get_error()))

    def accept_token(self, token: int) -> None:
        """Advances past the sampled token; raises ConstraintError if the grammar does not allow it
        or the library cannot go on."""
        if not self._m.consume_token(token) or self._m.is_error():
            self._fail(_library_error(self._m.get_error())
                       or "no allowed token was left (min_new_tokens, stop_token_ids or logit_bias forbade every "
                          "token the grammar allows)")

    def _fail(self, reason: str) -> None:
        if self._m.is_error():
            self._compiled.failed = True
        raise ConstraintError(f"the output cannot continue under its constraint: {reason}")

    def is_terminated(self) -> bool:
        """No further token can follow (the grammar is complete and closed)."""
        return self._m.is_stopped()


class CompiledGrammar:
    def __init__(self, template: Any) -> None:
        self._template = template
        self._lock = threading.Lock()  # copies are made from submitting threads
        self.failed = False  # a matcher of it entered the library's error state: not to be reused

    def matcher(self) -> GrammarMatcher:
        with self._lock:
            return GrammarMatcher(self._template.deep_copy(), self)


class GrammarCache:
    """Compiled grammars by (kind, text), for one tokenizer and model vocabulary. Compiles run
    on the cache's own threads; a grammar being compiled is compiled once, whoever asks."""

    def __init__(self, backend: str, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        if backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"grammar_backend must be one of {', '.join(GRAMMAR_BACKENDS)}, got {backend!r}")
        self.backend, self.tokenizer, self.vocab_size = backend, tokenizer, vocab_size
        self.eos_token_ids = eos_token_ids
        self._llg_tokenizer = None  # built on first use (~0.5 s for a 49k vocabulary)
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar | ValueError] = OrderedDict()
        self._cached_chars = 0
        self._pending: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []

    def submit(self, key: tuple[str, str]) -> Future:
        """A future of the compiled grammar of (kind, text), or of the ValueError naming what is
        wrong with it (an invalid grammar, or constraints off)."""
        with self._lock:
            hit = self._cache.get(key)
            if isinstance(hit, CompiledGrammar) and hit.failed:
                self._forget(key)
            elif hit is not None:
                self._cache.move_to_end(key)
                return _done(hit)
            if key in self._pending:
                return self._pending[key]
            if self.backend == "none":
                return _done(ValueError(f"{key[0]} needs constrained decoding, which is off (--grammar-backend none)"))
            future = self._pending[key] = Future()
            self._start_threads()
        self._jobs.put((key, future))
        return future

    def get(self, key: tuple[str, str]) -> CompiledGrammar:
        hit = self.submit(key).result()
        if isinstance(hit, ValueError):
            raise hit
        return hit

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self._cached_chars = 0

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, key: tuple[str, str]) -> bool:
        """Whether a usable compiled grammar of (kind, text) is cached."""
        hit = self._cache.get(key)
        return isinstance(hit, CompiledGrammar) and not hit.failed

    def _start_threads(self) -> None:
        if self._threads:
            return
        previous = threading.stack_size(_COMPILE_STACK_BYTES)
        try:
            for i in range(_COMPILE_THREADS):
                thread = threading.Thread(target=self._work, name=f"baby-sgl-grammar-{i}", daemon=True)
                thread.start()
                self._threads.append(thread)
        finally:
            threading.stack_size(previous)

    def _work(self) -> None:
        while True:
            key, future = self._jobs.get()
            try:
                result = self._compile(*key)
            except BaseException as e:  # noqa: BLE001 - the thread must live on
                result = GrammarError(key[0], _short(repr(e)))
            with self._lock:
                self._pending.pop(key, None)
                self._remember(key, result)
            if future.set_running_or_notify_cancel():  # False: cancelled, nobody waits for it
                future.set_result(result)

    def _remember(self, key: tuple[str, str], result) -> None:
        self._cache[key] = result
        self._cached_chars += len(key[1])
        while self._cache and (len(self._cache) > _CACHE_SIZE or self._cached_chars > _CACHE_TEXT_BUDGET):
            self._forget(next(iter(self._cache)))

    def _forget(self, key: tuple[str, str]) -> None:
        del self._cache[key]
        self._cached_chars -= len(key[1])

    def _tokenizer(self):
        with self._lock:
            if self._llg_tokenizer is None:
                import llguidance.hf

                self._llg_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                                   eos_token=self.eos_token_ids or None)
            return self._llg_tokenizer

    def _regex_is_empty(self, pattern: str) -> bool:
        """Whether a regex matches no text, asked of the library on the regex alone: first in its
        grammar, an empty one is refused at the first mask, not looped on (productive.py). A regex
        the library cannot compile at all counts as not empty here: the grammar's compile says why."""
        import llguidance

        try:
            matcher = llguidance.LLMatcher(self._tokenizer(), llguidance.LLMatcher.grammar_from_regex(pattern),
                                           log_level=0)
        except Exception:  # noqa: BLE001 - the grammar's own compile reports it
            return False
        return _first_mask_fails(matcher, self.vocab_size) and "NoExtensionBias" in (matcher.get_error() or "")

    def _compile(self, kind: str, text: str) -> CompiledGrammar | ValueError:
        import llguidance

        try:
            if kind == "json_schema":
                try:
                    schema = json.loads(text)
                except json.JSONDecodeError as e:
                    return ValueError(f"json_schema is not valid JSON: {e}")
                if schema is False:
                    return ValueError("invalid json_schema: false allows no value")
                try:
                    schema = {} if schema is True else closed_objects(schema)
                except ValueError as e:  # nested too deep
                    return e
                if (fault := schema_fault(schema)) is not None:
                    return GrammarError(kind, fault)
                grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_DEFAULTS)
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(text)
            else:  # ebnf: SGLang's (xgrammar's) GBNF dialect, root rule `root`, converted; or Lark
                from llguidance.gbnf_to_lark import gbnf_to_lark

                lark = text if is_lark(text) else gbnf_to_lark(text)
                if (fault := lark_fault(lark, self._regex_is_empty, combined_tokens=kind == SERVER_EBNF)) is not None:
                    return GrammarError(kind, fault)
                grammar = llguidance.LLMatcher.grammar_from_lark(lark)
            matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0,
                                           limits=llguidance.LLParserLimits(verbose_errors=False))
            # The first mask is where a grammar too complex for the library shows; computing it
            # here also warms the tables the scheduler's first mask would build. Copies share the
            # lexer's budget, so a second copy's mask shows whether a request's would still fit
            # (a{300000}: the first fits, and uses up the rest).
            for _ in range(2):
                if matcher.is_error():
                    break
                probe = matcher.deep_copy()
                if _first_mask_fails(probe, self.vocab_size):
                    return GrammarError(kind, _library_error(probe.get_error()))
        except Exception as e:  # the library's own words for what is wrong with the grammar
            return GrammarError(kind, _library_error(str(e)))
        if matcher.is_error():
            return GrammarError(kind, _library_error(matcher.get_error()))
        return CompiledGrammar(matcher)


def _first_mask_fails(matcher: Any, vocab_size: int) -> bool:
    """Computes the matcher's next mask (where a grammar too complex for the library, or a part
    that produces nothing, shows) and says whether the library failed."""
    import llguidance.torch

    if not matcher.is_error():
        llguidance.torch.fill_next_token_bitmask(
            matcher, torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32, device="cpu"))
    return matcher.is_error()


def is_lark(text: str) -> bool:
    """Whether an `ebnf` grammar is in Lark syntax, which the library parses as it is; any other is
    GBNF, converted to Lark first (in Python, holding the GIL: see MAX_GBNF_CHARS)."""
    return _LARK_SYNTAX.search(text) is not None


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _library_error(message: str | None) -> str:
    """The library's error, its first line only (what follows is the parser's state), its internal
    names put in plain words, cut short."""
    line = (message or "").split("\n")[0]
    for internal, plain in _PLAIN_WORDS.items():
        line = line.replace(internal, plain)
    return _short(line)


def _short(message: str) -> str:
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS] + "..."


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """As SGLang's default (xgrammar's strict mode) and OpenAI's structured output: an object
    schema that lists its properties and says nothing of others takes no others. A schema nested
    deeper than MAX_SCHEMA_NESTING is refused first (ValueError naming json_schema): the rewrite
    recurses, and how deep Python lets it go differs between versions (3.12 inlines the
    comprehensions, so a schema 3.11 refused reached the library, which refused it in its words)."""
    check_nesting(schema, MAX_SCHEMA_NESTING, "json_schema")
    return _closed(schema)


def _closed(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> schema: the names are data
            out[key] = {name: _closed(sub) for name, sub in value.items()}
        elif key in ("enum", "const", "default", "examples", "required"):
            out[key] = value
        else:
            out[key] = _closed(value)
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def apply_grammar_masks(logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> torch.Tensor:
    """Sets the logits of every token a row's grammar forbids to -inf (in place; rows without a
    constraint are left alone)."""
    live = [(i, m) for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
    if not live:
        return logits
    vocab = logits.shape[1]
    bitmask = torch.full((len(live), (vocab + 31) // 32), -1, dtype=torch.int32, device="cpu")  # the matchers fill it
    for j, (_, matcher) in enumerate(live):
        matcher.fill_mask(bitmask, j)
    # Bit b of word w allows token 32 w + b. Unpacked to 0/1, then to a bias of 0 or -inf
    # (-1 * max * 2 overflows to exactly -inf, 0 stays 0) that is added: on CPU this is several
    # times faster than masked_fill with -inf (1 ms against 7 ms for 32 x 49k logits).
    words = bitmask.numpy().astype("<i4", copy=False).view(np.uint8)
    allowed = torch.from_numpy(np.unpackbits(words, axis=1, bitorder="little")[:, :vocab])
    bias = allowed.to(logits.dtype).sub_(1).mul_(torch.finfo(logits.dtype).max).mul_(2.0)
    if len(live) == len(matchers):
        return logits.add_(bias.to(logits.device))
    rows = [i for i, _ in live]
    return logits.index_add_(0, torch.tensor(rows, device=logits.device), bias.to(logits.device))
