"""How a model is run incrementally: one call ``(feed, cache, num_logits, want_hidden) -> (logits, hidden, cache)``.

``LlamaForCausalLM`` models run through :class:`diversed_ext.forward.LlamaRunner` (their own modules and
weights, a preallocated KV cache, skinny products laid out for the CPU's BLAS); any other causal LM, or any model with
``fast_forward=False``, through its own forward with a transformers cache (:class:`HFRunner`). Both give the same
outputs up to float rounding.
"""

from __future__ import annotations

import inspect
import time
from typing import Optional, Protocol, Sequence

import torch

from ..forward import LlamaRunner, supports_fast_forward
from ..forward.llama_runner import check_aux_layers
from .transfers import device_tensor


class RowRunner(Protocol):
    """What a decoding round calls on a model (HFRunner, LlamaRunner): rows of new tokens, each with its own cache,
    in; logits of each row's last ``num_logits`` positions (and last hidden states when asked) and the caches out."""

    def run_rows(self, feeds: list[list[int]], caches: list, num_logits: list[int], want_hidden: bool,
                 aux_layers: Optional[Sequence[int]] = None):
        """``(logits, hidden, caches)``; with ``aux_layers``, a fourth output: the residual streams entering those
        decoder layers at every fed position, [tokens fed, len(aux_layers) * H] (what an EAGLE-3 drafter reads)."""


class Clock:
    """perf_counter that first waits for the device, so CUDA times are not just launch times."""

    def __init__(self, device: torch.device, synchronize: bool):
        self.synchronize = synchronize and device.type == "cuda"
        self.device = device

    def __call__(self) -> float:
        if self.synchronize:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def model_device(model: torch.nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    # a model without parameters or buffers computes nothing of its own; the CPU is as good as any device
    return torch.device("cpu")


def _forward_parameters(model: torch.nn.Module) -> frozenset:
    try:
        return frozenset(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


def cache_keyword(model: torch.nn.Module) -> str:
    """The name ``model``'s forward takes and returns its cache by: ``cache`` where the forward declares it
    (transformers 5.2x, which deprecates ``past_key_values`` and removes it in 5.40), else ``past_key_values``
    (earlier versions, and models whose forward does not say)."""
    return "cache" if "cache" in _forward_parameters(model) else "past_key_values"


class HFRunner:
    """Incremental forward passes through the model's own forward and a transformers cache; the same call as
    :class:`diversed_ext.forward.LlamaRunner`: ``(feed, cache, num_logits, want_hidden) -> (logits [num_logits, V],
    hidden [num_logits, H] or None, cache)``."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model = model
        self.device = device
        self.keeps_logits = "logits_to_keep" in _forward_parameters(model)
        self.cache_keyword = cache_keyword(model)

    def __call__(self, feed: list[int], cache, num_logits: int, want_hidden: bool,
                 aux_layers: Optional[tuple] = None):
        kwargs = {self.cache_keyword: cache, "use_cache": True}
        if self.keeps_logits:
            kwargs["logits_to_keep"] = num_logits  # skip the LM head on positions nobody reads
        if want_hidden or aux_layers:
            kwargs["output_hidden_states"] = True
        output = self.model(device_tensor([feed], torch.int64, self.device), **kwargs)
        hidden = output.hidden_states[-1][0, -num_logits:] if want_hidden else None
        logits, cache = output.logits[0, -num_logits:], getattr(output, self.cache_keyword)
        if aux_layers is None:
            return logits, hidden, cache
        # hidden_states[l] is the residual stream entering decoder layer l (index 0: the embeddings).
        return logits, hidden, cache, torch.cat([output.hidden_states[layer][0] for layer in aux_layers], dim=-1)

    def run_rows(self, feeds: list[list[int]], caches: list, num_logits: list[int], want_hidden: bool,
                 aux_layers: Optional[Sequence[int]] = None):
        """Several sequences, each through its own cache, one forward call per row; the outputs stacked in row order
        as :meth:`diversed_ext.forward.LlamaRunner.run_rows` gives them (aux hidden states fourth, with
        ``aux_layers``).

        One call per row rather than one padded call: a transformers cache crops every row by the same count, while
        the loop crops each row to its own accepted length, and per-row calls keep each row's result independent of
        its neighbours (no padding, no shared activation scale in int8 layers)."""
        if aux_layers is not None:
            aux_layers = check_aux_layers(aux_layers, self.model.config.num_hidden_layers)
        outputs = [self(feed, cache, wanted, want_hidden, aux_layers)
                   for feed, cache, wanted in zip(feeds, caches, num_logits)]
        logits = torch.cat([output[0] for output in outputs])
        hidden = torch.cat([output[1] for output in outputs]) if want_hidden else None
        if aux_layers is None:
            return logits, hidden, [output[2] for output in outputs]
        return logits, hidden, [output[2] for output in outputs], torch.cat([output[3] for output in outputs])


def make_runner(model: torch.nn.Module, device: torch.device, fast_forward: bool):
    if fast_forward and supports_fast_forward(model):
        return LlamaRunner(model)
    return HFRunner(model, device)


def crop_cache(cache, cached_length: int, keep: int) -> int:
    """Drop cache entries past ``keep`` tokens; returns the new cached length.

    transformers 5 crops by a negative count (tokens to remove); 4.x accepts the same form."""
    if cache is not None and cached_length > keep:
        cache.crop(keep - cached_length)
        return keep
    return cached_length
