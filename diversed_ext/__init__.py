"""diversed_ext: relaxed speculative decoding (DIVERSED) as fused CPU/CUDA PyTorch ops.

Public names:
    verify              fused verification of draft blocks against nu = w p + (1 - w) q (native custom op)
    verify_reference    the same contract in plain PyTorch (oracle and benchmark baseline)
    VerifyResult        (tokens, num_accepted, accept_prob)
    philox_uniforms     the counter-based uniforms the kernels draw for a seed and offset
    cuda_kernels_registered   whether this build carries the CUDA kernels
"""

from ._ops import cuda_kernels_registered
from ._philox import philox_uniforms
from .reference import verify_reference
from .types import VerifyResult
from .verify import verify

__all__ = ["verify", "verify_reference", "VerifyResult", "philox_uniforms", "cuda_kernels_registered"]
__version__ = "0.1.0"
