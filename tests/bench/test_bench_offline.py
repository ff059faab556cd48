"""Smoke test: the offline bench runs end to end on a tiny workload (benchmarks are not tests)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from baby_sgl.bench.offline_cli import main
from baby_sgl.bench.peers import _as_row
from baby_sgl.bench.workloads import Workload

pytestmark = pytest.mark.cpu_only("the bench measures the CPU's roofs and runs CPU peers")


def test_bench_offline_runs_each_workload(tiny_llama, tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    common = ["--model-path", tiny_llama, "--output-file", str(out), "--output-len", "4"]
    assert main(["--workload", "random", "--num-prompts", "4", "--input-min", "8", "--input-max", "16",
                 "--output-min", "2", "--output-max", "4", "--compare", "hf", *common]) == 0
    assert main(["--workload", "shared-prefix", "--groups", "2", "--prompts-per-group", "2", "--system-len", "32",
                 "--question-len", "4", *common]) == 0
    assert main(["--workload", "one-batch", "--batch", "2", "--input-len", "8", *common]) == 0
    assert main(["--workload", "random", "--num-prompts", "3", "--input-min", "8", "--input-max", "16",
                 "--output-min", "2", "--output-max", "4", "--dtype", "float32", "--compare", "float32", *common]) == 0
    reports = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["workload"] for r in reports] == ["random", "shared-prefix", "one-batch", "random"]
    same = reports[3]["results"][1]  # float32 against float32: the very same greedy outputs
    assert same["engine"] == "baby-sgl float32" and same["greedy_identical_frac"] == 1.0
    engines = [r["engine"] for r in reports[0]["results"]]
    assert engines[0] == "baby-sgl" and "transformers generate (static)" in engines
    assert all("error" not in r for r in reports[0]["results"]), reports[0]["results"]
    assert reports[1]["results"][0]["cache_hit_rate"] > 0.3
    assert reports[2]["results"][0]["decode_step_median_s"] > 0
    assert "roofs" in capsys.readouterr().out


def test_bench_offline_speculative_workloads(tiny_llama, tmp_path):
    """The copy and multi-turn chat workloads with n-gram drafts, next to plain decoding and to
    drafts from each request alone: float32, so all three give the same greedy outputs."""
    out = tmp_path / "bench.jsonl"
    common = ["--model-path", tiny_llama, "--output-file", str(out), "--dtype", "float32", "--output-len", "16",
              "--max-running-requests", "1", "--speculative-algorithm", "NGRAM"]
    assert main(["--workload", "copy", "--compare", "no-speculation", "request-only-drafts", *common]) == 0
    assert main(["--workload", "multi-turn", *common]) == 0
    copy, multi = [json.loads(line) for line in out.read_text().splitlines()]
    assert (copy["workload"], copy["num_prompts"], multi["workload"], multi["num_prompts"]) == ("copy", 4, "multi-turn", 12)
    rows = copy["results"]
    assert [r["engine"] for r in rows] == ["baby-sgl NGRAM", "baby-sgl no-speculation", "baby-sgl request-only-drafts"]
    assert rows[1]["greedy_identical_frac"] == 1.0 and rows[2]["greedy_identical_frac"] == 1.0
    assert "spec_accept_length" not in rows[1]


def test_a_peer_that_is_not_installed_says_how_to_install_it(tiny_llama, monkeypatch, tmp_path):
    monkeypatch.setattr("baby_sgl.bench.peers.PEERS_DIR", tmp_path)
    with pytest.raises(SystemExit, match="scripts/setup_peers.sh vllm"):
        main(["--model-path", tiny_llama, "--workload", "one-batch", "--batch", "1", "--input-len", "8",
              "--output-len", "2", "--compare", "vllm"])


def test_peer_results_become_rows_with_ratios_and_agreement():
    wl = Workload("one-batch", [[5, 6, 7]] * 2, [4, 4])
    base = {"outputs": [[1, 2, 3, 4], [1, 2, 3, 4]]}
    row = _as_row("peer", {"seconds": 2.0, "prefill_s": 0.5, "outputs": [[1, 2, 3, 4], [1, 2, 9, 9]]}, wl, base)
    assert row["output_tok_s"] == 4.0 and row["total_tok_s"] == 7.0 and row["greedy_identical_frac"] == 0.5
    assert row["decode_step_median_s"] == 0.5  # (2.0 - 0.5) / 3 later tokens


def test_rounds_alternate_the_engines_and_report_medians(tiny_llama, monkeypatch, tmp_path):
    """--rounds 3: baby-sgl and the peer take turns, and each row's figures are the medians of its
    rounds, with every round's own ratio (a peer recorded here: it need not be installed)."""
    from baby_sgl.bench import offline

    (tmp_path / "vllm" / "bin").mkdir(parents=True)
    (tmp_path / "vllm" / "bin" / "python").write_text("")
    monkeypatch.setattr("baby_sgl.bench.peers.PEERS_DIR", tmp_path)
    order, peer_seconds = [], iter([1.0, 40.0, 2.0] * 2)

    def peer_run(cmd, **_):
        order.append("vllm")
        spec = json.loads(Path(cmd[2]).read_text())
        seconds = next(peer_seconds)
        Path(cmd[3]).write_text(json.dumps({"seconds": seconds, "prefill_s": seconds / 10,
                                            "outputs": [[3] * n for n in spec["output_lens"]]}))
        return subprocess.CompletedProcess(cmd, 0)

    def own_run(engine, wl, *args, **kwargs):
        order.append("baby-sgl")
        return run_engine(engine, wl, *args, **kwargs)

    run_engine = offline.run_engine
    monkeypatch.setattr("baby_sgl.bench.peers.subprocess.run", peer_run)
    monkeypatch.setattr(offline, "run_engine", own_run)
    out = tmp_path / "bench.jsonl"
    assert main(["--model-path", tiny_llama, "--workload", "random", "--num-prompts", "2", "--input-min", "8",
                 "--input-max", "8", "--output-min", "4", "--output-max", "4", "--compare", "vllm", "--rounds", "3",
                 "--output-file", str(out)]) == 0
    assert order == ["baby-sgl", "vllm"] * 3
    ours, peer = json.loads(out.read_text())["results"]
    assert peer["seconds"] == 2.0 and peer["output_tok_s"] == 4.0 and peer["rounds"] == 3 == ours["rounds"]
    assert len(peer["round_ratios"]) == 3 and all(r > 0 for r in peer["round_ratios"])
    # The peer's slowest round (40 s) gives baby-sgl its best ratio of the three.
    assert max(peer["round_ratios"]) == peer["round_ratios"][1]
    assert [r["seconds"] for r in peer["round_rows"]] == [1.0, 40.0, 2.0] and len(ours["round_rows"]) == 3
    # One batch: each round's prefill against the peer's as well.
    assert main(["--model-path", tiny_llama, "--workload", "one-batch", "--input-len", "8", "--output-len", "4",
                 "--compare", "vllm", "--rounds", "3", "--output-file", str(out)]) == 0
    ours, peer = json.loads(out.read_text().splitlines()[1])["results"]
    assert peer["prefill_s"] == 0.2 and len(peer["round_prefill_ratios"]) == 3
    assert min(peer["round_prefill_ratios"]) == peer["round_prefill_ratios"][1]  # its prefill's slowest round
    with pytest.raises(SystemExit):
        main(["--model-path", tiny_llama, "--rounds", "0"])


def test_a_failed_round_leaves_the_medians_of_the_others():
    from baby_sgl.bench.offline import median_of_rounds

    rows = [{"engine": "peer", "seconds": 1.0}, {"engine": "peer", "error": "it crashed"},
            {"engine": "peer", "seconds": 4.0}]
    merged = median_of_rounds(rows)
    assert merged["seconds"] == 2.5 and merged["rounds"] == 3 and merged["round_rows"][1]["error"] == "it crashed"
