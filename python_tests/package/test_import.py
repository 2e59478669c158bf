"""The package imports first thing in a fresh interpreter: whatever loads the native library loads torch's first."""

import subprocess
import sys


def test_import_diversed_ext_alone():
    code = "import diversed_ext as dx; print(dx.cuda_kernels(), dx.cuda_kernels_registered() in (True, False))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["auto", "True"]
