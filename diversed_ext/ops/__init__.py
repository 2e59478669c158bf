"""The custom-op library: fused DIVERSED verification, token statistics, the mixture, the distribution features
of a DIVERSED head and the log-probability gate's statistics, CPU and CUDA; the mixture's divergence from the target
over a grid of weights, CPU.

``api`` holds the public ops and their result types; ``_inputs`` every argument check and normalisation, one
function per argument (the temperature's is in ``_temperature``, with the greedy threshold; the row indices' in
``_rows``, with position_rows, which builds them; the pair ops' in ``_pair_inputs``), and ``_prepare`` applies them
to a verify call; ``_values`` checks the values a call reads; ``_unchecked`` decides whether an unchecked call's
arguments go to the op as given; ``_fake`` loads the native library and registers the shape-only kernels that
``torch.compile`` and ``opcheck`` need (and the ops' output layouts, DISTRIBUTION_FEATURES); ``_cuda_family`` which
CUDA verify kernels run; ``_fly`` FLy's argument rules and the references' deferral (fly_entropy); ``_divergence`` is
mixture_divergence in torch ops (its reference, and its path off the CPU; grid_weights, its table's weights);
``_philox`` reproduces the kernels' random numbers; ``gate`` is the log-probability gate's test (its fused statistics
op, gate_statistics, and the same test in plain PyTorch); ``reference`` states the same contracts in plain PyTorch
(the test oracle and a benchmark baseline) and the target's support (MIN_TARGET_MASS, target_forbids: the
constraints a server's logits processing sets are kept whatever the weight). Of the rest of the package only
:mod:`diversed_ext.rules` is imported here (each number's rule and the defaults the floors share); no floor is.
"""

from ._cuda_family import CUDA_KERNEL_FAMILIES, cuda_kernels, set_cuda_kernels
from ._divergence import grid_weights
from ._fake import DISTRIBUTION_FEATURES, cuda_kernels_registered
from ._fly import fly_entropy
from ._inputs import PROB_DTYPES
from .gate import GateStatistics, gate_keeps, gate_keeps_logits, gate_statistics, gate_statistics_reference
from ._temperature import MIN_TEMPERATURE, distribution_temperature, is_greedy_temperature
from ._philox import philox_uniforms
from ._rows import position_rows
from .api import (TokenStats, VerifyResult, distribution_features, mix, mixture_divergence, token_stats, verify,
                  verify_logits)
from ._values import MIN_TARGET_MASS
from .reference import (distribution_features_reference, mix_reference, mixture_divergence_reference, target_forbids,
                        token_stats_reference, verify_logits_reference, verify_reference)

__all__ = [
    "verify", "verify_logits", "token_stats", "mix", "distribution_features", "mixture_divergence",
    "verify_reference", "verify_logits_reference", "token_stats_reference", "mix_reference",
    "mixture_divergence_reference",
    "distribution_features_reference", "DISTRIBUTION_FEATURES", "VerifyResult", "TokenStats", "philox_uniforms",
    "cuda_kernels_registered", "set_cuda_kernels", "cuda_kernels", "CUDA_KERNEL_FAMILIES", "gate_keeps",
    "gate_keeps_logits", "gate_statistics", "gate_statistics_reference", "GateStatistics",
    "MIN_TARGET_MASS", "target_forbids", "PROB_DTYPES", "position_rows",
    "MIN_TEMPERATURE", "is_greedy_temperature", "distribution_temperature", "fly_entropy", "grid_weights",
]
