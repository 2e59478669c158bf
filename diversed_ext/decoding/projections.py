"""The products of a Llama layer, grouped by the input they read: q/k/v, o, gate/up, down, and the LM head.

For the int8 draft (every linear module a ``quantize_dynamic`` layer with per-tensor int8 weights), each group is one
``diversed::int8_linear`` call over weights packed once from the layers' own int8 weights and scales: the same int32
sums as the layers compute, so the draft's distribution ``q`` is unchanged up to float rounding, and the shipped head
trained on this draft stays valid. Measured on the default pair (2-core AVX-512 VNNI CPU, one thread): a 576 x 576
product takes about 10 us against about 27 us through the layer, whose per-call work outside the sums (quantising
the input, packing it, rescaling) costs more than the sums themselves at one row. Any other module (float, CUDA,
per-channel int8) is multiplied by the runner's own product, module by module.
"""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from ..ops.int8 import Int8Weights, int8_linear, pack_int8

# Packed weights per module group, kept while the first module lives: decoders made one after another over the same
# draft (the demo makes one per method) pack it once.
_PACKED: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()


def int8_parts(module: torch.nn.Module) -> Optional[tuple]:
    """``(int8 weight, scale, bias)`` of a dynamically quantised linear layer with per-tensor symmetric qint8 weights
    (what ``quantize_dynamic`` makes), else None."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    if type(module) is not DynamicQuantizedLinear:
        return None
    weight, bias = module._weight_bias()
    if weight.qscheme() not in (torch.per_tensor_affine, torch.per_tensor_symmetric) or weight.q_zero_point() != 0:
        return None
    return weight.int_repr(), weight.q_scale(), bias


def _packed(modules: Sequence[torch.nn.Module]) -> Optional[Int8Weights]:
    # Keyed by the modules' packed weight objects themselves (set_weight_bias replaces them), held by the cache entry,
    # so new weights are packed afresh and an old object's id cannot be mistaken for a new one.
    sources = tuple(getattr(getattr(module, "_packed_params", None), "_packed_params", None) for module in modules)
    for cached_sources, packed in _PACKED.get(modules[0], ()):
        if all(a is b for a, b in zip(cached_sources, sources)):
            return packed
    parts = [int8_parts(module) for module in modules]
    if any(part is None for part in parts) or len({part[0].shape[1] for part in parts}) != 1:
        return None
    packed = pack_int8(parts)
    _PACKED.setdefault(modules[0], []).append((sources, packed))
    return packed


class Projections:
    """``projections(states)`` is every module's output for ``states`` [..., K], concatenated along the last
    dimension in module order (``out_features`` each): one fused int8 call when the modules allow it, else
    ``linear(states, module)`` per module."""

    def __init__(self, modules: Sequence[torch.nn.Module], linear: Callable):
        self.modules = tuple(modules)
        self.linear = linear
        self.int8 = _packed(self.modules)
        self.out_features = tuple(module.out_features for module in self.modules)

    def __call__(self, states: torch.Tensor, row_groups: Optional[Sequence[int]] = None) -> torch.Tensor:
        """``row_groups``: row counts of the sequences stacked in ``states`` (None: one sequence). The int8 path
        quantises each sequence's rows on their own, as a pass over that sequence alone would; float products need
        no grouping (rows never mix in them)."""
        if self.int8 is not None and states.device.type == "cpu" and states.dtype == torch.float32:
            # Shapes are fixed by the model: the Python check is skipped, the native op still checks.
            return int8_linear(states, self.int8, row_groups=row_groups, check=False)
        if len(self.modules) == 1:
            return self.linear(states, self.modules[0])
        return torch.cat([self.linear(states, module) for module in self.modules], dim=-1)


class LayerProjections(NamedTuple):
    qkv: Projections
    o: Projections
    gate_up: Projections
    down: Projections


def layer_projections(layer: torch.nn.Module, linear: Callable) -> LayerProjections:
    attention, mlp = layer.self_attn, layer.mlp
    return LayerProjections(Projections((attention.q_proj, attention.k_proj, attention.v_proj), linear),
                            Projections((attention.o_proj,), linear),
                            Projections((mlp.gate_proj, mlp.up_proj), linear),
                            Projections((mlp.down_proj,), linear))
