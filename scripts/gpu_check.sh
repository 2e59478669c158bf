#!/usr/bin/env bash
# Everything the CUDA kernels need checked on a GPU machine, in one go, from the checkout:
#   1. environment  nvidia-smi, torch, nvcc, compute-sanitizer, ncu
#   2. build        the extension with this machine's python3 and torch (DIVERSED_CUDA=1, no build isolation)
#   3. bench        the benchmark kit's bench_vs_flashinfer.py (side by side with FlashInfer), once per kernel family
#   4. ops-tests    the CUDA tests of the ops and the package (pytest -k cuda): the verify kernels' tests for both
#                   kernel families (the `device` fixture's "cuda" and "cuda-block")
#   5. loop-tests   the other CUDA tests: the decoding loop and the trainer on CUDA (a round's host syncs counted)
#   6. sanitizers   compute-sanitizer memcheck, racecheck, synccheck and initcheck over scripts/gpu_hostile_inputs.py
#   7. profile      ncu's speed-of-light and occupancy of both families at B = 64, K = 8, V = 128256
# Each step writes REPORT_DIR/<step>.log; REPORT_DIR/summary.md gives each step's status and time. A failing step is
# reported and the later steps still run (except after a failed build). Exit status: 0 when every step passed, 1
# when one failed, 2 for a usage error or a machine without a GPU. Every step has a time limit, so a hung kernel fails
# its step instead of stalling the check. Steps can run separately (--only); the build stays installed between runs.
# The check writes nothing outside REPORT_DIR (its temporary files included) and the installed build.
# The check comes in two parts of one call each, the most important figures first: part 1 (about 5 minutes on an
# H100 machine) builds, runs the bench and the ops' CUDA tests; part 2 (about 3) the loop's and trainer's CUDA tests,
# the sanitizers and the profile, building first only where no build is installed.
#
#   scripts/gpu_check.sh REPORT_DIR [--kit DIR] [--part 1|2 | --only STEPS] [--dry-run]
#     --kit DIR     the benchmark kit's folder (bench_vs_flashinfer.py, fi_bind.cu, fi_include/); the bench step
#                   needs it
#     --part N      part 1: build,bench,ops-tests; part 2: build (when missing),loop-tests,sanitizers,profile
#     --only STEPS  a comma-separated subset of: build,ops-tests,loop-tests,sanitizers,bench,profile (the environment
#                   always runs)
#     --dry-run     checks the prerequisites it can and prints each step's command without running it (any machine)
set -uo pipefail
cd "$(dirname "$0")/.."
checkout="$PWD"

usage() {
  echo "usage: scripts/gpu_check.sh REPORT_DIR [--kit DIR] [--part 1|2 | --only STEPS] [--dry-run]" >&2
  exit 2
}
[ $# -ge 1 ] || usage
report="$1"; shift
kit=; only=build,ops-tests,loop-tests,sanitizers,bench,profile; dry_run=0; build_if_missing=0
while [ $# -gt 0 ]; do
  case "$1" in
    --kit) [ $# -ge 2 ] || usage; kit="$2"; shift 2 ;;
    --part)
      [ $# -ge 2 ] || usage
      case "$2" in
        1) only=build,bench,ops-tests ;;
        2) only=build,loop-tests,sanitizers,profile; build_if_missing=1 ;;
        *) echo "gpu_check: --part is 1 or 2, got '$2'" >&2; exit 2 ;;
      esac
      shift 2 ;;
    --only) [ $# -ge 2 ] || usage; only="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    *) usage ;;
  esac
done
for step in ${only//,/ }; do
  case "$step" in
    build|ops-tests|loop-tests|sanitizers|bench|profile) ;;
    *) echo "gpu_check: unknown step '$step'" >&2; exit 2 ;;
  esac
done
wants() { [[ ",$only," == *",$1,"* ]]; }
if wants bench && [ -z "$kit" ]; then
  echo "gpu_check: the bench step needs --kit DIR, the benchmark kit's folder (or leave bench out with --only)" >&2
  exit 2
fi
mkdir -p "$report" || { echo "gpu_check: cannot create the report folder $report" >&2; exit 2; }
report="$(cd "$report" && pwd)"
[ -z "$kit" ] || kit="$(cd "$kit" 2>/dev/null && pwd || echo "$kit")"

python=${PYTHON:-python3}
# Temporary files (pip's build folder, pytest's tmp_path) stay inside the report folder, and are removed at the end.
mkdir -p "$report/tmp"
trap 'rm -rf "$report/tmp"' EXIT
export MAX_JOBS=${MAX_JOBS:-$(nproc)} DIVERSED_CUDA=1 PYTHONDONTWRITEBYTECODE=1 TMPDIR="$report/tmp"
summary="$report/summary.md"
commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
printf '# gpu_check of %s\n\n| step | status | seconds |\n|---|---|---:|\n' "$commit" > "$summary"
failures=0

