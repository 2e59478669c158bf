"""int8 products over weights packed once: ``diversed::int8_pack`` and ``diversed::int8_linear`` (CPU only), and
:class:`Int8Linear`, the linear layer built on them.

``int8_linear`` computes what torch's dynamically quantised linear layer (``quantize_dynamic``, fbgemm) computes from
the same int8 weights and scales when called with ``reduce_range=False``, for each group of input rows it is given:
the group quantised as one tensor to uint8's whole range, exact int32 sums, and the same float rescaling up to
rounding (csrc/forward/int8_gemm.h). What it saves is the layer's per-call work outside the sums, and several layers
that read the same input (a Llama layer's q, k and v projections; gate and up) become one call: they share the
input's quantisation anyway, so fusing them changes no sum. torch's layer itself halves the input's range, since
fbgemm's AVX2 kernels sum pairs of products in int16; these sum in int32 on every CPU, so the whole range is free,
and it halves the input's rounding step: on the default pair it takes the draft's mean total variation per token
from the target from 0.074 to 0.048 (16 GSM8K test prompts, smoothed as before).

:class:`Int8Linear` quantises every row (token) of its input on its own (:func:`token_rows`): what
``quantize_dynamic``'s layer (over the whole range) gives that row fed alone. One scale over a whole pass lets a
single outlier token (a small Llama's first token carries activations hundreds of times the others') coarsen every
other token's input, so the draft's distribution would depend on how many tokens a pass carries: a pass over a
prompt and its continuation put the default pair's int8 draft 0.42-0.61 in total variation from the target, where
the same tokens fed one a pass put it 0.09-0.20 away. Per token, a token's result is the same however it is fed, and
the draft stays close to the float model it was quantised from.

:func:`quantize_weight` quantises a float weight as ``quantize_dynamic``'s per-channel configuration does (a symmetric
scale per output feature, bit for bit), so :class:`Int8Linear` is that layer without torch's quantised tensors, which
torch deprecates. One scale for the whole weight, ``quantize_dynamic``'s default, gave rows of small weights a few
levels: on the default pair (inputs over half of uint8's range) it left the int8 draft 0.166 from the target in
mean total variation per token, where a scale per row leaves it 0.123.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch

from ._native import forward_ops_built, require_forward_ops
from .tensor_versions import TensorStamp

# The weight quantisation of quantize_dynamic's per-channel observer: qint8, per output feature, symmetric.
WEIGHT_HALF_RANGE = 127.5  # (127 - (-128)) / 2: the largest |weight| maps to 127.5 steps, then clamps to 127
WEIGHT_MIN_SCALE = torch.finfo(torch.float32).eps  # the observer's floor on the scale (an all-zero weight)


class Int8Weights(NamedTuple):
    """One or more int8 weights [N_i, K] packed as one [sum N_i, K] matrix for :func:`int8_linear`."""

    packed: torch.Tensor  # int8, the kernel's tile layout
    col_sums: torch.Tensor  # int32 [N]: each output feature's weight sum (the input zero point's correction)
    w_scale: torch.Tensor  # float32 [N]: each output feature's weight scale
    bias: Optional[torch.Tensor]  # float32 [N], or None when no part has a bias
    out_features: tuple  # N_i of each part, in order
    in_features: int  # K


def _scale_vector(label: str, scale, out_features: int) -> torch.Tensor:
    """``scale`` (a number, or a tensor of one or ``out_features`` values) as float32 [out_features], refused unless
    every value is positive and finite."""
    values = torch.as_tensor(scale, dtype=torch.float32).detach().cpu() if scale is not None else None
    if values is None or values.numel() not in (1, out_features):
        raise ValueError(f"{label}: the scale must be one number or {out_features} (one per output feature)")
    values = values.reshape(-1).expand(out_features) if values.numel() == 1 else values.reshape(-1)
    if not bool(((values > 0) & (values < float("inf"))).all()):
        raise ValueError(f"{label}: the scale must be positive and finite, got {scale}")
    return values.contiguous()


def _check_part(label: str, weight, scale, bias, in_features: int) -> torch.Tensor:
    """Refuse a part that is not (int8 weight [N, K], positive finite scale(s), bias [N] or None), naming ``label``;
    the scale as float32 [N]."""
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.int8 or weight.dim() != 2:
        raise TypeError(f"{label}: the weight must be a 2-D int8 tensor")
    if weight.device.type != "cpu":
        raise ValueError(f"{label}: the weight must be on the CPU (int8_linear is CPU only)")
    if weight.shape[1] != in_features or in_features < 1:
        raise ValueError(f"{label}: every weight must have the same in_features >= 1 "
                         f"(got {weight.shape[1]}, expected {in_features})")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],)):
        raise ValueError(f"{label}: the bias must be a tensor of shape ({weight.shape[0]},)")
    return _scale_vector(label, scale, weight.shape[0])


def pack_int8(weights: Sequence[tuple]) -> Int8Weights:
    """Pack ``weights``, a sequence of ``(int8 weight [N_i, K], scale, bias [N_i] or None)`` sharing K, as one matrix:
    ``int8_linear(x, pack_int8(parts))`` is the concatenation of every part's product with x. A part's scale is one
    number or one per output feature (``N_i`` values)."""
    require_forward_ops("pack_int8")
    if not weights:
        raise ValueError("weights must hold at least one (weight, scale, bias) part")
    in_features = weights[0][0].shape[-1] if isinstance(weights[0][0], torch.Tensor) else -1
    scales = [_check_part(f"weights[{index}]", weight, scale, bias, in_features)
              for index, (weight, scale, bias) in enumerate(weights)]
    matrix = torch.cat([weight for weight, _, _ in weights]) if len(weights) > 1 else weights[0][0]
    packed, col_sums = torch.ops.diversed.int8_pack(matrix)
    w_scale = torch.cat(scales)
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


def quantize_weight(weight: torch.Tensor) -> tuple:
    """``(int8 [N, K], scale float32 [N])`` of a float weight [N, K], as ``quantize_dynamic`` with its per-channel
    configuration (``per_channel_dynamic_qconfig``) quantises a linear layer's weight: one symmetric scale per output
    feature (the row's largest |w| over 127.5, at least float32's eps), each element rounded half to even after
    multiplying by its scale's float32 inverse (as fbgemm's quantiser does), clamped to [-128, 127]. A scale per row
    follows each output's own range: one per tensor gave a row of small weights a few int8 levels."""
    weight = weight.detach().to(device="cpu", dtype=torch.float32)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    largest = weight.abs().amax(dim=1) if weight.shape[1] else weight.new_zeros(weight.shape[0])
    scale = torch.clamp(largest / WEIGHT_HALF_RANGE, min=WEIGHT_MIN_SCALE)
    quantised = torch.clamp(torch.round(weight * (1.0 / scale).unsqueeze(1)), -128, 127).to(torch.int8)
    return quantised, scale


