"""Which CUDA verify kernels the ops run on CUDA tensors: one process-wide choice, made here and read by the native
library at every call (``csrc/common/kernel_family.h``).

- ``"block"``: one thread block per request, which reads the request's rows whole; runs FLy.
- ``"split"``: each request's vocabulary spread over many blocks (about four per multiprocessor of the device); faster
  than ``"block"`` at every shape measured on an H100, most for few requests over large vocabularies; refuses FLy.
- ``"auto"`` (the default): ``"split"``, and ``"block"`` for a call that asks for FLy.

Both give the same results up to the order of float64 sums. The CPU kernels ignore the choice.
"""

from __future__ import annotations

import torch  # noqa: F401  (torch's libraries first: the native library links against them)

from .. import _C

CUDA_KERNEL_FAMILIES = ("block", "split", "auto")  # in the native library's order


def set_cuda_kernels(family: str) -> None:
    """Run the CUDA verify kernels of ``family`` (one of :data:`CUDA_KERNEL_FAMILIES`) from the next call on, in
    every thread of this process."""
    if family not in CUDA_KERNEL_FAMILIES:
        raise ValueError(f"CUDA kernel family must be one of {', '.join(CUDA_KERNEL_FAMILIES)}, got {family!r}")
    _C.set_cuda_kernel_family(CUDA_KERNEL_FAMILIES.index(family))


def cuda_kernels() -> str:
    """The family of CUDA verify kernels the ops run now (see :func:`set_cuda_kernels`)."""
    return CUDA_KERNEL_FAMILIES[_C.cuda_kernel_family()]
