"""The `baby-sgl` command, run as a user would run it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "baby_sgl.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_json_lines(tiny_llama, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\nthree\n")
    proc = run("generate", "--model-path", tiny_llama, "--input-file", str(prompts), "--json",
               "--max-new-tokens", "4", "--page-size", "4")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [x["prompt"] for x in lines] == ["one", "two", "three"]
    assert all(x["meta_info"]["completion_tokens"] <= 4 for x in lines)


def test_generate_streams_one_prompt(tiny_llama):
    proc = run("generate", "hello", "--model-path", tiny_llama, "--max-new-tokens", "5", "--chat", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    # the streamed pieces make up the engine's greedy answer to the same chat turn, then a newline
    from baby_sgl import Engine

    with Engine(tiny_llama, dtype="float32") as engine:
        expected = engine.chat([{"role": "user", "content": "hello"}], {"max_new_tokens": 5, "temperature": 0})
    assert expected["meta_info"]["completion_tokens"] >= 1
    assert proc.stdout == expected["text"] + "\n"


def test_bad_flag_value_is_refused(tiny_llama):
    proc = run("generate", "hi", "--model-path", tiny_llama, "--page-size", "3")
    assert proc.returncode != 0 and "page_size must be a power of two" in proc.stderr


def test_demo_on_default_model():
    proc = subprocess.run([sys.executable, str(ROOT / "run_demo.py"), "--comprehensive", "--seed=42", "--max-new-tokens", "8"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "refused as expected: prompt is empty" in proc.stdout
    assert "identical with the radix cache on and off: 6/6" in proc.stdout
