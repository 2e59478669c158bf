"""The GPU check script (scripts/gpu_check.sh) and its hostile-input driver, as far as a machine without a GPU can run
them: the dry run, the clear refusal without a GPU (it must never wait on a device that is not there), usage errors,
that it writes nothing outside its report folder, and the hostile inputs on the CPU kernels."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO_ROOT as ROOT
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STEPS = ["build", "ops-tests", "loop-tests", "sanitizer-memcheck", "sanitizer-racecheck", "sanitizer-synccheck",
         "sanitizer-initcheck", "bench-block", "bench-split", "profile-block", "profile-split"]


def gpu_check(tmp_path, *args, kit=True):
    environment = dict(os.environ, PYTHON=sys.executable)
    kit_args = ["--kit", str(tmp_path / "kit")] if kit else []
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "report"), *kit_args, *args],
                          capture_output=True, text=True, timeout=120, env=environment)


def _tree(root: Path) -> set:
    """Every path below ``root`` (a .git file or folder included), with its modification time."""
    return {(str(path), path.stat().st_mtime_ns) for path in root.rglob("*") if path.exists()}


def test_dry_run_lists_every_step(tmp_path):
    (tmp_path / "kit").mkdir()
    (tmp_path / "kit" / "bench_vs_flashinfer.py").write_text("")
    result = gpu_check(tmp_path, "--dry-run")
    assert result.returncode == 0, result.stderr
    for step in STEPS:
        assert f"[dry-run] {step} " in result.stdout
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert all(f"| {step} | dry run |" in summary for step in STEPS)
    assert "compute-sanitizer --tool racecheck" in result.stdout and "--cuda-kernels split" in result.stdout


def test_the_kit_is_an_argument_the_bench_step_needs(tmp_path):
    result = gpu_check(tmp_path, "--dry-run", kit=False)
    assert result.returncode == 2 and "--kit DIR" in result.stderr
    result = gpu_check(tmp_path, "--dry-run", "--only", "build,ops-tests,sanitizers,profile", kit=False)
    assert result.returncode == 0, result.stderr
    assert "[dry-run] ops-tests " in result.stdout and "bench-block" not in result.stdout
    assert "loop-tests" not in result.stdout


def _dry_run_steps(stdout: str) -> list:
    return [line.split()[1] for line in stdout.splitlines() if line.startswith("[dry-run] ")]


def test_the_two_parts_run_every_step_once_the_bench_in_the_first(tmp_path):
    (tmp_path / "kit").mkdir()
    (tmp_path / "kit" / "bench_vs_flashinfer.py").write_text("")
    first = gpu_check(tmp_path, "--dry-run", "--part", "1")
    second = gpu_check(tmp_path, "--dry-run", "--part", "2", kit=False)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    first_steps, second_steps = _dry_run_steps(first.stdout), _dry_run_steps(second.stdout)
    assert first_steps == ["build", "bench-block", "bench-split", "ops-tests"]
    assert second_steps[1:] == [step for step in STEPS if step not in first_steps]
    # Part 2 builds only where part 1's build is not installed (a fresh machine between the parts).
    assert second_steps[0] == "build"
    assert "--ignore=" in second.stdout and "python_tests/ops" in second.stdout
    assert gpu_check(tmp_path, "--dry-run", "--part", "3").returncode == 2


def test_it_writes_nothing_outside_its_report_folder(tmp_path):
    (tmp_path / "kit").mkdir()
    (tmp_path / "kit" / "bench_vs_flashinfer.py").write_text("")
    before = _tree(ROOT / "scripts") | _tree(ROOT / "python_tests")
    git_dir = Path(subprocess.run(["git", "rev-parse", "--git-dir"], capture_output=True, text=True,
                                  cwd=ROOT).stdout.strip() or ROOT / ".git")
    git_dir = git_dir if git_dir.is_absolute() else ROOT / git_dir
    exclude = git_dir / "info" / "exclude"
    excluded = exclude.read_text() if exclude.exists() else None
    result = gpu_check(tmp_path, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert _tree(ROOT / "scripts") | _tree(ROOT / "python_tests") == before
    assert (exclude.read_text() if exclude.exists() else None) == excluded
    assert not (ROOT / ".gpu-kit").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["kit", "report"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU, so the script would run for real")
def test_without_a_gpu_it_stops_at_once_with_the_reason(tmp_path):
    result = gpu_check(tmp_path, "--only", "ops-tests")
    assert result.returncode == 2
    assert "no GPU visible" in result.stderr
    assert "no GPU visible" in (tmp_path / "report" / "summary.md").read_text()
    assert not (tmp_path / "report" / "ops-tests.log").exists()


@pytest.mark.parametrize("args,message", [((), "usage"), (("--only", "ops-tests,lint"), "unknown step 'lint'"),
                                          (("--kit",), "usage")])
def test_usage_errors(tmp_path, args, message):
    if args:
        result = gpu_check(tmp_path, *args)
    else:
        result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr


def test_hostile_inputs_run_on_the_cpu_kernels():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_hostile_inputs.py"), "--device", "cpu",
                             "--quick"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "block kernels done" in result.stdout and "split kernels done" in result.stdout
