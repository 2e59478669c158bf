"""Loads the native library and registers the fake (meta) kernels of the ``diversed`` ops.

The fake kernels give output shapes and dtypes without data, which is what ``torch.compile`` and
``torch.library.opcheck`` need.
"""

from __future__ import annotations

import torch

from .. import _C  # noqa: F401  (loading the library registers the schemas and the CPU/CUDA kernels)


OP_NAMES = ("verify_probs", "verify_logits", "token_stats", "mix")


def cuda_kernels_registered() -> bool:
    """True when this build registered a CUDA kernel for every ``diversed`` op (a CUDA build registers all four)."""
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"diversed::{name}", "CUDA") for name in OP_NAMES)


@torch.library.register_fake("diversed::verify_probs")
def _verify_probs_fake(draft_tokens, draft_probs, target_probs, weight, num_draft, greedy, uniforms, seeds, offset=0,
                       per_row_seed=False, weight_value=1.0, seed=None):
    batch, num_positions = draft_tokens.shape  # the draft's rows may be absent (tokens only)
    tokens = target_probs.new_empty((batch, num_positions + 1), dtype=torch.int64)
    num_accepted = target_probs.new_empty((batch,), dtype=torch.int32)
    accept_prob = target_probs.new_empty((batch, num_positions), dtype=torch.float32)
    return tokens, num_accepted, accept_prob


@torch.library.register_fake("diversed::verify_logits")
def _verify_logits_fake(draft_tokens, draft_logits, target_logits, weight, num_draft, temperature, uniforms, seeds,
                        offset=0, per_row_seed=False, weight_value=1.0, temperature_value=1.0, seed=None):
    return _verify_probs_fake(draft_tokens, draft_logits, target_logits, weight, num_draft, None, uniforms, seeds,
                              offset, per_row_seed)


@torch.library.register_fake("diversed::verify_logits_with_flags")
def _verify_logits_with_flags_fake(draft_tokens, draft_logits, target_logits, weight, num_draft, temperature, uniforms,
                                   seeds, offset=0, per_row_seed=False, weight_value=1.0, temperature_value=1.0,
                                   seed=None):
    batch, num_positions = draft_tokens.shape
    row_flags = target_logits.new_empty((batch, 2 * num_positions + 1), dtype=torch.int32)
    return (*_verify_probs_fake(draft_tokens, draft_logits, target_logits, weight, num_draft, None, uniforms, seeds,
                                offset, per_row_seed), row_flags)


@torch.library.register_fake("diversed::token_stats")
def _token_stats_fake(draft, target, tokens, temperature, from_logits):
    batch, length, _ = draft.shape
    return tuple(draft.new_empty((batch, length), dtype=torch.float32) for _ in range(5))


@torch.library.register_fake("diversed::mix")
def _mix_fake(draft, target, weight, temperature, from_logits):
    return draft.new_empty(draft.shape, dtype=torch.float32)


@torch.library.register_fake("diversed::value_flags")
def _value_flags_fake(values, from_logits):
    return values.new_empty(values.shape[:-1], dtype=torch.int32)


@torch.library.register_fake("diversed::int8_pack")
def _int8_pack_fake(weight):
    out_features, in_features = weight.shape
    tiles, groups = -(-out_features // 16), -(-in_features // 4)  # the tile layout of csrc/cpu/int8_gemm.h
    return weight.new_empty((tiles * groups * 64,)), weight.new_empty((out_features,), dtype=torch.int32)


@torch.library.register_fake("diversed::int8_linear")
def _int8_linear_fake(input, packed, col_sums, w_scale, bias, row_groups=None):
    return input.new_empty((*input.shape[:-1], w_scale.shape[0]))


@torch.library.register_fake("diversed::int8_llama_layers")
def _int8_llama_layers_fake(states, norms, packed, col_sums, w_scales, biases, cos, sin, keys, values, cache_lengths,
                            row_counts, num_heads, eps, attention_scale):
    return states.new_empty(states.shape)


@torch.library.register_fake("diversed::float_llama_layers")
def _float_llama_layers_fake(states, norms, packed, biases, cos, sin, keys, values, cache_lengths, row_counts,
                             num_heads, eps, attention_scale):
    return states.new_empty(states.shape)


@torch.library.register_fake("diversed::float_pack")
def _float_pack_fake(weight):
    out_features, in_features = weight.shape
    return weight.new_empty((-(-out_features // 16), in_features, 16))  # the tile layout of csrc/cpu/float_gemm.h


@torch.library.register_fake("diversed::float_linear")
def _float_linear_fake(input, packed, bias, out_features):
    return input.new_empty((*input.shape[:-1], out_features))


@torch.library.register_fake("diversed::philox_uniforms")
def _philox_uniforms_fake(seeds, offsets, num_positions, per_row_seed):
    return seeds.new_empty((seeds.shape[0], num_positions), dtype=torch.float64)
