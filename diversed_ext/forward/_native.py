"""The lean forward's native ops: whether this build carries them, a clear error where it does not, and their fake
(meta) kernels.

A build of the extension for verification only (what a server needs) lacks these ops. Importing this floor then
still works, and so does the decoding loop (it runs the models' own forward instead, see
:func:`diversed_ext.forward.llama_runner.supports_fast_forward`); what needs the ops raises
:class:`ForwardOpsMissing` naming them. Their fake kernels are registered only when the ops exist: registering a
fake kernel for an op the library never defined fails.
"""

from __future__ import annotations

import functools

import torch

from .. import _C  # noqa: F401  (loading the library registers whatever schemas and kernels this build carries)

FORWARD_OP_NAMES = ("int8_pack", "int8_linear", "float_pack", "float_linear", "int8_llama_layers",
                    "float_llama_layers")


class ForwardOpsMissing(RuntimeError):
    """This build of the extension lacks the lean forward's native ops (a verify-only build)."""


def _op_defined(name: str) -> bool:
    return hasattr(torch.ops.diversed, name)


@functools.lru_cache(maxsize=None)
def forward_ops_built() -> bool:
    """True when this build of the extension defines every op of the lean forward (they come and go together)."""
    return all(_op_defined(name) for name in FORWARD_OP_NAMES)


def require_forward_ops(what: str) -> None:
    """Raise :class:`ForwardOpsMissing` naming ``what`` needed the ops, when this build lacks them."""
    if not forward_ops_built():
        missing = ", ".join(f"diversed::{name}" for name in FORWARD_OP_NAMES if not _op_defined(name))
        raise ForwardOpsMissing(f"{what} needs the lean forward's native ops, which this build of diversed_ext "
                                f"lacks ({missing}): rebuild the extension with them to use it")


def _register_fake_kernels() -> None:
    @torch.library.register_fake("diversed::int8_pack")
    def _int8_pack_fake(weight):
        out_features, in_features = weight.shape
        tiles, groups = -(-out_features // 16), -(-in_features // 4)  # the tile layout of the int8 products
        return weight.new_empty((tiles * groups * 64,)), weight.new_empty((out_features,), dtype=torch.int32)

    @torch.library.register_fake("diversed::int8_linear")
    def _int8_linear_fake(input, packed, col_sums, w_scale, bias, row_groups=None):
        return input.new_empty((*input.shape[:-1], w_scale.shape[0]))

    @torch.library.register_fake("diversed::int8_llama_layers")
    def _int8_llama_layers_fake(states, norms, packed, col_sums, w_scales, biases, cos, sin, keys, values,
                                cache_lengths, row_counts, num_heads, eps, attention_scale):
        return states.new_empty(states.shape)

    @torch.library.register_fake("diversed::float_llama_layers")
    def _float_llama_layers_fake(states, norms, packed, biases, cos, sin, keys, values, cache_lengths, row_counts,
                                 num_heads, eps, attention_scale):
        return states.new_empty(states.shape)

    @torch.library.register_fake("diversed::float_pack")
    def _float_pack_fake(weight):
        out_features, in_features = weight.shape
        return weight.new_empty((-(-out_features // 16), in_features, 16))  # the float products' tile layout

    @torch.library.register_fake("diversed::float_linear")
    def _float_linear_fake(input, packed, bias, out_features):
        return input.new_empty((*input.shape[:-1], out_features))


if forward_ops_built():
    _register_fake_kernels()
