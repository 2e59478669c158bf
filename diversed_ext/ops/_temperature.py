"""The temperature rule of the whole package: which temperatures are greedy, and at which temperature the
distributions are taken. The kernels follow the same rule (csrc/common/verify_math.h)."""

from __future__ import annotations

import torch


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
