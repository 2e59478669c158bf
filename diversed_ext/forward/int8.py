"""int8 products over weights packed once: ``diversed::int8_pack`` and ``diversed::int8_linear`` (CPU only).

They compute what torch's dynamically quantised linear layer (``quantize_dynamic``, fbgemm) computes from the same
int8 weights and scales: the input quantised per tensor to uint8 with the halved range fbgemm uses, int32 sums that
are identical to the layer's, and the same float rescaling up to rounding (csrc/forward/int8_gemm.h). What they save is
the layer's per-call work outside the sums, and several layers that read the same input (a Llama layer's q, k and v
projections; gate and up) become one call: they share the input's quantisation anyway, so fusing them changes no sum.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from ._native import require_forward_ops


class Int8Weights(NamedTuple):
    """One or more int8 weights [N_i, K] packed as one [sum N_i, K] matrix for :func:`int8_linear`."""

    packed: torch.Tensor  # int8, the kernel's tile layout
    col_sums: torch.Tensor  # int32 [N]: each output feature's weight sum (the input zero point's correction)
    w_scale: torch.Tensor  # float32 [N]: each output feature's weight scale
    bias: Optional[torch.Tensor]  # float32 [N], or None when no part has a bias
    out_features: tuple  # N_i of each part, in order
    in_features: int  # K


def _check_part(index: int, weight, scale, bias, in_features: int) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.int8 or weight.dim() != 2:
        raise TypeError(f"weights[{index}]: the weight must be a 2-D int8 tensor")
    if weight.device.type != "cpu":
        raise ValueError(f"weights[{index}]: the weight must be on the CPU (int8_linear is CPU only)")
    if weight.shape[1] != in_features or in_features < 1:
        raise ValueError(f"weights[{index}]: every weight must have the same in_features >= 1 "
                         f"(got {weight.shape[1]}, expected {in_features})")
    if not (float(scale) > 0 and float(scale) < float("inf")):
        raise ValueError(f"weights[{index}]: the scale must be positive and finite, got {scale}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],)):
        raise ValueError(f"weights[{index}]: the bias must be a tensor of shape ({weight.shape[0]},)")


def pack_int8(weights: Sequence[tuple]) -> Int8Weights:
    """Pack ``weights``, a sequence of ``(int8 weight [N_i, K], scale, bias [N_i] or None)`` sharing K, as one matrix:
    ``int8_linear(x, pack_int8(parts))`` is the concatenation of every part's product with x."""
    require_forward_ops("pack_int8")
    if not weights:
        raise ValueError("weights must hold at least one (weight, scale, bias) part")
    in_features = weights[0][0].shape[-1] if isinstance(weights[0][0], torch.Tensor) else -1
    for index, (weight, scale, bias) in enumerate(weights):
        _check_part(index, weight, scale, bias, in_features)
    matrix = torch.cat([weight for weight, _, _ in weights]) if len(weights) > 1 else weights[0][0]
    packed, col_sums = torch.ops.diversed.int8_pack(matrix)
    w_scale = torch.cat([torch.full((weight.shape[0],), float(scale), dtype=torch.float32)
                         for weight, scale, _ in weights])
    bias = None
    if any(part_bias is not None for _, _, part_bias in weights):
        bias = torch.cat([torch.zeros(weight.shape[0]) if part_bias is None else part_bias.detach().float().cpu()
                          for weight, _, part_bias in weights])
    return Int8Weights(packed, col_sums, w_scale, bias, tuple(weight.shape[0] for weight, _, _ in weights),
                       in_features)


def int8_linear(input: torch.Tensor, weights: Int8Weights, *, row_groups: Optional[Sequence[int]] = None,
                check: bool = True) -> torch.Tensor:
    """``input`` float32 [..., K] times the packed weights: [..., sum N_i], as the dynamically quantised layers give.

    ``row_groups``: sizes of consecutive groups of the input's rows (flattened to [M, K]) that are quantised
    separately, each exactly as the layer would quantise it alone (None: all rows together, as the layer does). A
    batch of sequences stacked into one call passes each sequence's row count, so a sequence's result does not depend
    on its neighbours.

    ``check=False`` skips the Python argument checks (a caller whose shapes are fixed, like the decoding loop); the
    native op still checks shapes, dtypes and ``row_groups``, so a bad call raises there instead of reading out of
    bounds."""
    groups = None if row_groups is None else [int(rows) for rows in row_groups]
    if not check:
        return torch.ops.diversed.int8_linear(input, weights.packed, weights.col_sums, weights.w_scale, weights.bias,
                                              groups)
    if not isinstance(input, torch.Tensor) or input.dtype != torch.float32:
        raise TypeError(f"input must be a float32 tensor, got {getattr(input, 'dtype', type(input).__name__)}")
    if input.device.type != "cpu":
        raise ValueError(f"input must be on the CPU (int8_linear is CPU only), got {input.device}")
    if input.dim() < 1 or input.shape[-1] != weights.in_features:
        raise ValueError(f"input must have {weights.in_features} features in its last dimension, got shape "
                         f"{tuple(input.shape)}")
    rows = input.numel() // weights.in_features
    if groups is not None and (any(size < 1 for size in groups) or sum(groups) != rows):
        raise ValueError(f"row_groups must be sizes >= 1 adding up to the input's {rows} rows, got {groups}")
    return torch.ops.diversed.int8_linear(input, weights.packed, weights.col_sums, weights.w_scale, weights.bias,
                                          groups)

