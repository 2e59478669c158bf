"""Value checks of the ops' inputs (``check_inputs=True``): they read every value, so they synchronise with the device.

Without them the kernels stay memory-safe by construction and treat bad values by fixed rules (csrc/common/verify_math.h).
"""

from __future__ import annotations

from typing import Optional

import torch


def _probability_row_maxima(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Per-row minima and maxima find NaN (both propagate it), negative and infinite entries; returns every row's
    largest entry, so rows without mass are found without reading the tensor again. amin and amax along the last
    dimension are two fast vectorised reductions; torch's aminmax along a dimension is about 25x slower on the CPU."""
    row_min, row_max = tensor.amin(-1), tensor.amax(-1)
    low, high = float(row_min.min()), float(row_max.max())
    if low != low or high != high:
        raise ValueError(f"{name} contains NaN")
    if low < 0:
        raise ValueError(f"{name} contains negative probabilities (minimum {low})")
    if high == float("inf"):
        raise ValueError(f"{name} contains infinite values")
    return row_max


def _drafted_lengths(num_draft: Optional[torch.Tensor], batch: int, num_positions: int,
                     device: torch.device) -> torch.Tensor:
    """num_draft, or K for every row when it is absent."""
    return torch.full((batch,), num_positions, device=device) if num_draft is None else num_draft


def check_verify_probabilities(draft: torch.Tensor, target: torch.Tensor, num_draft: Optional[torch.Tensor],
                               draft_name: str, target_name: str) -> None:
    """The value checks of verify's probabilities, and every row the verifier reads needs some mass: draft rows
    k < num_draft[b] (q at a rejection) and target rows k <= num_draft[b]. Rows past them are never read, so a server
    may leave them as zero padding. One pass over each tensor."""
    if draft.numel() + target.numel() == 0:
        return
    num_draft = _drafted_lengths(num_draft, draft.shape[0], draft.shape[1], draft.device)
    positions = torch.arange(target.shape[1], device=target.device).unsqueeze(0)
    read_draft = positions[:, :-1] < num_draft.unsqueeze(1)
    read_target = positions <= num_draft.unsqueeze(1)
    for tensor, name, read in ((draft, draft_name, read_draft), (target, target_name, read_target)):
        if tensor.numel() == 0:
            continue
        empty = (_probability_row_maxima(tensor, name) == 0) & read
        if bool(empty.any()):
            batch_index, position = (int(index) for index in empty.nonzero()[0])
            raise ValueError(f"{name} has a row with no probability mass (all zeros) at [{batch_index}, {position}]")


def check_token_ids(draft_tokens: torch.Tensor, num_draft: Optional[torch.Tensor], vocab: int) -> None:
    """Token ids at drafted positions (i < num_draft) must lie in [0, V); padding past num_draft is ignored."""
    if draft_tokens.numel() == 0:
        return
    num_draft = _drafted_lengths(num_draft, draft_tokens.shape[0], draft_tokens.shape[1], draft_tokens.device)
    drafted = torch.arange(draft_tokens.shape[1], device=draft_tokens.device) < num_draft.unsqueeze(1)
    bad = drafted & ((draft_tokens < 0) | (draft_tokens >= vocab))
    if bool(bad.any()):
        row, position = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"draft_tokens[{row}, {position}] = {int(draft_tokens[row, position])} is outside [0, V) "
                         f"with V = {vocab}")


def _check_logit_values(tensor: torch.Tensor, name: str) -> None:
    """Logits may be -inf (masked vocabulary) but not NaN or +inf, and every row needs one finite entry."""
    if tensor.numel() == 0:
        return
    if bool(torch.isnan(tensor).any()):
        raise ValueError(f"{name} contains NaN")
    row_max = tensor.amax(-1)
    if bool((row_max == float("inf")).any()):
        raise ValueError(f"{name} contains +inf")
    if bool((row_max == float("-inf")).any()):
        raise ValueError(f"{name} has a row whose logits are all -inf (no token is possible)")


def check_values(tensor: torch.Tensor, name: str, from_logits: bool) -> None:
    """Value checks of a probability or logit tensor (one or two passes, one host sync)."""
    if tensor.numel() == 0:
        return
    if from_logits:
        _check_logit_values(tensor, name)
    else:
        _probability_row_maxima(tensor, name)
