"""Benchmarks: `baby-sgl bench offline` (offline_cli.py its options, offline.py: the engine on a fixed workload, beside
transformers or another engine on the same prompts: hf_baseline.py, peers.py) and `baby-sgl bench
serving` (serving.py: a load test of a running server). The repository's measuring scripts
(scripts/benchmarks.py, profile_step.py, moe_bench.py, dashboard_cost.py) run on top of these
and of the engine."""
