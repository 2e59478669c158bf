"""The lean CPU forward for Llama models: a floor of its own, beside ``ops`` (neither imports the other) and below
``decoding`` and ``models``.

What it holds, from the bottom up:
    _native          the forward's native ops: whether this build carries them, their fake kernels, a clear error
    tensor_versions  when weights prepared once from a module's tensors must be prepared again
    int8             int8 products over weights packed once (``diversed::int8_pack`` / ``int8_linear``), the
                     :class:`Int8Linear` layer built on them, and :func:`quantize_weight`
    float_linear     float32 products over weights packed once (``diversed::float_pack`` / ``float_linear``)
    llama_layers     every decoder layer of a Llama in one native call
    projections      a Llama layer's products grouped by the input they read, packed from the model's own modules
    llama_runner     incremental passes of a ``LlamaForCausalLM`` over a preallocated cache (:class:`LlamaRunner`)
    smoothing        activation smoothing (SmoothQuant) folded into a Llama's norms and weights before they are
                     quantised
    int8_draft       the int8 draft: a copy of a float model with int8 linear layers, its weights cached as
                     safetensors

Why a floor: the verify ops (:mod:`diversed_ext.ops`) are what a server imports, and a verify-only build of the
extension lacks these ops; nothing in ``ops`` imports this floor, and ``import diversed_ext`` does not load it.
Without the native ops this floor still imports: :func:`supports_fast_forward` says False (the decoding loop then runs
the models' own forward) and the packing functions and :class:`LlamaRunner` raise :class:`ForwardOpsMissing`.
"""

from ._native import ForwardOpsMissing, forward_ops_built
from .float_linear import FloatWeights, float_linear, pack_float
from .int8 import Int8Linear, Int8Weights, int8_linear, pack_int8, quantize_weight
from .int8_draft import load_int8_draft, quantize_int8, save_int8_weights
from .llama_layers import LlamaLayers, collect_llama_layers, llama_layers
from .llama_runner import LlamaRunner, StaticKVCache, supports_fast_forward
from .smoothing import SMOOTHING_ALPHA, input_maxima, smoothed_llama

__all__ = [
    "ForwardOpsMissing", "forward_ops_built",
    "Int8Weights", "pack_int8", "int8_linear", "Int8Linear", "quantize_weight",
    "FloatWeights", "pack_float", "float_linear",
    "LlamaLayers", "collect_llama_layers", "llama_layers",
    "LlamaRunner", "StaticKVCache", "supports_fast_forward",
    "SMOOTHING_ALPHA", "input_maxima", "smoothed_llama",
    "quantize_int8", "save_int8_weights", "load_int8_draft",
]
