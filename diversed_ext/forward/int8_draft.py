"""The int8 draft: a dynamically quantised copy of a float model, and its weights cached as safetensors.

``quantize_int8`` is ``torch.ao.quantization.quantize_dynamic`` on every ``nn.Linear`` (CPU only). Packing the int8
matrices is most of the cost of a load, so the cached weights are packed by :class:`Int8Packing` on all cores while the
target and the tokenizer load.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from .._atomic import atomic_path


@contextlib.contextmanager
def _quiet_quantization_warnings():
    # torch.ao.quantization announces its deprecation on every call; the API still works in torch 2.13.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.ao\.quantization is deprecated.*")
        warnings.filterwarnings("ignore", message=r".*quantized tensor creation functions.*deprecated.*")
        yield


def _int8_module(qweight: torch.Tensor, bias: Optional[torch.Tensor], in_features: int,
                 out_features: int) -> torch.nn.Module:
    """The module ``quantize_dynamic`` makes of an ``nn.Linear`` (same class), holding ``qweight`` pre-packed.

    ``DynamicQuantizedLinear(in, out)`` pre-packs a placeholder weight of the full shape before the real one is
    packed, and packing is most of the cost of quantising: a 1 x 1 shell halves the load time of the draft."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    module = DynamicQuantizedLinear(1, 1, bias_=bias is not None, dtype=torch.qint8)
    module.in_features, module.out_features = in_features, out_features
    module.set_weight_bias(qweight, bias)
    return module


