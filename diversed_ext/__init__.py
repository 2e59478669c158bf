"""diversed_ext: relaxed speculative decoding (DIVERSED) as fused CPU/CUDA PyTorch ops.

Public names:
    verify                   fused verification of draft blocks against nu = w p + (1 - w) q, from probabilities
    verify_logits            the same straight from logits, with temperature (0 = greedy row)
    token_stats              p(y), q(y), TV(p, q) and log-probabilities per position (what the trainer needs)
    mix                      nu materialised, from probabilities or logits
    verify_reference, verify_logits_reference, token_stats_reference, mix_reference
                             the same contracts in plain PyTorch (test oracles and benchmark baselines)
    VerifyResult, TokenStats result types
    philox_uniforms          the counter-based uniforms the kernels draw for a seed and offset
    cuda_kernels_registered  whether this build carries the CUDA kernels
"""

from ._ops import cuda_kernels_registered
from ._philox import philox_uniforms
from .logits import TokenStats, mix, token_stats, verify_logits
from .reference import mix_reference, token_stats_reference, verify_logits_reference, verify_reference
from .types import VerifyResult
from .verify import verify

__all__ = [
    "verify", "verify_logits", "token_stats", "mix",
    "verify_reference", "verify_logits_reference", "token_stats_reference", "mix_reference",
    "VerifyResult", "TokenStats", "philox_uniforms", "cuda_kernels_registered",
]
__version__ = "0.1.0"
