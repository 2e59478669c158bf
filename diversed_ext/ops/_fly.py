"""FLy, the entropy-gated deferred verification vLLM ships, as an option of the verify ops: its argument rules and
the references' deferral rule (the kernels' is csrc/common/fly_math.h).

At drafted position i of a request with n drafts, a draft that the exact test rejects (u_i q_i(x_i) < nu_i(x_i), or
x_i == argmax nu_i for a greedy row) is accepted anyway when its id is valid, the target allows it (p_i(x_i) at least
MIN_TARGET_MASS: never a token the target forbids), q_i(x_i) > 0 for a sampled row, i + W < n, the next W drafts all
pass the exact test, and the target's top-k entropy at i, -sum_{top k} p log p over the target's k largest
probabilities, is at least tau. The usual prefix rule follows. The output no longer follows nu: FLy trades fidelity
for acceptance.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import rules
from ._inputs import require_device



def _per_request_tensor(values: torch.Tensor, batch: int, device: torch.device, name: str,
                        integer: bool) -> torch.Tensor:
    """A 0-d or [B] tensor of a per-request setting as contiguous int64 (``integer``) or float32 [B]."""
    if integer and (values.is_floating_point() or values.is_complex() or values.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor, got dtype {values.dtype}")
    if not integer and not values.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {values.dtype}")
    if values.dim() == 0:
        values = values.reshape(1).expand(batch)
    if tuple(values.shape) != (batch,):
        number = "an int" if integer else "a float"
        raise ValueError(f"{name} must be {number} or have shape [B] = [{batch}], got {tuple(values.shape)}")
    require_device(values, device, name)
    return values.to(torch.int64 if integer else torch.float32).contiguous()


def fly_arguments(fly_window, fly_threshold, fly_top_k, batch: int, num_positions: int, device: torch.device,
                  check_inputs: bool) -> tuple:
    """The op's trailing FLy arguments (fly_window, fly_threshold, fly_window_value, fly_threshold_value, fly_top_k),
    or () when FLy is off for the whole call (a window of 0) with the other two at their defaults. Numbers are always
    checked (no sync); tensor values, and a window's bound W < K, only with ``check_inputs`` (otherwise the kernels
    treat a window outside [0, K - 1] as 0: one of K or more never fits after a rejection)."""
    top_k = rules.fly_top_k(fly_top_k)
    window_t = threshold_t = None
    window_value, threshold_value = 0, rules.FLY_DEFAULT_THRESHOLD
    if isinstance(fly_window, torch.Tensor):
        window_t = _per_request_tensor(fly_window, batch, device, "fly_window", integer=True)
    else:
        window_value = rules.fly_window(fly_window)
    if isinstance(fly_threshold, torch.Tensor):
        threshold_t = _per_request_tensor(fly_threshold, batch, device, "fly_threshold", integer=False)
    else:
        threshold_value = rules.fly_threshold(fly_threshold)
    if check_inputs:
        _check_fly_values(window_t, window_value, threshold_t, num_positions)
    defaults = threshold_value == rules.FLY_DEFAULT_THRESHOLD and top_k == rules.FLY_DEFAULT_TOP_K
    if window_t is None and window_value == 0 and threshold_t is None and defaults:
        return ()
    return window_t, threshold_t, window_value, threshold_value, top_k


def _check_fly_values(window_t, window_value: int, threshold_t, num_positions: int) -> None:
    bound = (f"fly_window must be < K = {num_positions}, the drafted length (a window of K or more never defers, "
             f"as in vLLM); got")
    if window_t is not None and window_t.numel() > 0:
        low, high = int(window_t.min()), int(window_t.max())
        if low < 0:
            raise ValueError(f"fly_window must be >= 0 (0 switches FLy off), got minimum {low}")
        if high > 0 and high >= num_positions:
            raise ValueError(f"{bound} {high}")
    elif window_value > 0 and window_value >= num_positions:
        raise ValueError(f"{bound} {window_value}")
    if threshold_t is not None and threshold_t.numel() > 0:
        if bool(torch.isnan(threshold_t).any()):
            raise ValueError("fly_threshold contains NaN")
        if bool((threshold_t < 0).any()):
            raise ValueError(f"fly_threshold must be >= 0, got minimum {float(threshold_t.min())}")


def fly_as_given(fly_window, fly_threshold, fly_top_k) -> Optional[tuple]:
    """The trailing FLy arguments of an unchecked call when they go to the op as given (numbers, or int64 / float32
    [B] contiguous tensors), () when FLy is off with default settings, else None (prepare them with fly_arguments).
    Written for speed: it runs on every serving call."""
    if type(fly_window) is int and fly_window == 0 and type(fly_threshold) is float \
            and fly_threshold == rules.FLY_DEFAULT_THRESHOLD and type(fly_top_k) is int \
            and fly_top_k == rules.FLY_DEFAULT_TOP_K:
        return ()
    if isinstance(fly_window, torch.Tensor):
        if not (fly_window.dtype == torch.int64 and fly_window.dim() == 1 and fly_window.is_contiguous()):
            return None
        window_t, window_value = fly_window, 0
    else:
        window_t, window_value = None, rules.fly_window(fly_window)
    if isinstance(fly_threshold, torch.Tensor):
        if not (fly_threshold.dtype == torch.float32 and fly_threshold.dim() == 1 and fly_threshold.is_contiguous()):
            return None
        threshold_t, threshold_value = fly_threshold, rules.FLY_DEFAULT_THRESHOLD
    else:
        threshold_t, threshold_value = None, rules.fly_threshold(fly_threshold)
    return window_t, threshold_t, window_value, threshold_value, rules.fly_top_k(fly_top_k)


# ------------------------------------------------------------------------------------------------ the references' rule

def fly_entropy(target_probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """-sum over the k largest probabilities of p log p, per row of [..., V] sanitised float32 probabilities, in
    float64 with the terms added in decreasing order of p (the kernels' order): float64 [...]."""
    top = torch.topk(target_probs, min(top_k, target_probs.shape[-1]), dim=-1).values.double()
    terms = torch.where(top > 0, top * top.log(), torch.zeros_like(top))
    total = torch.zeros(terms.shape[:-1], dtype=torch.float64, device=terms.device)
    for j in range(terms.shape[-1]):
        total = total + terms[..., j]
    return -total


def fly_deferred(native: torch.Tensor, deferrable: torch.Tensor, entropy: torch.Tensor, window: torch.Tensor,
                 threshold: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """bool [B, K]: positions FLy accepts although the exact test rejected them. ``native`` [B, K] the exact tests
    (False past num_draft), ``deferrable`` [B, K] fly_deferrable's condition, ``entropy`` float64 [B, K], ``window``
    int64 [B] (0 where outside [0, K - 1], as in the kernels), ``threshold`` float32 [B]. Equivalent to the kernels'
    walk: a deferred position's window holds only exact passes, so the prefix rule over native | deferred is theirs."""
    batch, num_positions = native.shape
    positions = torch.arange(num_positions, device=native.device).unsqueeze(0)
    window = torch.where((window < 0) | (window >= num_positions), 0, window).unsqueeze(1)
    counts = torch.cat([torch.zeros(batch, 1, dtype=torch.int64, device=native.device),
                        native.long().cumsum(1)], dim=1)  # counts[:, j]: passes among positions < j
    window_end = (positions + 1 + window).clamp(max=num_positions)
    passes_in_window = counts.gather(1, window_end) - counts[:, 1:]
    window_passed = (window > 0) & (positions + window < num_draft.unsqueeze(1)) & (passes_in_window == window)
    entropy_passed = entropy >= threshold.double().unsqueeze(1)
    return ~native & deferrable & window_passed & entropy_passed


def fly_tensors(fly: tuple, batch: int, device: torch.device) -> Optional[tuple]:
    """fly_arguments' result as (window int64 [B], threshold float32 [B], top_k) for the references, or None when the
    call leaves FLy off."""
    if not fly:
        return None
    window_t, threshold_t, window_value, threshold_value, top_k = fly
    if window_t is None:
        window_t = torch.full((batch,), window_value, dtype=torch.int64, device=device)
    if threshold_t is None:
        threshold_t = torch.full((batch,), threshold_value, dtype=torch.float32, device=device)
    return window_t, threshold_t, top_k
