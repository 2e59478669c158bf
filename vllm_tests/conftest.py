"""Fixtures of the vLLM tests (run in .venv-vllm by scripts/test.sh): the default pair exported for vLLM once per
session, and vLLM without speculation as the baseline every law test compares with."""

from __future__ import annotations

import os

import pytest

# vLLM's multiprocessing spawns its engine processes; they must not inherit a pytest-sized thread count.
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    from diversed_ext.models.export import export_default_pair

    return export_default_pair(tmp_path_factory.mktemp("pair"), progress=False)


@pytest.fixture(scope="session")
def baseline(pair):
    """What vLLM without speculation emits: greedy continuations, and the law samples (see law_samples)."""
    from engines import start_engine, stop_engine
    from laws import greedy_tokens, law_samples

    llm = start_engine(pair, speculative=None)
    try:
        return {"greedy": greedy_tokens(llm), "law": law_samples(llm)}
    finally:
        stop_engine(llm)


VLLM_0_33 = "0.33.0"


@pytest.fixture(scope="session")
def vllm_0_33_source():
    """vLLM 0.33.0's Python source (the GPU release; no CPU build of it exists): its wheel downloaded once with
    ``pip download --no-deps`` and the files the plugin hooks unpacked into ~/.cache/diversed_ext; never installed."""
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    from diversed_ext.vllm_plugin.seams import SEAMS

    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "diversed_ext" / f"vllm-{VLLM_0_33}"
    files = sorted({relative for relative, _, _ in SEAMS})
    if not all((root / relative).is_file() for relative in files):
        wheels = root / "wheel"
        wheels.mkdir(parents=True, exist_ok=True)
        if not list(wheels.glob("vllm-*.whl")):
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--dest", str(wheels),
                            f"vllm=={VLLM_0_33}"], check=True)
        with zipfile.ZipFile(next(wheels.glob("vllm-*.whl"))) as wheel:
            for relative in files:
                wheel.extract(relative, root)
        for wheel_file in wheels.glob("vllm-*.whl"):  # 336 MB: only the extracted sources are kept
            wheel_file.unlink()
    return str(root)
