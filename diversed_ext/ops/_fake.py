"""Loads the native library and registers the fake (meta) kernels of its ops, whose output layouts it states.

The fake kernels give output shapes and dtypes without data, which is what ``torch.compile`` and
``torch.library.opcheck`` need. They also run on a real call when one tensor is on the meta device, the dispatcher's
choice for a mix of meta and real tensors: like the CUDA binding they then refuse tensors on different devices, where
they would return unwritten memory as results. The lean forward's ops register theirs in :mod:`diversed_ext.forward`.
"""

from __future__ import annotations

import torch

from .. import _C  # noqa: F401  (loading the library registers the schemas and the CPU/CUDA kernels)
from .. import rules


# The ops a CUDA build runs natively on CUDA tensors (mixture_divergence runs as torch ops off the CPU).
OP_NAMES = ("verify_probs", "verify_logits", "token_stats", "mix", "distribution_features", "gate_statistics")
# What distribution_features returns per position, in its order (csrc/common/features_math.h); a head takes any
# subset by name.
DISTRIBUTION_FEATURES = ("draft_entropy", "target_entropy", "draft_max_prob", "target_max_prob", "total_variation")


def cuda_kernels_registered() -> bool:
    """True when this build registered a CUDA kernel for every ``diversed`` op (a CUDA build registers all six)."""
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"diversed::{name}", "CUDA") for name in OP_NAMES)


def _on_one_device(op: str, *tensors) -> None:
    """Every tensor given (None: an absent optional) on one device, as the native bindings require."""
    devices = {tensor.device for tensor in tensors if tensor is not None}
    if len(devices) > 1:
        raise RuntimeError(f"{op}: every tensor must be on the same device, got {sorted(map(str, devices))}")


@torch.library.register_fake("diversed::verify_probs")
def _verify_probs_fake(draft_tokens, draft_probs, target_probs, weight, num_draft, greedy, uniforms, seeds, offset=0,
                       per_row_seed=False, weight_value=1.0, seed=None, target_rows=None, draft_rows=None,
                       fly_window=None, fly_threshold=None, fly_window_value=0,
                       fly_threshold_value=rules.FLY_DEFAULT_THRESHOLD, fly_top_k=rules.FLY_DEFAULT_TOP_K):
    _on_one_device("verify_probs", draft_tokens, draft_probs, target_probs, weight, num_draft, greedy, uniforms, seeds,
                   target_rows, draft_rows, fly_window, fly_threshold)
    return _verify_outputs(draft_tokens, target_probs)


def _verify_outputs(draft_tokens, target_probs) -> tuple:
    # B and K from the ids: the draft may be absent (tokens only), and either tensor may be rows [R, V] read in place.
    batch, num_positions = draft_tokens.shape
    tokens = target_probs.new_empty((batch, num_positions + 1), dtype=torch.int64)
    num_accepted = target_probs.new_empty((batch,), dtype=torch.int32)
    accept_prob = target_probs.new_empty((batch, num_positions), dtype=torch.float32)
    return tokens, num_accepted, accept_prob


@torch.library.register_fake("diversed::verify_logits")
def _verify_logits_fake(draft_tokens, draft_logits, target_logits, weight, num_draft, temperature, uniforms, seeds,
                        offset=0, per_row_seed=False, weight_value=1.0, temperature_value=1.0, seed=None,
                        target_rows=None, draft_rows=None, target_temperature=None, target_temperature_value=None,
                        fly_window=None, fly_threshold=None, fly_window_value=0,
                        fly_threshold_value=rules.FLY_DEFAULT_THRESHOLD, fly_top_k=rules.FLY_DEFAULT_TOP_K):
    _on_one_device("verify_logits", draft_tokens, draft_logits, target_logits, weight, num_draft, temperature,
                   uniforms, seeds, target_rows, draft_rows, target_temperature, fly_window, fly_threshold)
    return _verify_outputs(draft_tokens, target_logits)


@torch.library.register_fake("diversed::token_stats")
def _token_stats_fake(draft, target, tokens, temperature, from_logits):
    _on_one_device("token_stats", draft, target, tokens, temperature)
    batch, length, _ = draft.shape
    return tuple(draft.new_empty((batch, length), dtype=torch.float32) for _ in range(5))


@torch.library.register_fake("diversed::mix")
def _mix_fake(draft, target, weight, temperature, from_logits):
    _on_one_device("mix", draft, target, weight, temperature)
    return draft.new_empty(draft.shape, dtype=torch.float32)


@torch.library.register_fake("diversed::mixture_divergence")
def _mixture_divergence_fake(draft, target, temperature, grid_points, log_floor):
    _on_one_device("mixture_divergence", draft, target, temperature)
    return draft.new_empty((draft.shape[0], draft.shape[1], grid_points), dtype=torch.float32)


@torch.library.register_fake("diversed::distribution_features")
def _distribution_features_fake(draft, target, temperature, target_rows=None, draft_rows=None,
                                target_temperature=None):
    _on_one_device("distribution_features", draft, target, temperature, target_rows, draft_rows, target_temperature)
    # B and T from a 3-D tensor, or from the indices when both tensors are rows [R, V] read in place.
    shaped = draft if draft_rows is None else (target if target_rows is None else target_rows)
    batch, length = shaped.shape[:2]
    return target.new_empty((batch, length, len(DISTRIBUTION_FEATURES)), dtype=torch.float32)


@torch.library.register_fake("diversed::gate_statistics")
def _gate_statistics_fake(draft_tokens, draft, target, temperature, target_rows=None, draft_rows=None,
                          target_temperature=None, draft_probs=False):
    _on_one_device("gate_statistics", draft_tokens, draft, target, temperature, target_rows, draft_rows,
                   target_temperature)
    return tuple(target.new_empty(draft_tokens.shape, dtype=torch.float32) for _ in range(2))


@torch.library.register_fake("diversed::value_flags")
def _value_flags_fake(values, from_logits):
    return values.new_empty(values.shape[:-1], dtype=torch.int32)


@torch.library.register_fake("diversed::philox_uniforms")
def _philox_uniforms_fake(seeds, offsets, num_positions, per_row_seed):
    return seeds.new_empty((seeds.shape[0], num_positions), dtype=torch.float64)
