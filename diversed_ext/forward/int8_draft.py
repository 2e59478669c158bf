"""The int8 draft: a copy of a float model with every ``nn.Linear`` an :class:`Int8Linear`, and its weights cached as
safetensors.

The weights are quantised as ``torch.ao.quantization.quantize_dynamic`` quantises them (per tensor, symmetric, bit
for bit) and the layers compute what its layers compute for each token fed alone, without torch's quantised tensors
(deprecated in torch).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from .._atomic import atomic_path
from .int8 import Int8Linear

INT8_SUFFIX, SCALE_SUFFIX, BIAS_SUFFIX = ".int8", ".scale", ".bias"  # a layer's tensors in the cache file


def _draft_shell(model: torch.nn.Module, inplace: bool) -> torch.nn.Module:
    """The model the int8 draft is built in (see :func:`quantize_int8` on copies and shared parameters)."""
    on_cpu_float32 = all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
    if not inplace:
        memo = {id(p): p for p in model.parameters()} if on_cpu_float32 else None
        model = copy.deepcopy(model, memo=memo)
    if not on_cpu_float32:
        model = model.to(device="cpu", dtype=torch.float32)
    return model


def _swap_linears(model: torch.nn.Module, make_int8: Callable[[str, torch.nn.Linear], Int8Linear]) -> torch.nn.Module:
    """Replace every ``nn.Linear`` of ``model`` by ``make_int8(name, linear)``."""
    linears = [(name, module) for name, module in model.named_modules() if type(module) is torch.nn.Linear]
    for name, linear in linears:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child_name, make_int8(name, linear))
    return model.eval()


def quantize_int8(model: torch.nn.Module, *, inplace: bool = False) -> torch.nn.Module:
    """int8 dynamic quantisation of every ``nn.Linear`` (:meth:`Int8Linear.from_float`): weights int8 per tensor
    (symmetric), activations quantised on the fly, every token on its own; the weights and, token by token, the
    arithmetic of ``torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, qint8)``. CPU only.

    Without ``inplace`` the input model is left untouched. A float32 CPU model is copied without copying its
    parameters: the draft shares the embeddings and norms with it (read-only at inference; fine-tuning the input
    model afterwards would change the draft's too). Other models are deep-copied to float32 on the CPU first."""
    return _swap_linears(_draft_shell(model, inplace), lambda name, linear: Int8Linear.from_float(linear))


def save_int8_weights(draft: torch.nn.Module, path: Union[str, Path], *, source: Optional[dict] = None) -> None:
    """Write the int8 weights, scales and biases of a :func:`quantize_int8` draft to a safetensors file (atomically),
    so :func:`load_int8_draft` can rebuild the draft without quantising again. ``source`` (str -> str) is stored as
    metadata to tell which float checkpoint the weights came from."""
    from safetensors.torch import save_file

    tensors = {}
    for name, module in draft.named_modules():
        if isinstance(module, Int8Linear):
            tensors[name + INT8_SUFFIX] = module.weight.contiguous()
            tensors[name + SCALE_SUFFIX] = module.scale.double().reshape(1)
            if module.bias is not None:
                tensors[name + BIAS_SUFFIX] = module.bias.contiguous()
    with atomic_path(path) as staging:
        save_file(tensors, staging, metadata={key: str(value) for key, value in (source or {}).items()})


def _read_layers(path: Union[str, Path], source: Optional[dict]) -> Optional[dict]:
    """name -> :class:`Int8Linear` of every layer in a :func:`save_int8_weights` file; None when the file is missing,
    unreadable, written from another ``source`` or holds a layer that is not a valid Int8Linear (weight, scale,
    bias)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as stored:
            metadata = stored.metadata() or {}
            tensors = {key: stored.get_tensor(key) for key in stored.keys()}
    except (OSError, ValueError, RuntimeError, SafetensorError):  # missing, truncated or not safetensors
        return None
    if source is not None and metadata != {key: str(value) for key, value in source.items()}:
        return None
    layers = {}
    for key, weight in tensors.items():
        if not key.endswith(INT8_SUFFIX):
            continue
        name = key[:-len(INT8_SUFFIX)]
        scale = tensors.get(name + SCALE_SUFFIX)
        if scale is None or scale.numel() != 1:
            return None
        try:
            layers[name] = Int8Linear(weight, float(scale), tensors.get(name + BIAS_SUFFIX))
        except (TypeError, ValueError):  # Int8Linear's own checks: the weight, the scale, the bias
            return None
    return layers


def load_int8_draft(target: torch.nn.Module, path: Union[str, Path], *,
                    source: Optional[dict] = None) -> Optional[torch.nn.Module]:
    """The int8 draft of ``target`` from weights :func:`save_int8_weights` wrote, sharing the target's other
    parameters as :func:`quantize_int8` does; None when the file is missing, unreadable, written from another
    ``source`` or does not cover every ``nn.Linear`` of ``target`` with the right shape (then quantise afresh)."""
    layers = _read_layers(path, source)
    if layers is None:
        return None
    linears = [(name, module) for name, module in target.named_modules() if type(module) is torch.nn.Linear]
    for name, linear in linears:
        layer = layers.get(name)
        if layer is None or layer.weight.shape != linear.weight.shape or (layer.bias is None) != (linear.bias is None):
            return None
    return _swap_linears(_draft_shell(target, inplace=False), lambda name, linear: layers[name])