def quantize_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (a linear layer's [N, K]) as ``quantize_dynamic`` quantises it: a per-tensor symmetric qint8 tensor
    on the CPU, with the observer and qparams of ``default_dynamic_qconfig``."""
    from torch.ao.quantization import default_dynamic_qconfig

    weight = weight.detach().float().cpu()
    with _quiet_quantization_warnings():
        observer = default_dynamic_qconfig.weight()  # per-tensor symmetric qint8, as quantize_dynamic uses
        observer(weight)
        scale, zero_point = observer.calculate_qparams()
        return torch.quantize_per_tensor(weight, float(scale), int(zero_point), torch.qint8)


def _int8_linear(linear: torch.nn.Linear) -> torch.nn.Module:
    """int8 copy of an ``nn.Linear`` with the observer and qparams ``quantize_dynamic`` uses."""
    qweight = quantize_weight(linear.weight)
    bias = None if linear.bias is None else linear.bias.detach().float().cpu()
    return _int8_module(qweight, bias, linear.in_features, linear.out_features)


def _draft_shell(model: torch.nn.Module, inplace: bool) -> torch.nn.Module:
    """The model the int8 draft is built in (see :func:`quantize_int8` on copies and shared parameters)."""
    on_cpu_float32 = all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
    if not inplace:
        memo = {id(p): p for p in model.parameters()} if on_cpu_float32 else None
        model = copy.deepcopy(model, memo=memo)
    if not on_cpu_float32:
        model = model.to(device="cpu", dtype=torch.float32)
    return model


def _swap_linears(model: torch.nn.Module, make_int8: Callable[[str, torch.nn.Linear], torch.nn.Module]):
    """Replace every ``nn.Linear`` of ``model`` by ``make_int8(name, linear)``, built on a thread per core: packing
    the weights runs in ATen without the GIL, so the threads really do share the work."""
    linears = [(name, module) for name, module in model.named_modules() if type(module) is torch.nn.Linear]
    with _quiet_quantization_warnings(), ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        built = list(pool.map(lambda item: make_int8(*item), linears))
    for (name, _), module in zip(linears, built):
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child_name, module)
    return model.eval()


def quantize_int8(model: torch.nn.Module, *, inplace: bool = False) -> torch.nn.Module:
    """int8 dynamic quantisation of every ``nn.Linear``: weights int8 per tensor (symmetric), activations quantised on
    the fly; the modules are exactly those ``torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, qint8)`` makes
    (that API is deprecated in favour of torchao but works in torch 2.13), built faster. CPU only.

    Without ``inplace`` the input model is left untouched. A float32 CPU model is copied without copying its
    parameters: the draft shares the embeddings and norms with it (read-only at inference; fine-tuning the input
    model afterwards would change the draft's too). Other models are deep-copied to float32 on the CPU first."""
    return _swap_linears(_draft_shell(model, inplace), lambda name, linear: _int8_linear(linear))


def save_int8_weights(draft: torch.nn.Module, path: Union[str, Path], *, source: Optional[dict] = None) -> None:
    """Write the int8 weights, scales and biases of a :func:`quantize_int8` draft to a safetensors file (atomically),
    so :func:`load_int8_draft` can rebuild the draft without quantising again. ``source`` (str -> str) is stored as
    metadata to tell which float checkpoint the weights came from."""
    from safetensors.torch import save_file
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    tensors = {}
    for name, module in draft.named_modules():
        if isinstance(module, DynamicQuantizedLinear):
            weight, bias = module._weight_bias()
            tensors[f"{name}.int8"] = weight.int_repr().contiguous()
            tensors[f"{name}.scale"] = torch.tensor([weight.q_scale()], dtype=torch.float64)
            tensors[f"{name}.zero_point"] = torch.tensor([weight.q_zero_point()], dtype=torch.int64)
            if bias is not None:
                tensors[f"{name}.bias"] = bias.detach().contiguous()
    with atomic_path(path) as staging:
        save_file(tensors, staging, metadata={key: str(value) for key, value in (source or {}).items()})


class Int8Packing:
    """The int8 matrices of a :func:`save_int8_weights` file being packed on a thread per core, started before the
    model they belong to is loaded: packing runs in ATen without the GIL, so it overlaps the target's and the
    tokenizer's Python-heavy loading. :func:`load_int8_draft` takes the result.

    ``Int8Packing.start(path, source)`` is None when the file is missing, unreadable or written from another
    ``source``."""

    def __init__(self, tensors: dict):
        self.tensors = tensors
        names = [key[:-len(".int8")] for key in tensors if key.endswith(".int8")]
        # The quantized tensors are made here, on the calling thread: making them is what warns, and
        # warnings.catch_warnings is not thread-safe. The workers only pack.
        with _quiet_quantization_warnings():
            qweights = {name: torch._make_per_tensor_quantized_tensor(
                tensors[f"{name}.int8"], float(tensors[f"{name}.scale"]), int(tensors[f"{name}.zero_point"]))
                for name in names}
        pool = ThreadPoolExecutor(max(1, torch.get_num_threads()))
        self._modules = {name: pool.submit(_int8_module, qweight, tensors.get(f"{name}.bias"), qweight.shape[1],
                                           qweight.shape[0])
                         for name, qweight in qweights.items()}
        pool.shutdown(wait=False)

    @classmethod
    def start(cls, path: Union[str, Path], source: Optional[dict] = None) -> Optional["Int8Packing"]:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as stored:
                metadata = stored.metadata() or {}
                tensors = {key: stored.get_tensor(key) for key in stored.keys()}
        except (OSError, ValueError, RuntimeError, SafetensorError):  # missing, truncated or not safetensors
            return None
        if source is not None and metadata != {key: str(value) for key, value in source.items()}:
            return None
        names = [key[:-len(".int8")] for key in tensors if key.endswith(".int8")]
        if any(f"{name}.scale" not in tensors or f"{name}.zero_point" not in tensors
               or tensors[f"{name}.int8"].dim() != 2 or tensors[f"{name}.int8"].dtype != torch.int8 for name in names):
            return None
        return cls(tensors)

    def shape(self, name: str) -> Optional[tuple]:
        int8 = self.tensors.get(f"{name}.int8")
        return None if int8 is None else tuple(int8.shape)

    def module(self, name: str) -> torch.nn.Module:
        return self._modules[name].result()


def load_int8_draft(target: torch.nn.Module, path: Union[str, Path, Int8Packing], *,
                    source: Optional[dict] = None) -> Optional[torch.nn.Module]:
    """The int8 draft of ``target`` from weights :func:`save_int8_weights` wrote (a path, or an
    :class:`Int8Packing` already under way), sharing the target's other parameters as :func:`quantize_int8` does;
    None when the file is missing, unreadable, written from another ``source`` or does not cover every
    ``nn.Linear`` of ``target`` with the right shape (then quantise afresh)."""
    packing = path if isinstance(path, Int8Packing) else Int8Packing.start(path, source)
    if packing is None:
        return None
    linears = [(name, module) for name, module in target.named_modules() if type(module) is torch.nn.Linear]
    if any(packing.shape(name) != tuple(linear.weight.shape) for name, linear in linears):
        return None
    return _swap_linears(_draft_shell(target, inplace=False), lambda name, linear: packing.module(name))
