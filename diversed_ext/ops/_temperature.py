"""The temperature rule of the whole package: which temperatures the ops accept, which are greedy, and at which
temperature the distributions are taken. The kernels follow the same rule (csrc/common/verify_math.h)."""

from __future__ import annotations

from typing import Optional

import torch

from .. import rules
from ._inputs import require_device


# Temperatures below this (and 0) are greedy rows: dividing logits by them would overflow to inf, and greedy is their
# limit anyway. The kernels use the same threshold (csrc/common/verify_math.h).
MIN_TEMPERATURE = 1e-6


def is_greedy_temperature(temperature):
    """Whether a temperature (a float or a tensor of them) asks for greedy decisions: 0, NaN, or below
    MIN_TEMPERATURE."""
    if isinstance(temperature, torch.Tensor):
        return ~(temperature >= MIN_TEMPERATURE)
    return not temperature >= MIN_TEMPERATURE


def distribution_temperature(temperature):
    """The temperature the distributions are taken at: ``temperature`` itself, or 1 where it is greedy (0, or below
    MIN_TEMPERATURE).

    Temperature 0 asks for greedy decisions (argmax of nu = w p + (1 - w) q), and those are made on the untempered
    distributions, so one rule serves the ops, the reference, the decoding loop and the trainer. Takes a float or a
    tensor of temperatures.
    """
    if isinstance(temperature, torch.Tensor):
        return torch.where(is_greedy_temperature(temperature), torch.ones_like(temperature), temperature)
    return 1.0 if is_greedy_temperature(temperature) else temperature


def temperature_argument(temperature, batch: int, device: torch.device, check_inputs: bool,
                         name: str = "temperature") -> tuple[Optional[torch.Tensor], float]:
    """The temperature rule, for every caller: the op's (temperature, temperature_value). A number stays a scalar
    (rules.temperature, no tensor made); a 0-d or [B] floating-point tensor becomes float32 [B], untouched when it
    already is one (contiguous). Its values are read only with ``check_inputs``."""
    if not isinstance(temperature, torch.Tensor):
        return None, rules.temperature(temperature, name)
    if not (temperature.dtype == torch.float32 and temperature.shape == (batch,) and temperature.is_contiguous()):
        temperature = _temperature_as_op_layout(temperature, batch, name)
    if temperature.device != device:
        require_device(temperature, device, name)
    if check_inputs and batch > 0:
        if bool(torch.isnan(temperature).any()):
            raise ValueError(f"{name} contains NaN")
        if bool((temperature < 0).any()):
            raise ValueError(f"{name} must be finite and >= 0, got minimum {float(temperature.min())}")
        if bool(torch.isinf(temperature).any()):
            raise ValueError(f"{name} must be finite and >= 0, got inf")
    return temperature, 1.0


def _temperature_as_op_layout(temperature: torch.Tensor, batch: int, name: str) -> torch.Tensor:
    """A 0-d or [B] floating-point temperature tensor as contiguous float32 [B]."""
    if not temperature.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {temperature.dtype}")
    if temperature.dim() == 0:
        temperature = temperature.reshape(1).expand(batch)
    if tuple(temperature.shape) != (batch,):
        raise ValueError(f"{name} must be a float or have shape [B] = [{batch}], got {tuple(temperature.shape)}")
    return temperature.to(torch.float32).contiguous()


def temperature_tensor(temperature, batch: int, device: torch.device, check_inputs: bool,
                       name: str = "temperature") -> torch.Tensor:
    """The temperature as float32 [B] even when it is a float (token_stats, mix and the references work on tensors);
    the rule is temperature_argument's."""
    temperature_t, temperature_value = temperature_argument(temperature, batch, device, check_inputs, name)
    if temperature_t is None:
        temperature_t = torch.full((batch,), temperature_value, dtype=torch.float32, device=device)
    return temperature_t
