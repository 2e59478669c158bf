"""The int8 draft: a copy of a float model with every ``nn.Linear`` an :class:`Int8Linear`, and its weights cached as
safetensors.

The weights are quantised as ``torch.ao.quantization.quantize_dynamic`` quantises them with its per-channel
configuration (a symmetric scale per output feature, bit for bit) and the layers compute what its layers compute for
each token fed alone, without torch's quantised tensors (deprecated in torch). Given calibration tokens, a
Llama-shaped model's activations are smoothed first (:mod:`.smoothing`): its layer norms' weights change in the draft
and the products' weights absorb the difference.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

import torch

from .._atomic import atomic_path
from .int8 import Int8Linear, quantize_weight
from .smoothing import SMOOTHING_ALPHA, input_maxima, smoothed_llama

INT8_SUFFIX, SCALE_SUFFIX, BIAS_SUFFIX = ".int8", ".scale", ".bias"  # a layer's tensors in the cache file
NORM_SUFFIX = ".norm"  # a 1-D parameter (a norm's weight) as the draft holds it, smoothed or not
FORMAT_KEY, FORMAT = "diversed_int8_format", "per-channel scales, norms"  # cache files of another layout are ignored


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


def quantize_int8(model: torch.nn.Module, *, calibration: Optional[Iterable[torch.Tensor]] = None,
                  alpha: float = SMOOTHING_ALPHA, inplace: bool = False) -> torch.nn.Module:
    """int8 dynamic quantisation of every ``nn.Linear`` (:class:`Int8Linear`): weights int8 with a symmetric scale
    per output feature, activations quantised on the fly, every token on its own; the weights and, token by token,
    the arithmetic of ``torch.ao.quantization.quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig})``.
    CPU only.

    ``calibration``: batches of token ids ([B, T] or [T]) the model runs on to measure its activations; a Llama-shaped
    model is then smoothed before quantising (:mod:`.smoothing`, strength ``alpha``), which brings the draft closer to
    the float model. Without it the weights are quantised as they are.

    Without ``inplace`` the input model is left untouched. A float32 CPU model is copied without copying its
    parameters: the draft shares the embeddings and the norms it does not smooth with it (read-only at inference;
    fine-tuning the input model afterwards would change the draft's too). Other models are deep-copied to float32 on
    the CPU first."""
    shell = _draft_shell(model, inplace)
    weights, norms = {}, {}
    if calibration is not None:
        weights, norms = smoothed_llama(shell, input_maxima(shell, calibration), alpha)
    _set_norms(shell, norms)

    def make_int8(name: str, linear: torch.nn.Linear) -> Int8Linear:
        quantised, scale = quantize_weight(weights.get(name, linear.weight))
        return Int8Linear(quantised, scale, None if linear.bias is None else linear.bias.detach())

    return _swap_linears(shell, make_int8)


def _set_norms(draft: torch.nn.Module, norms: dict) -> None:
    """Give ``draft`` its own parameter ``name`` holding ``norms[name]`` for each name (not shared with the model)."""
    for name, values in norms.items():
        owner_name, _, attribute = name.rpartition(".")
        owner = draft.get_submodule(owner_name)
        setattr(owner, attribute, torch.nn.Parameter(values.detach().clone().float(), requires_grad=False))


def save_int8_weights(draft: torch.nn.Module, path: Union[str, Path], *, source: Optional[dict] = None) -> None:
    """Write the int8 weights, scales and biases of a :func:`quantize_int8` draft, and its 1-D parameters (the norms'
    weights, smoothed or not), to a safetensors file (atomically), so :func:`load_int8_draft` can rebuild the draft
    without quantising again. ``source`` (str -> str) is stored as metadata to tell which float checkpoint (and
    calibration) the weights came from."""
    from safetensors.torch import save_file

    tensors = {}
    for name, module in draft.named_modules():
        if isinstance(module, Int8Linear):
            tensors[name + INT8_SUFFIX] = module.weight.contiguous()
            tensors[name + SCALE_SUFFIX] = module.scale.contiguous()
            if module.bias is not None:
                tensors[name + BIAS_SUFFIX] = module.bias.contiguous()
    for name, parameter in draft.named_parameters():
        if parameter.dim() == 1:
            tensors[name + NORM_SUFFIX] = parameter.detach().float().contiguous()
    with atomic_path(path) as staging:
        save_file(tensors, staging, metadata=_metadata(source))


def _metadata(source: Optional[dict]) -> dict:
    return {FORMAT_KEY: FORMAT, **{key: str(value) for key, value in (source or {}).items()}}


def _read_layers(path: Union[str, Path], source: Optional[dict]) -> Optional[tuple]:
    """``(layers, norms)`` of a :func:`save_int8_weights` file: name -> :class:`Int8Linear` of every layer, parameter
    name -> 1-D tensor; None when the file is missing, unreadable, of another layout, written from another ``source``
    or holds a layer that is not a valid Int8Linear (weight, scale, bias)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as stored:
            metadata = stored.metadata() or {}
            tensors = {key: stored.get_tensor(key) for key in stored.keys()}
    except (OSError, ValueError, RuntimeError, SafetensorError):  # missing, truncated or not safetensors
        return None
    if metadata.get(FORMAT_KEY) != FORMAT or (source is not None and metadata != _metadata(source)):
        return None
    layers = {}
    for key, weight in tensors.items():
        if not key.endswith(INT8_SUFFIX):
            continue
        name = key[:-len(INT8_SUFFIX)]
        scale = tensors.get(name + SCALE_SUFFIX)
        if scale is None or weight.dim() != 2 or scale.shape != (weight.shape[0],):
            return None
        try:
            layers[name] = Int8Linear(weight, scale, tensors.get(name + BIAS_SUFFIX))
        except (TypeError, ValueError):  # Int8Linear's own checks: the weight, the scale, the bias
            return None
    norms = {key[:-len(NORM_SUFFIX)]: values for key, values in tensors.items() if key.endswith(NORM_SUFFIX)}
    return layers, norms


def load_int8_draft(target: torch.nn.Module, path: Union[str, Path], *,
                    source: Optional[dict] = None) -> Optional[torch.nn.Module]:
    """The int8 draft of ``target`` from weights :func:`save_int8_weights` wrote, sharing the target's other
    parameters as :func:`quantize_int8` does; None when the file is missing, unreadable, written from another
    ``source`` or does not cover every ``nn.Linear`` of ``target`` with the right shape, or holds a norm ``target``
    has not (then quantise afresh)."""
    stored = _read_layers(path, source)
    if stored is None:
        return None
    layers, norms = stored
    linears = [(name, module) for name, module in target.named_modules() if type(module) is torch.nn.Linear]
    for name, linear in linears:
        layer = layers.get(name)
        if layer is None or layer.weight.shape != linear.weight.shape or (layer.bias is None) != (linear.bias is None):
            return None
    parameters = dict(target.named_parameters())
    if any(name not in parameters or parameters[name].shape != values.shape for name, values in norms.items()):
        return None
    shell = _draft_shell(target, inplace=False)
    # The file holds every norm; those left unsmoothed stay shared with the target, as quantize_int8 leaves them.
    _set_norms(shell, {name: values for name, values in norms.items() if not torch.equal(values, parameters[name])})
    return _swap_linears(shell, lambda name, linear: layers[name])
