"""The products of a Llama layer, grouped by the input they read: q/k/v, o, gate/up, down, and the LM head.

For the int8 draft (every linear module an :class:`~diversed_ext.forward.int8.Int8Linear`), each group is one
``diversed::int8_linear`` call over weights packed once from the layers' own int8 weights and scales: the same int32
sums as the layers compute, so the draft's distribution ``q`` is unchanged up to float rounding, and the shipped head
trained on this draft stays valid. Measured on the default pair (2-core AVX-512 VNNI CPU, one thread): a 576 x 576
product takes about 10 us against about 27 us through torch's own quantised layer, whose per-call work outside the
sums (quantising the input, packing it, rescaling) costs more than the sums themselves at one row.

For a float32 model on the CPU (the target), each group is one ``diversed::float_linear`` call over its weights
packed once (:mod:`diversed_ext.forward.float_linear`): the weights stream from memory once per call whatever the number
of rows, where MKL's products of 3 to 32 rows run well above that (30 of the target's layers, 2 threads: 5 rows
14.3 ms against 24.5 ms, 8 rows 15.9 against 32.6), and a row's outputs never depend on its neighbours. Any other
module (CUDA, bfloat16, per-channel int8) is multiplied by the runner's own product, module by module.

A Llama whose every layer qualifies runs all its layers in one native call (:func:`native_layers`).
"""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from .float_linear import FloatWeights, float_linear, pack_float
from .int8 import Int8Linear, Int8Weights, int8_linear, pack_int8, token_rows
from .llama_layers import LlamaLayers, collect_llama_layers
from .tensor_versions import TensorStamp

# Packed weights per module group, kept while the first module lives: decoders made one after another over the same
# models (the demo makes one per method) pack them once.
_PACKED: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()


def _cached(modules: Sequence[torch.nn.Module], sources: tuple, pack: Callable):
    """``pack()`` once per module group: reused while the group keeps the same source tensors, unchanged."""
    for stamp, packed in _PACKED.get(modules[0], ()):
        if stamp.matches(sources):
            return packed
    packed = pack()
    if packed is not None:
        _PACKED.setdefault(modules[0], []).append((TensorStamp.of(sources), packed))
    return packed


def _packed_int8(modules: Sequence[torch.nn.Module]) -> Optional[Int8Weights]:
    if not all(type(module) is Int8Linear and module.in_features == modules[0].in_features for module in modules):
        return None
    if len(modules) == 1:
        return modules[0].packed()
    tensors = tuple(tensor for module in modules for tensor in (module.weight, module.scale, module.bias)
                    if tensor is not None)
    return _cached(modules, tensors, lambda: pack_int8([module.parts() for module in modules]))


def _packed_float(modules: Sequence[torch.nn.Module]) -> Optional[FloatWeights]:
    def packable(module):
        return (type(module) is torch.nn.Linear and module.weight.dtype == torch.float32
                and module.weight.device.type == "cpu" and module.in_features == modules[0].in_features)

    if not all(packable(module) for module in modules):
        return None
    tensors = tuple(tensor for module in modules for tensor in (module.weight, module.bias) if tensor is not None)
    return _cached(modules, tensors, lambda: pack_float([(module.weight, module.bias) for module in modules]))


class Projections:
    """``projections(states)`` is every module's output for ``states`` [..., K], concatenated along the last
    dimension in module order (``out_features`` each): one fused int8 or float call over weights packed once when
    the modules allow it, else ``linear(states, module)`` per module."""

    def __init__(self, modules: Sequence[torch.nn.Module], linear: Callable):
        self.modules = tuple(modules)
        self.linear = linear
        self.int8 = _packed_int8(self.modules)
        self.float = None if self.int8 is not None else _packed_float(self.modules)
        self.out_features = tuple(module.out_features for module in self.modules)

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        """The int8 path quantises every row (token) of ``states`` on its own, as :class:`Int8Linear` does, so no
        row's result depends on the rows stacked with it; float products never mix rows."""
        if self.int8 is not None and states.device.type == "cpu" and states.dtype == torch.float32:
            # Shapes are fixed by the model: the Python check is skipped, the native op still checks.
            return int8_linear(states, self.int8, row_groups=token_rows(states), check=False)
        if self.float is not None and states.device.type == "cpu" and states.dtype == torch.float32:
            return float_linear(states, self.float)
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


def _is_silu(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.SiLU) or type(module).__name__ in ("SiLU", "SiLUActivation")


def _float_rms_norm(norm: torch.nn.Module) -> bool:
    return (type(norm).__name__ == "LlamaRMSNorm" and norm.weight.dtype == torch.float32
            and norm.weight.device.type == "cpu")


def native_layers(layers: Sequence[torch.nn.Module], products: Sequence[LayerProjections], *, num_heads: int,
                  head_dim: int) -> Optional[LlamaLayers]:
    """The decoder ``layers`` as the native pass takes them (:func:`diversed_ext.forward.llama_layers.llama_layers`), or
    None where it does not apply: products that are not all packed int8 or all packed float32, an activation other
    than SiLU, an RMSNorm that is not a float32 LlamaRMSNorm on the CPU, or norms and attentions that differ between
    layers. The packed weights are shared with ``products``, not copied."""
    groups = [group for layer in products for group in layer]
    packed = [group.int8 if group.int8 is not None else group.float for group in groups]
    if not layers or any(weights is None for weights in packed) or len({type(weights) for weights in packed}) != 1:
        return None
    first = layers[0]
    eps, scaling = first.input_layernorm.variance_epsilon, first.self_attn.scaling
    for layer in layers:
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not all(_float_rms_norm(norm) and norm.variance_epsilon == eps for norm in norms):
            return None
        if not _is_silu(layer.mlp.act_fn) or layer.self_attn.scaling != scaling or head_dim % 2:
            return None
    return collect_llama_layers([packed[index:index + 4] for index in range(0, len(packed), 4)],
                                [(layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
                                 for layer in layers],
                                num_heads=num_heads, eps=eps, attention_scale=scaling)
