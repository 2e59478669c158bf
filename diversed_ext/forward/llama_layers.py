"""Every decoder layer of a Llama in one native call (CPU only): ``diversed::int8_llama_layers`` for a model whose
products are int8 (:mod:`.int8`), ``diversed::float_llama_layers`` for float32 ones (:mod:`.float_linear`).

Why: a decoding step multiplies a few rows by each weight, and the ops between a layer's products (two RMSNorms, the
rotary embedding, the cache writes, attention, SiLU, the residual adds) cost a dispatch of several microseconds each,
some thirty per layer: on the default pair about half of the int8 draft's 1-token pass. Here they run natively
between the products (csrc/forward/llama_layers.h), each row attending to its own cache only.

The results equal the layers run op by op up to float rounding: RMSNorm's squares are summed in float64, dot
products and sums over fixed lanes, and exp is a polynomial with a relative error of about 1e-7.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence, Union

import torch

from .float_linear import FloatWeights
from .int8 import Int8Weights

PRODUCTS_PER_LAYER = 4  # qkv, o, gate_up, down


class LlamaLayers(NamedTuple):
    """A Llama's decoder layers as :func:`llama_layers` takes them (made by :func:`collect_llama_layers`): per-layer
    lists, layer after layer, of the RMSNorm weights (input, post-attention) and the packed products (q/k/v packed
    together, o, gate and up packed together with gate first, down)."""

    norms: list  # float32 [hidden], 2 per layer
    products: list  # Int8Weights or FloatWeights, 4 per layer
    num_heads: int
    eps: float  # the RMSNorms' epsilon
    attention_scale: float  # the factor on q . k before the softmax

    @property
    def int8(self) -> bool:
        return isinstance(self.products[0], Int8Weights)


def collect_llama_layers(products: Sequence[Sequence[Union[Int8Weights, FloatWeights]]],
                         norms: Sequence[tuple], *, num_heads: int, eps: float,
                         attention_scale: float) -> LlamaLayers:
    """``products[l]``: layer l's (qkv, o, gate_up, down) packed weights, all int8 or all float; ``norms[l]``: its
    (input, post-attention) RMSNorm weights. Nothing is copied: the lists hold the packed tensors themselves."""
    flat = [weights for layer in products for weights in layer]
    if not products or any(len(layer) != PRODUCTS_PER_LAYER for layer in products) or len(norms) != len(products):
        raise ValueError("every layer needs its 4 packed products (qkv, o, gate_up, down) and its 2 RMSNorm weights")
    if len({type(weights) for weights in flat}) != 1 or not isinstance(flat[0], (Int8Weights, FloatWeights)):
        raise TypeError("the products must be all Int8Weights or all FloatWeights")
    return LlamaLayers([norm.detach() for pair in norms for norm in pair], flat, int(num_heads), float(eps),
                       float(attention_scale))


def llama_layers(states: torch.Tensor, layers: LlamaLayers, cos: torch.Tensor, sin: torch.Tensor,
                 caches: Sequence[tuple], cache_lengths: Sequence[int], row_counts: Sequence[int]) -> torch.Tensor:
    """Every decoder layer over ``states`` float32 [M, hidden]: the embedded new tokens of one or more sequences, row
    after row (row r has ``row_counts[r]`` of them). ``cos``, ``sin`` float32 [M, head_dim]: the rotary tables at
    each token's position; ``caches[r]``: row r's (keys, values), float32 [layers, kv_heads, capacity, head_dim],
    whose first ``cache_lengths[r]`` positions are filled. Writes each row's new keys and values after them and
    returns the residual stream after the last layer [M, hidden] (the final norm is the caller's). A row's result
    does not depend on the other rows, nor a token's on the other tokens of its row (an int8 model quantises each
    token's inputs on its own). The native op checks every shape and raises a RuntimeError naming the argument."""
    keys, values = [pair[0] for pair in caches], [pair[1] for pair in caches]
    lengths, counts = [int(n) for n in cache_lengths], [int(n) for n in row_counts]
    biases = [weights.bias for weights in layers.products]
    packed = [weights.packed for weights in layers.products]
    if layers.int8:
        return torch.ops.diversed.int8_llama_layers(
            states, layers.norms, packed, [weights.col_sums for weights in layers.products],
            [weights.w_scale for weights in layers.products], biases, cos, sin, keys, values, lengths, counts,
            layers.num_heads, layers.eps, layers.attention_scale)
    return torch.ops.diversed.float_llama_layers(states, layers.norms, packed, biases, cos, sin, keys, values, lengths,
                                                 counts, layers.num_heads, layers.eps, layers.attention_scale)
