"""Fixtures of the vLLM tests (run in .venv-vllm by scripts/test.sh): the default pair exported for vLLM once per
session, and vLLM without speculation as the baseline every law test compares with."""

from __future__ import annotations

import os
import tempfile

import pytest

# vLLM's multiprocessing spawns its engine processes; they must not inherit a pytest-sized thread count.
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


@pytest.fixture(scope="session", autouse=True)
def engine_files():
    """vLLM's engines leave files in the temporary folder when they stop: the IPC sockets they talk over and the file
    each worker's process group starts from. Here the sockets, and everything the processes vLLM starts put in their
    temporary folder, go to a folder of the session's own, removed at its end, instead of piling up in /tmp. The
    compiled kernels torch caches there stay where torch keeps them, shared with later runs."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    with tempfile.TemporaryDirectory(prefix="vllm-engines-") as folder, pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", cache_dir())  # what it is now, before the temporary folder moves
        patch.setenv("VLLM_RPC_BASE_PATH", folder)
        patch.setenv("TMPDIR", folder)  # read by each process vLLM spawns (this one has chosen its folder already)
        yield folder


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
    ``pip download --no-deps`` and its ``vllm/**.py`` unpacked into ~/.cache/diversed_ext (scripts/vllm_source.py);
    never installed."""
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "vllm_source.py"
    return runpy.run_path(str(script))["fetch_source"](VLLM_0_33)
