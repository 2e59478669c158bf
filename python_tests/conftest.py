"""pytest configuration: output poisoning for every native call, and the `device` fixture.

The builders the tests share are in helpers.py (`from helpers import ...`), not here.
"""

import os

# Every native call fills its outputs with garbage before computing, so an element a kernel forgets to write shows up
# as a mismatch against the reference. Set before any test module imports diversed_ext.
os.environ.setdefault("DIVERSED_POISON_OUTPUTS", "1")

import pytest  # noqa: E402

from helpers import requires_cuda  # noqa: E402

# "cuda" is always a parameter, so a machine without a GPU reports those tests as skipped (with the reason) rather
# than leaving them out silently.
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


@pytest.fixture(params=DEVICES)
def device(request):
    """The device an op test runs on: every test that takes `device` runs once on the CPU and once on CUDA."""
    return request.param


@pytest.fixture(scope="module")
def wide_pair():
    """The tiny random (target, draft) Llama pair with a 32-token vocabulary that the test_decoding_*.py files share;
    decoding_helpers (and so transformers) is imported only when a test asks for it."""
    from decoding_helpers import wide_pair_models

    return wide_pair_models()


@pytest.fixture(params=["block", "split"])
def cuda_kernels(request, monkeypatch):
    """Runs a CUDA test once per family of verify kernels (DIVERSED_CUDA_KERNELS, read at every call: "block" gives a
    request one thread block, "split" spreads its vocabulary over many); the CPU kernels ignore the variable."""
    monkeypatch.setenv("DIVERSED_CUDA_KERNELS", request.param)
    return request.param
