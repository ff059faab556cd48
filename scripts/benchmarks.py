"""Runs the benchmark suite and writes its table into docs/benchmarks.md.

    bash scripts/setup_peers.sh             # once: vLLM's CPU engine and llama.cpp, each in its venv
    python scripts/benchmarks.py            # the runs below, SmolLM2-135M, this machine's threads

Every row is one `baby-sgl bench offline` run; ratios are taken within a run.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANDOM = "--workload random --num-prompts 32 --input-min 32 --input-max 256 --output-min 64 --output-max 128"
SHARED = "--workload shared-prefix --groups 4 --prompts-per-group 4 --system-len 512 --question-len 32 --output-len 32"
SHARED_8X8 = "--workload shared-prefix --groups 8 --prompts-per-group 8 --system-len 1024 --question-len 64 --output-len 64"
RUNS = [
    ("random, 32 prompts, in 32-256, out 64-128, bfloat16", f"{RANDOM} --dtype bfloat16 --compare vllm"),
    ("random, 32 prompts, in 32-256, out 64-128, float32", f"{RANDOM} --dtype float32 --compare vllm"),
    ("random, 32 prompts, in 32-256, out 64-128, float32, vs transformers", f"{RANDOM} --dtype float32 --compare hf"),
    ("shared-prefix 4x4, 512-token system prompt, 32-token question, out 32, bfloat16",
     f"{SHARED} --dtype bfloat16 --compare vllm"),
    ("one-batch B=1, in 128, out 64, bfloat16", "--workload one-batch --batch 1 --input-len 128 --output-len 64 "
     "--dtype bfloat16 --compare llama.cpp"),
    ("shared-prefix 8x8, 1024-token system prompt, 64-token question, radix cache, bfloat16",
     f"{SHARED_8X8} --dtype bfloat16"),
    ("shared-prefix 8x8, 1024-token system prompt, 64-token question, --disable-radix-cache, bfloat16",
     f"{SHARED_8X8} --dtype bfloat16 --disable-radix-cache"),
    ("one-batch B=1, in 1000, out 16 (TTFT of a 1000-token prompt), bfloat16",
     "--workload one-batch --batch 1 --input-len 1000 --output-len 16 --dtype bfloat16 --compare vllm"),
    ("random, 32 prompts, in 32-256, out 64-128, bfloat16, then each under a JSON schema",
     f"{RANDOM} --dtype bfloat16 --compare json-schema"),
]


def run_all() -> list[tuple[str, str, dict]]:
    rows = []
    for title, flags in RUNS:
        with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
            out = f.name
        cmd = f"baby-sgl bench offline {flags}"
        print(f"$ {cmd}", flush=True)
        subprocess.run([sys.executable, "-m", "baby_sgl.cli", "bench", "offline", *flags.split(), "--output-file", out],
                       check=True)
        rows.append((title, cmd, json.loads(Path(out).read_text().splitlines()[-1])))
        os.unlink(out)
    return rows


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render(rows: list[tuple[str, str, dict]]) -> str:
    roofs = rows[0][2]["roofs"]
    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch threads {rows[0][2]['threads']}, "
        f"{rows[0][2]['dtype']}. Measured roofs: matmul {roofs['gflops']:.0f} GFLOP/s "
        f"({roofs['compute_roof_tok_s']:.0f} tok/s at {roofs['gflop_per_token']:.2f} GFLOP/token), "
        f"memory read {roofs['read_gb_s']:.1f} GB/s (batch-1 decode step >= "
        f"{roofs['bandwidth_roof_step_s'] * 1e3:.1f} ms).",
        "",
        "| workload | engine | output tok/s | total tok/s | cache hit | TTFT / prefill s | decode step ms | "
        "vs baby-sgl | of roof | peak RSS / budget MB | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for title, _, rep in rows:
        base = rep["results"][0]
        for r in rep["results"]:
            if "error" in r:
                lines.append(f"| {title} | {r['engine']} | failed: {r['error'][:60]} | | | | | | | | |")
                continue
            ratio = "" if r is base else f"{base['output_tok_s'] / r['output_tok_s']:.2f}x"
            ttft = r.get("ttft_mean_s", r.get("prefill_s"))
            step = r.get("decode_step_median_s")
            roof = ""
            if "compute_roof_fraction" in r:
                roof = f"{r['compute_roof_fraction']:.0%} of compute"
            elif "bandwidth_roof_ratio" in r:
                roof = f"{r['bandwidth_roof_ratio']:.2f}x bandwidth bound"
            rss = f"{rep['peak_rss_mb']:.0f} / {rep['memory']['budget_mb']:.0f}" if r is base else ""
            notes = []
            if "greedy_identical_frac" in r:
                notes.append(f"greedy outputs identical to {base['engine']}: {r['greedy_identical_frac']:.0%} of requests")
            if "greedy_agree_prefix_frac" in r:
                notes.append(f"{r['greedy_agree_prefix_frac']:.0%} of tokens agree before the first difference")
            if "closed_by_grammar" in r:
                notes.append(f"outputs the grammar closed before the length limit: {r['closed_by_grammar']}")
            if "prefill_tok_s" in r:
                notes.append(f"prefill {r['prefill_tok_s']:.0f} tok/s, {r['prefill_roof_fraction']:.0%} of the matmul roof")
            if r is not base and step and base.get("decode_step_median_s"):
                notes.append(f"decode step ratio (theirs / ours): {step / base['decode_step_median_s']:.2f}x")
            notes = "; ".join(notes)
            lines.append(f"| {title} | {r['engine']} | {fmt(r.get('output_tok_s'))} | {fmt(r.get('total_tok_s'))} | "
                         f"{fmt(r.get('cache_hit_rate'), 2)} | {fmt(ttft, 2)} | {fmt(step and step * 1e3)} | {ratio} | "
                         f"{roof} | {rss} | {notes} |")
    lines += ["", "Commands (each row group is one run):", "", "```bash"]
    lines += [cmd for _, cmd, _ in rows] + ["```"]
    return "\n".join(lines) + "\n"


def replace_block(path: Path, table: str) -> None:
    """Rewrites only what stands between the bench markers; the rest of the file is kept."""
    block = f"<!-- bench:start -->\n{table}<!-- bench:end -->"
    text = path.read_text()
    assert "<!-- bench:start -->" in text, f"{path} has no bench markers"
    path.write_text(re.sub(r"<!-- bench:start -->.*<!-- bench:end -->", lambda _: block, text, flags=re.S))


def main() -> None:
    table = render(run_all())
    replace_block(ROOT / "docs" / "benchmarks.md", table)
    print(table)


if __name__ == "__main__":
    main()
