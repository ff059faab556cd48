"""SGLang's own frontend language (`import sglang as sgl`) as a client of our server.

The programs (frontend_programs.py) run once, in a child process of this venv's python, against a
server on a loopback port; they report what every program got and every HTTP exchange the
frontend made. Here we check those outcomes, and cross-check them with direct calls to the server.
The tiny model is random, so every generation is bounded: by a grammar, or by max_tokens."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import unicodedata
from dataclasses import dataclass

import httpx
import pytest

import frontend_programs as programs
from baby_sgl import Engine
from entrypoints.conftest import serve_in_thread, wait_idle

PROGRAM_TIMEOUT_S = 240


@dataclass
class FrontendRun:
    results: dict
    wire: list[dict]  # every request the frontend sent, in order, with the server's status and answer

    def exchanges(self, program: str, path: str = "/generate") -> list[dict]:
        start, end = self.results[program]["wire"]
        return [e for e in self.wire[start:end] if e["path"] == path]


@pytest.fixture(scope="module")
def server(tiny_llama):
    engine = Engine(tiny_llama, dtype="float32", max_total_tokens=4096)
    with serve_in_thread(engine) as base:
        yield base


@pytest.fixture(scope="module")
def frontend(server) -> FrontendRun:
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}  # loopback only
    proc = subprocess.run([sys.executable, programs.__file__, server], capture_output=True, text=True,
                          timeout=PROGRAM_TIMEOUT_S, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    return FrontendRun(out["results"], out["wire"])


@pytest.fixture(autouse=True)
def memory_clean(server):
    yield
    wait_idle(server)


def generate(server: str, body: dict) -> dict | list:
    r = httpx.post(server + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_request_answered_and_no_program_failed(frontend, tiny_llama):
    assert [e["path"] for e in frontend.wire[:2]] == ["/get_model_info"] * 2  # one per RuntimeEndpoint
    for e in frontend.wire:
        assert e["status"] == 200, e
    for name, result in frontend.results.items():
        assert "exception" not in result, f"{name}: {result['exception']}"
        for state in result.get("states", [result]):
            assert state.get("error") is None, f"{name}: {state['error']}"
    assert frontend.results["model_info"]["model_path"] == tiny_llama


def _unicode_word_or_space(c: str) -> bool:
    """The grammar's \\w and \\s are Unicode classes (Rust regex: letters, marks, decimal digits,
    connector punctuation, join controls); Python's re differs at the edges (marks), so a
    character passes if either side counts it."""
    return bool(re.fullmatch(r"[\w\s]", c)) or unicodedata.category(c)[0] == "M" or c in "\u200c\u200d"


def test_regex_and_dtype_gens(frontend):
    result = frontend.results["constrained"]
    values, meta = result["vars"], result["meta"]
    assert re.fullmatch(r"[0-9]{1,3}", values["num"])
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{2}", values["code"])
    # dtype=int is the regex [-+]?[0-9]+[ \n]* with stop " " and "\n": the value is the bare digits
    # (a stop string is trimmed), a string, not an int; a cut at max_tokens still ends in a digit.
    assert re.fullmatch(r"[-+]?[0-9]+", values["n_int"])
    int_request = frontend.exchanges("constrained")[2]["body"]["sampling_params"]
    assert int_request["regex"] == r"[-+]?[0-9]+[ \n]*" and {" ", "\n"} <= set(int_request["stop"])
    # dtype=float can be cut after "." by max_tokens; when it stops by itself it is a whole number.
    float_pattern = r"[-+]?[0-9]*\.?[0-9]+" if meta["n_float"]["finish_reason"]["type"] == "stop" else \
        r"[-+]?[0-9]*\.?[0-9]*"
    assert re.fullmatch(float_pattern, values["n_float"])
    assert values["flag"] in ("True", "False")
    doc = json.loads(values["js"])
    assert set(doc) == {"n", "ok"} and isinstance(doc["ok"], bool)
    assert isinstance(doc["n"], int) and 0 <= doc["n"] <= 99
    # stop_regex ends the request where the forced two digits complete; SGLang keeps the match.
    assert re.fullmatch(r"[a-z]{1,4}[0-9]{2}", values["cut"])
    assert meta["cut"]["finish_reason"] == {"type": "stop", "matched": "[0-9]{2}"}


def test_dtype_str_is_a_quoted_word_or_its_prefix(frontend):
    """dtype=str is the regex "[\\w\\d\\s]*": nothing bounds the word, so the random model may not
    close the quote within max_tokens. Either it closed it, or it ran out of tokens and the text
    is a prefix of the language (a multi-byte character cut at the end decodes to U+FFFD)."""
    value = frontend.results["constrained"]["vars"]["word"]
    meta = frontend.results["constrained"]["meta"]["word"]
    assert value.startswith('"')
    if meta["finish_reason"]["type"] == "stop":
        body = value[1:-1]
        assert len(value) >= 2 and value.endswith('"')
    else:
        assert meta["finish_reason"] == {"type": "length", "length": 24} and meta["completion_tokens"] == 24
        body = value[1:].rstrip("\ufffd")
    assert all(_unicode_word_or_space(c) for c in body), value


def test_select_scores_match_server_logprobs(frontend, server):
    """select: a prefill-only call gives the prompt length P; a batch with logprob_start_len P-2
    gives each choice's logprobs, whose mean (null skipped) is normalized_prompt_logprobs. We
    recompute them from the server's logprobs of the whole prompt (logprob_start_len 0)."""
    result = frontend.results["choose"]
    calls = frontend.exchanges("choose")
    assert len(calls) == 4  # (prefill, scoring) for each of the two selects
    for (prefill, scoring), name in zip([calls[:2], calls[2:]], ["yes_no", "conf"]):
        prefix = prefill["body"]["text"]
        choices = [t[len(prefix):] for t in scoring["body"]["text"]]
        info = prefill["response"]["meta_info"]
        assert prefill["response"]["text"] == "" and info["completion_tokens"] == 0
        assert info["finish_reason"] == {"type": "length", "length": 0}
        p = info["prompt_tokens"]
        assert p == len(prefix.encode())  # byte-level tokenizer, no BOS added
        assert scoring["body"]["logprob_start_len"] == p - 2
        for answer in scoring["response"]:
            logprobs = answer["meta_info"]["input_token_logprobs"]
            assert logprobs[0][0] is None  # SGLang: the first prompt position has no logprob
            assert len(logprobs) == answer["meta_info"]["prompt_tokens"] - (p - 2)

        scores = result["meta"][name]["normalized_prompt_logprobs"]
        assert len(scores) == len(choices) and all(math.isfinite(x) for x in scores)
        assert result["vars"][name] == choices[scores.index(max(scores))]
        whole = generate(server, {"text": scoring["body"]["text"], "sampling_params": {"max_new_tokens": 0},
                                  "return_logprob": True, "logprob_start_len": 0})
        for score, answer in zip(scores, whole):
            logprobs = answer["meta_info"]["input_token_logprobs"]
            assert logprobs[0][0] is None and len(logprobs) == answer["meta_info"]["prompt_tokens"]
            expected = [lp for lp, _, _ in logprobs[p - 1:]]  # from the prefix's last token on
            assert score == pytest.approx(sum(expected) / len(expected), abs=1e-4)