def token_rows(input: torch.Tensor) -> Optional[list[int]]:
    """``row_groups`` that quantise every row of ``input`` [..., K] on its own (one group of one row per token; None
    for an input without rows, which has nothing to group)."""
    rows = math.prod(input.shape[:-1])
    return [1] * rows if rows else None


class Int8Linear(torch.nn.Module):
    """A linear layer with int8 weights (one symmetric scale per output feature) and its input quantised on the fly
    at every call, each row (token) on its own: the arithmetic of torch's dynamically quantised linear layer
    (per-channel weights) applied to each row alone, through :func:`int8_linear` (CPU only, no gradients). Without the
    native forward ops (a verify-only build) it computes the same integer sums in plain torch, equal up to float
    rounding.

    Buffers: ``weight`` (int8 [out_features, in_features]), ``scale`` (float32 [out_features]; a single number given
    to the constructor applies to every row) and ``bias`` (float32 or None). Changing them in place is seen at the
    next call (the packed copy is remade when their versions move)."""

    def __init__(self, weight: torch.Tensor, scale, bias: Optional[torch.Tensor] = None):
        super().__init__()
        in_features = weight.shape[-1] if isinstance(weight, torch.Tensor) and weight.dim() else -1
        scale = _check_part("Int8Linear", weight, scale, bias, in_features)
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().contiguous())
        self.register_buffer("scale", scale.clone())
        self.register_buffer("bias", None if bias is None else bias.detach().float().cpu())
        self._packed: Optional[tuple] = None  # (TensorStamp of the buffers packed, Int8Weights)

    @classmethod
    def from_float(cls, linear: torch.nn.Linear) -> "Int8Linear":
        """The int8 copy of ``linear`` (:func:`quantize_weight`; the bias kept in float32)."""
        weight, scale = quantize_weight(linear.weight)
        return cls(weight, scale, None if linear.bias is None else linear.bias.detach())

    def parts(self) -> tuple:
        """``(int8 weight, scale, bias)``, what :func:`pack_int8` takes."""
        return self.weight, self.scale, self.bias

    def packed(self) -> Int8Weights:
        """The weights packed for :func:`int8_linear`, remade only when a buffer was replaced or changed in place
        (the packed buffers are held, so a new tensor is never mistaken for an old one at the same address)."""
        buffers = (self.weight, self.scale, self.bias)
        if self._packed is None or not self._packed[0].matches(buffers):
            self._packed = (TensorStamp.of(buffers), pack_int8([self.parts()]))
        return self._packed[1]

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight the int8 one stands for: each row times its scale."""
        return self.weight.float() * self.scale.unsqueeze(1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if forward_ops_built():
            return int8_linear(input.contiguous(), self.packed(), row_groups=token_rows(input))
        return _integer_product(input, *self.parts())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"scale=[{float(self.scale.min()):.4g}, {float(self.scale.max()):.4g}], bias={self.bias is not None}")


INPUT_LEVELS = 255  # inputs quantise to uint8's [0, 255] (torch's layer halves it: reduce_range)
INPUT_MIN_SCALE = 6.1e-5  # ChooseQuantizationParams' smallest input scale
INPUT_FALLBACK_SCALE = 0.1  # its scale for an input of zeros


def _input_params(low: float, high: float) -> tuple:
    """The (scale, zero point) fbgemm's dynamic linear layer picks for an input spanning [low, high]
    (csrc/forward/int8_gemm.h's choose_activation_params, in Python)."""
    low, high = min(low, 0.0), max(high, 0.0)
    scale = (high - low) / INPUT_LEVELS
    if scale == 0.0 or math.isinf(1.0 / scale):
        scale = INPUT_FALLBACK_SCALE
    if scale < INPUT_MIN_SCALE:
        low, high = low * INPUT_MIN_SCALE / scale, high * INPUT_MIN_SCALE / scale
        scale = INPUT_MIN_SCALE
    from_low, from_high = -low / scale, INPUT_LEVELS - high / scale
    initial = from_low if -abs(low / scale) < INPUT_LEVELS - abs(high / scale) else from_high
    zero_point = 0 if math.isnan(initial) else min(INPUT_LEVELS, max(0, round(initial)))
    return scale, zero_point


def _integer_product(input: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The int8 product in plain torch (no native ops): every row of the input quantised on its own, the integer sums
    exact in float64, then rescaled; what :class:`Int8Linear` computes natively, up to float rounding."""
    if input.dtype != torch.float32:
        raise TypeError(f"input must be a float32 tensor, got {input.dtype}")
    if input.numel() == 0:
        return input.new_zeros((*input.shape[:-1], weight.shape[0]))
    rows = input.reshape(-1, input.shape[-1])
    params = [_input_params(float(row.min()), float(row.max())) for row in rows]
    x_scale = torch.tensor([row_scale for row_scale, _ in params], dtype=torch.float64).unsqueeze(-1)
    zero_point = torch.tensor([point for _, point in params], dtype=torch.float64).unsqueeze(-1)
    quantised = torch.clamp(torch.round(rows.double() * (1.0 / x_scale)) + zero_point, 0, 255) - zero_point
    sums = quantised @ weight.double().t()  # integers below 2**53: exact
    out = (sums * (x_scale * scale.double())).view(*input.shape[:-1], weight.shape[0])
    return (out if bias is None else out + bias.double()).float()
