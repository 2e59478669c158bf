"""diversed_ext: relaxed speculative decoding (DIVERSED) as fused CPU/CUDA PyTorch ops.

Public names:
    verify                   fused verification of draft blocks against nu = w p + (1 - w) q, from probabilities
    verify_logits            the same straight from logits, with temperature (0 = greedy row)
    token_stats              p(y), q(y), TV(p, q) and log-probabilities per position (what the trainer needs)
    mix                      nu materialised, from probabilities or logits
    distribution_features    entropies, largest probabilities and TV of both distributions per position (what a
                             DIVERSED head reads beside the hidden states), in DISTRIBUTION_FEATURES' order
    mixture_divergence       KL(nu_w || p) per position at a grid of weights w (what a loss on the divergence reads)
    verify_reference, verify_logits_reference, token_stats_reference, mix_reference, distribution_features_reference,
    mixture_divergence_reference
                             the same contracts in plain PyTorch (test oracles and benchmark baselines)
    VerifyResult, TokenStats result types
    philox_uniforms          the counter-based uniforms the kernels draw for a seed and offset
    cuda_kernels_registered  whether this build carries the CUDA kernels
    set_cuda_kernels, cuda_kernels
                             which CUDA verify kernels run ("auto", the default, "split" or "block"),
                             process-wide

Layout, one floor per folder, imports pointing down only:
    rules.py       the rule of each number a user gives and the defaults the floors share (no torch, no vLLM)
    ops/           the custom-op library (the names above)
    forward/       the lean CPU forward for Llama models (packed products, native layers, the runner, the int8 draft)
    models/        model pairs: the embedded default pair and its cache (its int8 draft made with forward's
                   quantisation), loading, export, the EAGLE-3 draft head
    head.py        the DIVERSED ensemble head (per-token weights from both models' hidden states)
    decoding/      the speculative decoding loop over Hugging Face models (SpeculativeDecoder)
    research/      tasks, the RL trainer, the evaluation harness, reports and plots
    cli/           the ``diversed`` command; nothing imports it
    vllm_plugin/   DIVERSED inside vLLM, loaded by vLLM through its entry point; nothing imports it
"""

from .ops import (DISTRIBUTION_FEATURES, TokenStats, VerifyResult, cuda_kernels, cuda_kernels_registered,
                  distribution_features, distribution_features_reference, mix, mix_reference, mixture_divergence,
                  mixture_divergence_reference, philox_uniforms, set_cuda_kernels, token_stats, token_stats_reference,
                  verify, verify_logits, verify_logits_reference, verify_reference)

__all__ = [
    "verify", "verify_logits", "token_stats", "mix", "distribution_features", "mixture_divergence",
    "verify_reference", "verify_logits_reference", "token_stats_reference", "mix_reference",
    "distribution_features_reference", "mixture_divergence_reference", "DISTRIBUTION_FEATURES",
    "VerifyResult", "TokenStats", "philox_uniforms", "cuda_kernels_registered", "set_cuda_kernels", "cuda_kernels",
]
__version__ = "0.1.0"