def test_fork_gather_variable(frontend):
    result = frontend.results["fork_gather"]
    tips = result["vars"]["tip"]
    assert isinstance(tips, list) and tips == result["ret"]["branch_tips"] and len(tips) == 2
    prefix = "Here are two tips about sleep.\n"
    assert result["text"] == prefix  # gather_variable leaves the parent's text alone
    sent = {e["body"]["text"]: e["response"]["text"] for e in frontend.exchanges("fork_gather")}
    assert sent == {prefix + "Tip 1:": tips[0], prefix + "Tip 2:": tips[1]}


def test_fork_concate_and_append(frontend):
    result = frontend.results["fork_concat"]
    prefix, branches, joined = result["ret"]["prefix"], result["ret"]["branch_texts"], result["ret"]["joined"]
    assert all(b.startswith(prefix) and len(b) > len(prefix) for b in branches)
    assert joined == prefix + "".join(b[len(prefix):] for b in branches)
    assert result["text"] == joined + "Done:" + result["vars"]["done"]
    [concat] = frontend.exchanges("fork_concat", "/concate_and_append_request")
    assert concat["status"] == 200 and len(concat["body"]["src_rids"]) == 2 and concat["body"]["dst_rid"]
    # Each branch is committed (prefill only) before the join; the parent's next request carries
    # the joined text, prefilled normally.
    commits = [e["body"]["text"] for e in frontend.exchanges("fork_concat")
               if e["body"]["sampling_params"] == {"max_new_tokens": 0}]
    assert set(branches) <= set(commits)
    assert frontend.exchanges("fork_concat")[-1]["body"]["text"] == joined + "Done:"


def test_run_batch(frontend):
    states = frontend.results["batch"]["states"]
    assert len(states) == len(programs.BATCH_QUESTIONS)
    for state, question in zip(states, programs.BATCH_QUESTIONS):
        assert state["error"] is None and isinstance(state["vars"]["answer"], str)
        assert state["text"] == programs.BATCH_PREFIX + "Q: " + question + "\nA:" + state["vars"]["answer"]
    cache_prefix, *gens = frontend.exchanges("batch")
    # The traced constant prefix (over 64 characters) is prefilled once before the batch runs.
    assert cache_prefix["body"] == {"text": programs.BATCH_PREFIX + "Q: ", "sampling_params": {"max_new_tokens": 0}}
    assert len(gens) == len(programs.BATCH_QUESTIONS)