# run NAME LIMIT_SECONDS COMMAND...: from the report folder, so that `import diversed_ext` finds the installed build
# rather than the source tree; the output goes to REPORT_DIR/NAME.log.
run() {
  local name="$1" limit="$2"; shift 2
  if [ "$dry_run" = 1 ]; then
    echo "[dry-run] $name (at most ${limit}s): $*"
    echo "| $name | dry run | 0 |" >> "$summary"
    return 0
  fi
  echo "== $name" >&2
  local start=$SECONDS status
  (cd "$report" && timeout --kill-after=10 "$limit" "$@") > "$report/$name.log" 2>&1
  status=$?
  local verdict=passed
  if [ $status -eq 124 ] || [ $status -eq 137 ]; then verdict="timed out after ${limit}s"; fi
  if [ $status -ne 0 ] && [ "$verdict" = passed ]; then verdict="failed (exit $status)"; fi
  [ $status -eq 0 ] || failures=$((failures + 1))
  echo "| $name | $verdict | $((SECONDS - start)) |" >> "$summary"
  echo "   $verdict; log: $report/$name.log" >&2
  return $status
}

# 1. The machine. Without a GPU nothing else can run: say so and stop, rather than wait on a device that is not there.
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
      'gpus', torch.cuda.device_count())" 2>&1
  "$python" -c "import transformers, scipy; print('transformers', transformers.__version__,
      'scipy', scipy.__version__)" 2>&1 || echo "without transformers and scipy the loop's and trainer's CUDA tests skip"
  for tool in nvcc compute-sanitizer ncu; do printf '%s: %s\n' "$tool" "$(command -v "$tool" || echo missing)"; done
} > "$report/environment.log"
gpus=$("$python" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$dry_run" = 0 ] && [ "${gpus:-0}" -lt 1 ]; then
  echo "| environment | no GPU visible to $python's torch (see environment.log) | 0 |" >> "$summary"
  echo "gpu_check: no GPU visible to $python's torch; nothing was run (details: $report/environment.log)" >&2
  exit 2
fi
echo "| environment | ${gpus:-0} GPU(s) | 0 |" >> "$summary"
if wants bench && [ ! -f "$kit/bench_vs_flashinfer.py" ]; then
  echo "gpu_check: the GPU kit is not at $kit (bench_vs_flashinfer.py missing; see --kit)" >&2
  exit 2
fi

# 2. Build with this machine's torch; nothing else can run without it. Part 2 keeps the build part 1 installed.
installed() {
  (cd "$report" && "$python" -c "import diversed_ext, sys; sys.exit(not diversed_ext.cuda_kernels_registered())") \
    2>/dev/null
}
if wants build && [ "$build_if_missing" = 1 ] && [ "$dry_run" = 0 ] && installed; then
  echo "| build | already installed | 0 |" >> "$summary"
elif wants build; then
  run build 300 "$python" -m pip install -q --no-build-isolation --no-deps "$checkout" || {
    echo "gpu_check: the build failed; see $report/build.log" >&2
    exit 1
  }
fi

# 3. Side by side with FlashInfer, once per family (the kit writes its CSV to $OUT); the first also compiles
# FlashInfer's kernels (about a minute).
if wants bench; then
  for family in block split; do
    mkdir -p "$report/bench-$family"
    limit=120; [ "$family" = block ] && limit=180
    run "bench-$family" "$limit" env OUT="$report/bench-$family" "$python" -c \
      "import runpy, sys, diversed_ext; diversed_ext.set_cuda_kernels(sys.argv[1]); sys.argv = sys.argv[2:]; \
runpy.run_path(sys.argv[0], run_name='__main__')" "$family" "$kit/bench_vs_flashinfer.py"
  done
fi

# 4-5. The CUDA tests: every test id with "cuda" in it (the `device` fixture's cuda parameters, the verify kernels'
# tests once per kernel family through the cuda_kernels fixture, the CUDA-only tests); the ops' and the package's
# first, the rest (the loop's and the trainer's, which need transformers and scipy: see environment.log) second.
ops_tests=("$checkout/python_tests/ops" "$checkout/python_tests/package")
if wants ops-tests; then
  run ops-tests 240 env DIVERSED_EXPECT_CUDA_BUILD=1 \
    "$python" -m pytest -q -p no:cacheprovider -k cuda "${ops_tests[@]}"
fi
if wants loop-tests; then
  run loop-tests 150 env DIVERSED_EXPECT_CUDA_BUILD=1 \
    "$python" -m pytest -q -p no:cacheprovider -k cuda "$checkout/python_tests" \
    --ignore="${ops_tests[0]}" --ignore="${ops_tests[1]}"
fi

# 6. The four sanitizer tools over hostile unchecked inputs (both families inside the script); --quick keeps the
# slow tools (racecheck, initcheck) within a minute or two.
if wants sanitizers; then
  for tool in memcheck racecheck synccheck initcheck; do
    quick=--quick; [ "$tool" = memcheck ] && quick=
    run "sanitizer-$tool" 90 compute-sanitizer --tool "$tool" --error-exitcode 3 \
      "$python" "$checkout/scripts/gpu_hostile_inputs.py" $quick
  done
fi

# 7. Where the time goes: ncu on the verify kernels of both families at the kit's B = 64, K = 8, V = 128256 shape.
if wants profile; then
  for family in block split; do
    run "profile-$family" 90 ncu --kernel-name "regex:verify|softmax_partials" \
      --launch-skip 8 --launch-count 6 --section SpeedOfLight --section Occupancy --section LaunchStats \
      "$python" "$checkout/bench/bench_verify.py" --ops verify verify_logits --batch 64 --draft 8 --vocab 128256 \
      --dtype float32 --device cuda --cuda-kernels "$family" --csv "$report/profile-$family.csv"
  done
fi

echo "gpu_check: $failures step(s) failed; summary: $summary" >&2
cat "$summary"
[ "$failures" = 0 ]
