"""Activation smoothing for the int8 draft (SmoothQuant, Xiao et al. 2023), folded into the float weights before they
are quantised.

An int8 product quantises each token's input with one scale, set by the token's largest feature. A few channels of a
Llama's normed activations run tens of times larger than the rest, so most features get a handful of int8 levels.
Smoothing divides input channel ``j`` by ``s_j`` and multiplies the weight's column ``j`` by ``s_j``: the float
product is unchanged, the outliers move into the weights, which are quantised per output feature and take them well.
With ``a_j`` the largest |input| seen in channel ``j`` over calibration tokens and ``m_j`` the largest |weight| in
column ``j`` (over every product reading that input), ``s_j = a_j ** alpha / m_j ** (1 - alpha)``.

The division is folded into what produces the input, so the draft computes nothing more:

- q, k, v read the input RMSNorm's output: its weight is divided by ``s``;
- gate and up read the post-attention RMSNorm's output: likewise;
- down reads ``act(gate) * up``, linear in up's output: up's rows are divided by ``s`` (its per-row int8 scale absorbs
  that).

The o projection (whose input mixes heads that share a key-value head) and the LM head (whose input, the final norm's
output, is the hidden state DIVERSED heads read) are left as they are. Only a Llama-shaped model (``model.layers``
of decoder layers with ``input_layernorm`` and ``post_attention_layernorm`` RMSNorms of :data:`SMOOTHABLE_NORMS`,
and ``nn.Linear`` ``self_attn.{q,k,v}_proj`` and ``mlp.{gate,up,down}_proj``) is smoothed; other models are quantised
unsmoothed.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

# How far outliers move into the weights: on the default pair 0.5 leaves the draft closest to the target (mean TV per
# token on 16 GSM8K test prompts: 0.4 / 0.5 / 0.6 / 0.75 give 0.045 / 0.044 / 0.048 / 0.060; on 16 train prompts 0.047 /
# 0.043 / 0.046), SmoothQuant's own default.
SMOOTHING_ALPHA = 0.5
SMOOTHING_FLOOR = 1e-5  # a channel or column never seen non-zero keeps a finite factor
# RMSNorms that scale by their weight (Gemma's scale by 1 + weight, so a division would not fold into them).
SMOOTHABLE_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
LAYERS = "model.layers"  # where a Llama causal LM keeps its decoder layers (``model.model.layers``)
# Each norm of a decoder layer and the products that read its output; the first product's input maxima stand for all.
NORM_FED = (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")))


def llama_decoder_layers(model: torch.nn.Module) -> Optional[list]:
    """The decoder layers of a Llama-shaped causal LM (``model.model.layers``), or None when ``model`` is not one."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not len(layers):
        return None
    products = [path for _, paths in NORM_FED for path in paths] + ["mlp.down_proj"]
    for layer in layers:
        try:
            norms = [layer.get_submodule(norm) for norm, _ in NORM_FED]
            linears = [layer.get_submodule(path) for path in products]
        except AttributeError:
            return None
        if any(type(norm).__name__ not in SMOOTHABLE_NORMS for norm in norms):
            return None
        if any(not isinstance(linear, torch.nn.Linear) for linear in linears):
            return None
    return list(layers)


def input_maxima(model: torch.nn.Module, batches: Iterable[torch.Tensor]) -> dict:
    """name -> float32 [in_features]: the largest |input| each ``nn.Linear`` of ``model`` saw in each input channel
    while ``model`` ran on every batch of token ids in ``batches`` (each [B, T] or [T])."""
    maxima: dict = {}
    handles = []
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear:
            def record(module, inputs, output, name=name):
                seen = inputs[0].detach().abs().reshape(-1, inputs[0].shape[-1]).amax(dim=0).float().cpu()
                maxima[name] = seen if name not in maxima else torch.maximum(maxima[name], seen)
            handles.append(module.register_forward_hook(record))
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for ids in batches:
                ids = torch.as_tensor(ids, dtype=torch.long, device=device)
                model(input_ids=ids.unsqueeze(0) if ids.dim() == 1 else ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return maxima


def smoothing_factors(input_max: torch.Tensor, weights: Iterable[torch.Tensor],
                      alpha: float = SMOOTHING_ALPHA) -> torch.Tensor:
    """``s`` [K] for products whose weights [N_i, K] all read one input whose channels reach ``input_max`` [K]."""
    column_max = torch.stack([weight.detach().float().cpu().abs().amax(dim=0) for weight in weights]).amax(dim=0)
    factors = input_max.clamp(min=SMOOTHING_FLOOR) ** alpha / column_max.clamp(min=SMOOTHING_FLOOR) ** (1 - alpha)
    return factors.clamp(min=SMOOTHING_FLOOR)


def smoothed_llama(model: torch.nn.Module, maxima: dict, alpha: float = SMOOTHING_ALPHA) -> tuple:
    """``(weights, vectors)``: the float weights to quantise (linear name -> [N, K]) and the norm weights to use
    instead of the model's (parameter name -> [K]) once the layers' inputs are smoothed with ``maxima`` from
    :func:`input_maxima`; two empty dicts for a model that is not Llama-shaped or whose maxima miss a layer. Reads
    ``model``, changes nothing."""
    layers = llama_decoder_layers(model)
    if layers is None:
        return {}, {}
    weights, vectors = {}, {}
    for index, layer in enumerate(layers):
        name = f"{LAYERS}.{index}"
        inputs = [f"{name}.{paths[0]}" for _, paths in NORM_FED] + [f"{name}.mlp.down_proj"]
        if any(key not in maxima for key in inputs):
            return {}, {}
        for norm, paths in NORM_FED:
            modules = [layer.get_submodule(path) for path in paths]
            factors = smoothing_factors(maxima[f"{name}.{paths[0]}"], [module.weight for module in modules], alpha)
            vectors[f"{name}.{norm}.weight"] = layer.get_parameter(f"{norm}.weight").detach().float().cpu() / factors
            for path, module in zip(paths, modules):
                weights[f"{name}.{path}"] = module.weight.detach().float().cpu() * factors
        mlp = layer.mlp
        if mlp.up_proj.bias is None:  # a bias would have to shrink with up's rows
            down = smoothing_factors(maxima[f"{name}.mlp.down_proj"], [mlp.down_proj.weight], alpha)
            weights[f"{name}.mlp.down_proj"] = mlp.down_proj.weight.detach().float().cpu() * down
            weights[f"{name}.mlp.up_proj"] = weights[f"{name}.mlp.up_proj"] / down.unsqueeze(1)
    return weights, vectors