def _sse_payloads(events: list[str]) -> list[dict]:
    data = [e[len("data: "):] for e in events if e.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_stream_with_logprobs(frontend, server):
    result = frontend.results["stream"]
    story, meta = result["vars"]["story"], result["meta"]["story"]
    assert result["pieces"] and "".join(result["pieces"]) == story
    assert result["text"] == "Once upon a time" + story and re.fullmatch(r"[a-z ]{8,16}", story)
    assert meta["finish_reason"] is not None  # the frontend keeps the last event's meta_info

    [call] = frontend.exchanges("stream")
    events = _sse_payloads(call["events"])
    assert len(events) > 1 and events[-1]["meta_info"] == meta and events[-1]["text"] == story
    for before, after in zip(events, events[1:]):  # text and ids cumulative, as SGLang streams
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert before["meta_info"]["finish_reason"] is None
    joined, sent = [], 0
    for event in events:  # logprobs incremental, as SGLang's test_stream_logprobs expects
        own = event["meta_info"]["output_token_logprobs"]
        assert [token for _, token, _ in own] == event["output_ids"][sent:]
        assert [len(top) for top in event["meta_info"]["output_top_logprobs"]] == [2] * len(own)
        joined, sent = joined + own, len(event["output_ids"])
    assert len(joined) == meta["completion_tokens"] == meta["output_token_logprobs_length"]
    assert events[0]["meta_info"]["input_token_logprobs"] == []  # SGLang: no logprob_start_len, no prompt logprobs

    whole = generate(server, {k: v for k, v in call["body"].items() if k != "stream"})
    assert whole["text"] == story
    assert whole["output_ids"] == [token for _, token, _ in joined]
    assert [lp for lp, _, _ in whole["meta_info"]["output_token_logprobs"]] == \
        pytest.approx([lp for lp, _, _ in joined], abs=1e-4)


def _chatml(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def _default(role: str, content: str) -> str:
    return f"{role.upper()}:{content}\n"


@pytest.mark.parametrize("program,render,generation_prompt", [
    ("chat_chatml", _chatml, "<|im_start|>assistant\n"),
    ("chat_default", _default, "ASSISTANT:"),
])
def test_multi_turn_chat(frontend, program, render, generation_prompt):
    """The frontend renders its own chat template into plain text; the server must take it as is
    (no template of its own, the tiny tokenizer's is neither of these)."""
    result = frontend.results[program]
    reply1, reply2 = result["vars"]["reply1"], result["vars"]["reply2"]
    first, second = programs.CHAT_TURNS["first"], programs.CHAT_TURNS["second"]
    history = render("system", programs.CHAT_SYSTEM) + render("user", first)
    expected_prompts = [history + generation_prompt,
                        history + render("assistant", reply1) + render("user", second) + generation_prompt]
    calls = frontend.exchanges(program)
    assert [c["body"]["text"] for c in calls] == expected_prompts
    for call in calls:
        assert call["response"]["meta_info"]["prompt_tokens"] == len(call["body"]["text"].encode())
        if program == "chat_chatml":  # the template's stop string goes with every gen
            assert "<|im_end|>" in call["body"]["sampling_params"]["stop"]
    assert result["messages"] == [
        {"role": "system", "content": programs.CHAT_SYSTEM}, {"role": "user", "content": first},
        {"role": "assistant", "content": reply1.lstrip()}, {"role": "user", "content": second},
        {"role": "assistant", "content": reply2.lstrip()}]


def test_greedy_answers_match_direct_calls(frontend, server):
    """Every greedy generation a program made is what the server answers to the same request now
    (with a warm cache and alone in its batch)."""
    replayed = 0
    for call in frontend.wire:
        body = call["body"]
        params = (body or {}).get("sampling_params") or {}
        if call["path"] != "/generate" or call["stream"] or params.get("temperature") != 0 \
                or params.get("max_new_tokens") == 0:
            continue
        answer = generate(server, body)
        assert (answer["text"], answer["output_ids"]) == (call["response"]["text"], call["response"]["output_ids"])
        replayed += 1
    assert replayed >= 15


def test_server_info_and_flush_cache(frontend):
    info = frontend.results["server_info"]["info"]
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
    [flush] = frontend.exchanges("flush_cache", "/flush_cache")
    assert flush["method"] == "POST" and flush["status"] == 200


def test_prompt_logprobs_and_sampling_knobs(frontend):
    result = frontend.results["knobs"]
    scored, line, sampled = frontend.exchanges("knobs")
    # return_logprob with logprob_start_len 4 of "Scored: ": positions 4.. ("ed: "), the first null.
    meta = result["meta"]["scored"]
    assert scored["body"]["text"] == "Scored: " and scored["body"]["logprob_start_len"] == 4
    assert [text for _, _, text in meta["input_token_logprobs"]] == list("ed: ")
    assert meta["input_token_logprobs"][0][0] is None
    assert all(math.isfinite(lp) for lp, _, _ in meta["input_token_logprobs"][1:])
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    assert [len(top) for top in meta["output_top_logprobs"]] == [1] * meta["completion_tokens"]
    # The default template adds no stop string, so a gen's stop="\n" goes out as a bare string.
    assert line["body"]["sampling_params"]["stop"] == "\n" and "\n" not in result["vars"]["line"]
    # Every sampling field the frontend can set is accepted; min_tokens holds EOS back.
    sent = sampled["body"]["sampling_params"]
    assert (sent["top_k"], sent["min_new_tokens"], sent["stop_token_ids"]) == (20, 6, [2])
    assert result["meta"]["sampled"]["completion_tokens"] == 6
