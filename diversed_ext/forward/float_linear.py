"""Float products over weights packed once: ``diversed::float_pack`` and ``diversed::float_linear`` (CPU only).

What they are for: the lean Llama forward multiplies a few rows (one token, or the K + 1 tokens of a verify pass) by
large weights. ``F.linear`` hands MKL a transposed weight that it repacks on every call, and MKL's products of 3 to
32 rows run compute-bound well above the time it takes to stream the weights; here the weights are packed once in
tiles of 16 output features and each call streams them once, for any row count (csrc/forward/float_gemm.h).

Every output is the plain in-order sum over the input features, the same whatever the number of rows, so a row's
result never depends on the rows beside it (batch invariance, bit for bit). It differs from ``F.linear`` only by the
rounding of sums formed in another order.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from ._native import require_forward_ops


class FloatWeights(NamedTuple):
    """One or more float32 weights [N_i, K] packed as one [sum N_i, K] matrix for :func:`float_linear`."""

    packed: torch.Tensor  # float32 [ceil(N / 16), K, 16]: the kernel's tile layout
    bias: Optional[torch.Tensor]  # float32 [N], or None when no part has a bias
    out_features: tuple  # N_i of each part, in order
    in_features: int  # K


def pack_float(parts: Sequence[tuple]) -> FloatWeights:
    """Pack ``parts``, a sequence of ``(weight [N_i, K], bias [N_i] or None)`` float32 CPU tensors sharing K, as one
    matrix: ``float_linear(x, pack_float(parts))`` is the concatenation of every part's
    ``F.linear(x, weight, bias)``."""
    require_forward_ops("pack_float")
    if not parts:
        raise ValueError("parts must hold at least one (weight, bias) pair")
    in_features = parts[0][0].shape[-1]
    for index, (weight, bias) in enumerate(parts):
        if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32 or weight.dim() != 2:
            raise TypeError(f"parts[{index}]: the weight must be a 2-D float32 tensor")
        if weight.device.type != "cpu" or weight.shape[1] != in_features or in_features < 1:
            raise ValueError(f"parts[{index}]: every weight must be on the CPU with the same in_features >= 1")
        if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != torch.float32):
            raise ValueError(f"parts[{index}]: the bias must be a float32 tensor of shape ({weight.shape[0]},)")
    weights = [weight.detach() for weight, _ in parts]
    matrix = torch.cat(weights) if len(weights) > 1 else weights[0]
    bias = None
    if any(part_bias is not None for _, part_bias in parts):
        bias = torch.cat([torch.zeros(weight.shape[0]) if part_bias is None else part_bias.detach()
                          for weight, part_bias in parts]).contiguous()
    return FloatWeights(torch.ops.diversed.float_pack(matrix), bias, tuple(weight.shape[0] for weight in weights),
                        in_features)


def float_linear(input: torch.Tensor, weights: FloatWeights) -> torch.Tensor:
    """``input`` float32 [..., K] on the CPU times the packed weights: [..., sum N_i]. The native op checks every
    shape and raises a RuntimeError naming the argument."""
    return torch.ops.diversed.float_linear(input, weights.packed, weights.bias, sum(weights.out_features))
