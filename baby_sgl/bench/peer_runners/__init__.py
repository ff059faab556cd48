"""Scripts run by the peers' own Python (never imported by baby-sgl): each reads a workload as
JSON, runs it on its engine and writes the timings and outputs as JSON (see bench/peers.py)."""
