"""SGLang's own test programs (sglang/test/test_programs.py, the module SGLang's CI runs against
its server through `sgl.RuntimeEndpoint`, with `--incremental-streaming-output` as SGLang's CI
starts it; test_stream_logprobs with the default flags too) against our server on the default
model, SmolLM2-135M-Instruct.

Every program of that module is either run here (test_stream_logprobs judged by what the server
sent, as WIRE_CHECKED says why) or named below with why not: four check what the
model knows (capitals, 24 hours, 257 * 983, the Linux creator's country), which a 135M model does
not, whatever the server (SGLang runs them on an 8B model); one passes or fails by its random draw. Those with a `check_answer` switch run
with it off, as SGLang's CI runs test_select. The programs run once, in a child process
(sglang_test_programs.py, which says what it stands in for), and each test here checks one."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sglang_test_programs
from baby_sgl import Engine
from baby_sgl.server_args import ServerArgs
from entrypoints.conftest import serve_in_thread, wait_idle
from helpers import sglang_package_dir

RUN = {
    "test_mt_bench": {}, "test_select": {"check_answer": False}, "test_expert_answer": {"check_answer": False},
    "test_parallel_decoding": {}, "test_parallel_encoding": {"check_answer": False}, "test_stream": {},
    "test_regex": {}, "test_dtype_gen": {}, "test_decode_json_regex": {}, "test_gen_min_new_tokens": {},
}
NOT_RUN = {
    "test_few_shot_qa": "asserts the model knows four capitals",
    "test_decode_int": "asserts the model knows there are 24 hours in a day and 365 days in a year",
    "test_tool_use": "asserts the model writes 257*983 as the calculator's expression",
    "test_react": "asserts the model names the country the creator of Linux lives in",
    "test_decode_json": "samples (temperature 1) strings whose regex allows any whitespace, and json.loads "
                        "refuses a raw newline or tab in a string: it passes or fails by the draw",
    "test_image_qa": "needs a vision model and an image file",
    "test_completion_speculative": "API speculative execution, for OpenAI-style backends (token_usage)",
    "test_chat_completion_speculative": "API speculative execution, for OpenAI-style backends",
}
# Run, but judged by what the server sent rather than by the program's own verdict: its reader is
# a race. lang/interpreter.py runs the stream in a thread that appends each event's text to the
# variable and replaces its meta_info, while text_async_iter wakes later and reads both: when two
# events arrive before it wakes, one chunk's text spans both and its logprobs are the second's
# only, so the program fails by timing on any server (seen here under a loaded CI machine). The
# test below replays the program's reading of the recorded events one at a time and applies the
# program's own assertions to it.
WIRE_CHECKED = {"test_stream_logprobs": {}}
TIMEOUT_S = 600


def _sglang_programs() -> set[str]:
    path = sglang_package_dir() / "test" / "test_programs.py"
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def run_programs(base: str, programs: dict[str, dict]) -> dict:
    """Each program (name -> its keyword arguments) run against the server at base, in a child
    process; then the memory invariant after all of them."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}  # loopback only
    args = [f"{name}={json.dumps(kwargs)}" for name, kwargs in programs.items()]
    proc = subprocess.run([sys.executable, sglang_test_programs.__file__, base, *args], capture_output=True,
                          text=True, timeout=TIMEOUT_S, env=env, cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    wait_idle(base)
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def results() -> dict:
    engine = Engine(max_total_tokens=16384)
    with serve_in_thread(engine, ServerArgs(incremental_streaming_output=True)) as base:
        return run_programs(base, RUN | WIRE_CHECKED)


def test_every_program_of_the_module_is_accounted_for():
    assert _sglang_programs() == set(RUN) | set(WIRE_CHECKED) | set(NOT_RUN)


@pytest.mark.parametrize("name", sorted(RUN))
def test_sglang_program(results, name):
    r = results[name]
    assert r["passed"], f"{r['error']}\n{r['executor_errors']}\nrefused: {r['refused']}"
    assert "/generate" in r["paths"]  # it reached the server


STREAMED_LOGPROBS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


def read_as_the_frontend_does(lines: list[str]) -> list[tuple[str, dict]]:
    """The chunks text_async_iter(var, return_meta_data=True) yields for a recorded /generate
    stream when it wakes after every event: RuntimeEndpoint.generate_stream's text cut
    (`data["text"][pos:]`), and the meta_info of events that add no text joined into the next
    chunk's (_merge_stream_meta_info)."""
    chunks: list[tuple[str, dict]] = []
    pos, pending = 0, None
    for line in lines:
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        data = json.loads(line[5:])
        text, meta = data["text"][pos:], data["meta_info"]
        pos += len(text)
        if pending is not None:
            meta = meta | {k: pending.get(k, []) + meta.get(k, []) for k in STREAMED_LOGPROBS
                           if k in meta or k in pending}
        pending = None if text else meta
        if text:
            chunks.append((text, meta))
    return chunks


def assert_stream_logprobs_checks(r: dict) -> None:
    """SGLang's test_stream_logprobs assertions, on the chunks its reader makes of what we sent."""
    assert not r["refused"] and not r["executor_errors"], r
    [lines] = r["streams"]
    chunks = read_as_the_frontend_does(lines)
    assert len(chunks) > 1
    prev_tokens = 0
    for text, meta in chunks:
        assert text and meta["completion_tokens"] == meta["output_token_logprobs_length"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - prev_tokens, (text, meta)
        prev_tokens = meta["completion_tokens"]
    assert prev_tokens >= len(chunks)


def test_stream_logprobs_with_incremental_output(results):
    assert_stream_logprobs_checks(results["test_stream_logprobs"])


def test_stream_logprobs_with_default_flags():
    """SGLang's default stream, which test_stream_logprobs checks: the text so far in every event
    (each adds some), and only that event's own output logprob entries."""
    # Failed before: native_api._native_sse sent every logprob entry so far in each event unless
    # --incremental-streaming-output (`meta = meta | {k: meta[k][n_logprobs:] ...}` only then).
    with serve_in_thread(Engine(max_total_tokens=4096)) as base:
        r = run_programs(base, WIRE_CHECKED)["test_stream_logprobs"]
    assert r["paths"] == ["/generate"]
    assert_stream_logprobs_checks(r)
