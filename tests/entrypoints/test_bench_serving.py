"""`bench serving` against our own server: a smoke test of both backends and both datasets."""

from __future__ import annotations

import json

from baby_sgl.bench.serving import main


def test_bench_serving_against_our_server(server, tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    common = ["--base-url", server, "--num-prompts", "6", "--random-input-min", "8", "--random-input-max", "40",
              "--random-output-min", "4", "--random-output-max", "8", "--gsp-num-groups", "2",
              "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "40", "--gsp-output-len", "4",
              "--output-file", str(out)]
    assert main(common + ["--backend", "sglang", "--dataset", "random", "--request-rate", "50"]) == 0
    assert main(common + ["--backend", "openai", "--dataset", "shared-prefix", "--max-concurrency", "2"]) == 0
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["completed"] == 6 and r["failed"] == 0 and r["output_token_throughput"] > 0 for r in runs)
    assert all(r["ttft_s"]["p50"] > 0 and r["tpot_s"]["mean"] > 0 and r["itl_s"]["p99"] > 0 for r in runs)
    assert 4 * 6 <= runs[0]["total_output_tokens"] <= 8 * 6 and runs[1]["total_output_tokens"] == 4 * 6
    # Groups share a system prompt: later prompts of a group read it from the radix cache.
    assert 0 < runs[1]["cached_input_tokens"] < runs[1]["total_input_tokens"]
    assert runs[1]["cache_hit_rate"] == runs[1]["cached_input_tokens"] / runs[1]["total_input_tokens"]
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_bench_serving_counts_failures(tmp_path):
    # Nothing listens on this port: every request fails, and the run says so instead of crashing.
    code = main(["--base-url", "http://127.0.0.1:9", "--num-prompts", "2", "--no-tokenizer", "--timeout", "2"])
    assert code == 1
