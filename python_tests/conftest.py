"""pytest configuration: output poisoning for every native call, and the `device` fixture.

The builders the tests share are in the helpers package (`from helpers import ...`), not here; the fixtures below are
the model pairs several test files share, each built once per test module, and `no_models`, which fails a command
that gets as far as loading models.
"""

import contextlib
import os

# Every native call fills its outputs with garbage before computing, so an element a kernel forgets to write shows up
# as a mismatch against the reference. Set before any test module imports diversed_ext.
os.environ.setdefault("DIVERSED_POISON_OUTPUTS", "1")

import pytest  # noqa: E402

from helpers import refuse_models, requires_cuda  # noqa: E402

# The CUDA parameters are always there, so a machine without a GPU reports those tests as skipped (with the reason)
# rather than leaving them out silently. "cuda" runs the default family ("auto": the split kernels, the block ones for
# FLy), "cuda-block" the block kernels, which a server verifying with FLy runs.
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda), pytest.param("cuda-block", marks=requires_cuda)]


@pytest.fixture(params=DEVICES)
def device(request):
    """The device an op test runs on ("cpu" or "cuda"): every test that takes `device` runs on the CPU and on CUDA
    with each family of verify kernels, the default family restored after."""
    if request.param != "cuda-block":
        yield request.param
        return
    with cuda_kernel_family("block"):
        yield "cuda"


@pytest.fixture(scope="module")
def wide_pair():
    """The tiny random (target, draft) Llama pair with a 32-token vocabulary that the decoding tests share;
    transformers is imported only when a test asks for it."""
    from helpers import wide_pair_models

    return wide_pair_models()


@pytest.fixture(scope="module")
def small_pair():
    """The tiny random pair with a 4-token vocabulary, for the tests against exact output laws."""
    from helpers import small_pair_models

    return small_pair_models()


@pytest.fixture(scope="module")
def double_pair():
    """The wide pair in float64, for the tests that compare batched and lone decoding token for token."""
    from helpers import double_pair_models

    return double_pair_models()


@pytest.fixture(scope="module")
def experiment_pair():
    """(target, draft, tokenizer): a tiny random Llama pair and a character tokenizer, for the experiment functions."""
    from helpers import experiment_pair_models

    return experiment_pair_models()


@pytest.fixture(params=["block", "split"])
def cuda_kernels(request):
    """Runs a CUDA test once per family of verify kernels (diversed_ext.set_cuda_kernels: "block" gives a request one
    thread block, "split" spreads its vocabulary over many), the default ("auto") restored after; the CPU kernels
    ignore it."""
    with cuda_kernel_family(request.param):
        yield request.param


@contextlib.contextmanager
def cuda_kernel_family(family: str):
    """The CUDA verify kernels of ``family`` inside, the default ("auto") restored after."""
    import diversed_ext

    diversed_ext.set_cuda_kernels(family)
    try:
        yield
    finally:
        diversed_ext.set_cuda_kernels("auto")


@pytest.fixture
def no_models(monkeypatch):
    """Fails the test if a command gets as far as loading models: every check of its arguments must come first."""
    refuse_models(monkeypatch)
