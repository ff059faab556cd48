"""A grammar the library cannot follow is refused at submission, with the library's reason in
one line, when its first masks show it."""

from __future__ import annotations

import httpx
import pytest

from baby_sgl import Engine
from entrypoints.conftest import serve_in_thread, wait_idle


def test_a_regex_that_exhausts_the_lexer_is_a_400(tiny_llama):
    """a{300000}: the compile's first mask fits the library's lexer budget and uses up the rest,
    which the copies share. The old code probed one copy only (constrained/grammar.py:
    GrammarCache._compile), and the request came back 200 with empty text and finish_reason
    stop."""
    with serve_in_thread(Engine(tiny_llama, dtype="float32", max_total_tokens=2048)) as base:
        for _ in range(2):  # the refusal is remembered, and said again at once
            r = httpx.post(base + "/generate", json={"text": "x", "sampling_params": {"regex": "a{300000}"}})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"].startswith("invalid regex: lexer error: too many expressions")
        ok = httpx.post(base + "/generate", json={"text": "x", "sampling_params": {"regex": "a{3}"}})
        assert ok.json()["text"] == "aaa"
        wait_idle(base)


@pytest.mark.parametrize("regex", ["a{1000000}", "(x{1000}){1000}"])
def test_too_complex_regexes_are_refused_with_one_line(engine, regex):
    """These compiled, and the request then ended at its first token (abort): a second copy's
    mask now shows the library's lexer cannot follow them, before anything is queued."""
    with pytest.raises(ValueError, match="^invalid regex: lexer error") as err:
        engine.generate("x", {"regex": regex, "max_new_tokens": 4})
    assert "\n" not in str(err.value) and len(str(err.value)) < 300
