"""A grammar the library gives up on in the middle of an answer, after it has written part of it:
the request ends there with the library's reason (an abort, not a `stop` that would claim the
text is complete under the constraint), the requests beside it go on, and the grammar is not
cached for the next request.

The library's budget is what makes a grammar fail midway: its lexer builds DFA states as the
output goes on, and stops at LLParserLimits.max_lexer_states (250000, shared by every copy of a
compiled grammar). A grammar whose states the compile's probes do not already build
(constrained/grammar.py:GrammarCache._compile masks two copies at the start) needs an output of
about that many bytes to reach it with the default limits, far past any test's context. So the
test lowers that one limit of the library, at the library (every other part of the path is the
served one): `[0-9]{200}` builds a state per digit, and fails at about the 80th."""

from __future__ import annotations

import functools
import logging

import httpx
import llguidance
import pytest

from baby_sgl import Engine
from entrypoints.conftest import serve_in_thread, wait_idle

REGEX = "[0-9]{200}"
STATES = 100  # the lexer's budget here (the library's default: 250000)


@pytest.fixture
def small_lexer(monkeypatch):
    monkeypatch.setattr(llguidance, "LLParserLimits", functools.partial(llguidance.LLParserLimits,
                                                                        max_lexer_states=STATES))


@pytest.fixture(scope="module")
def served(tiny_llama):
    engine = Engine(tiny_llama, dtype="float32", max_total_tokens=2048)
    with serve_in_thread(engine) as base:
        yield engine, base


def test_a_grammar_that_fails_midway_ends_its_request_alone(served, small_lexer, caplog):
    """Before the error state was checked (constrained/grammar.py: GrammarMatcher.fill_mask and
    accept_token called no is_error()), the library allowed only EOS once in it, and the request
    came back `stop` (EOS matched) with the digits written so far, which the regex forbids. Before
    a failed grammar was dropped (GrammarCache.submit reused every cached one), the same request
    again got the spent copy's lexer and ended at its first token with no text. A client's
    constraint failing is not a fault of the server's: it is logged without an error's traceback."""
    engine, base = served
    caplog.set_level(logging.INFO, logger="baby_sgl")
    body = {"text": ["d", "free"], "sampling_params": [{"regex": REGEX, "max_new_tokens": 300, "temperature": 0},
                                                       {"max_new_tokens": 120, "ignore_eos": True}]}
    first = None
    for _ in range(2):  # the same request again: compiled afresh, and it fails the same way
        r = httpx.post(base + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        broken, beside = r.json()
        reason = broken["meta_info"]["finish_reason"]
        assert reason["type"] == "abort", reason
        assert reason["message"].startswith("the output cannot continue under its constraint: lexer error: too many "
                                            "states"), reason
        # midway: digits were written, fewer than the regex needs
        assert broken["text"].isdigit() and 10 < len(broken["text"]) < 200
        assert beside["meta_info"]["finish_reason"] == {"type": "length", "length": 120}
        assert ("regex", REGEX) not in engine.grammars  # dropped from the cache
        first = first or broken["text"]
        assert broken["text"] == first  # greedy under the same grammar: the same failure
    ok = httpx.post(base + "/generate", json={"text": "d", "sampling_params": {"regex": "[0-9]{20}"}})
    assert len(ok.json()["text"]) == 20
    wait_idle(base)
    assert any("a constraint left a request no token" in r.message for r in caplog.records)
    assert not [r.message for r in caplog.records if r.levelno >= logging.ERROR]
