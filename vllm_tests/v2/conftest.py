"""The V2 tests run vLLM's V2 model runner on the CPU under Triton's interpreter: ``TRITON_INTERPRET=1`` must be set
before the interpreter starts (``scripts/test.sh`` does), so that the venv's start-up hook applies
``vllm_tests/triton_on_cpu.py`` in this process and in every process vLLM spawns."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # vllm_tests/: engines, laws
# One thread per vLLM process: on 2 cores the interpreter's engines run matrix products several times slower with more.
os.environ["OMP_NUM_THREADS"] = "1"


def pytest_configure(config):
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise pytest.UsageError("the V2 tests need TRITON_INTERPRET=1 (see vllm_tests/triton_on_cpu.py)")
    # the interpreter evaluates both sides of tl.where with numpy, which warns on the side that is masked out
    config.addinivalue_line("filterwarnings", "ignore::RuntimeWarning")


@pytest.fixture(scope="session")
def v2_greedy(pair):
    """The greedy continuations of V2 without speculation (``V2_GREEDY``), from one engine shared by every test."""
    from engines import V2_ARGS, V2_GREEDY, start_engine, stop_engine
    from laws import greedy_tokens

    plain = start_engine(pair, speculative=None, **V2_ARGS)
    try:
        return greedy_tokens(plain, **V2_GREEDY)
    finally:
        stop_engine(plain)
