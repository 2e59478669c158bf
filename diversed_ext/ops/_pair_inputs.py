"""Validation of the draft/target pairs of token_stats, mix, distribution_features and gate_keeps_logits (the verify
ops' arguments are in ``_inputs``; rows read in place follow ``_rows``' rule)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._inputs import TOKEN_DTYPES, check_pair_layout, check_value_dtype, require_device, require_rank, require_tensor
from ._rows import check_indexed_values, check_row_indices, normalize_rows
from ._temperature import temperature_tensor
from ._values import check_values

FEATURES_NAMES = ("draft_logits", "target_logits")


def normalize_stat_tokens(tokens, batch: int, length: int, vocab: int, device: torch.device,
                          check_inputs: bool) -> torch.Tensor:
    """Tokens [B, T] of token_stats: every id must lie in [0, V)."""
    require_tensor(tokens, "tokens")
    if tokens.dtype not in TOKEN_DTYPES:
        raise TypeError(f"tokens must be int32 or int64, got {tokens.dtype}")
    if tuple(tokens.shape) != (batch, length):
        raise ValueError(f"tokens must be [B, T] = [{batch}, {length}], got {tuple(tokens.shape)}")
    require_device(tokens, device, "tokens")
    tokens = tokens.to(torch.int64).contiguous()
    if check_inputs and tokens.numel() > 0:
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"tokens must lie in [0, V) with V = {vocab}, got values in [{low}, {high}]")
    return tokens


def prepare_pair(draft, target, *, from_logits, temperature, check_inputs, same_positions):
    """Checks of token_stats and mix: (B, K, V, temperature [B]) of a draft/target pair."""
    kind = "logits" if from_logits else "probabilities"
    batch, draft_positions, vocab = _check_pair_shapes(draft, target, kind, same_positions, ("draft", "target"))
    temperature_t = temperature_tensor(temperature, batch, draft.device, check_inputs)
    if check_inputs:
        check_values(draft, "draft", from_logits)
        check_values(target, "target", from_logits)
    return batch, draft_positions, vocab, temperature_t


def _check_pair_shapes(draft, target, kind, same_positions, names, same_dtype=True):
    """The pair's layout (check_pair_layout); the target has K positions (same_positions) or at least K. Returns
    (B, K, V)."""
    draft_name, target_name = names
    batch, num_positions, vocab, target_positions = check_pair_layout(draft, target, draft_name, target_name, kind,
                                                                      same_dtype)
    if same_positions and target_positions != num_positions:
        raise ValueError(f"{target_name} must have the same number of positions as {draft_name} ({num_positions}), "
                         f"got {target_positions}")
    if not same_positions and target_positions < num_positions:
        raise ValueError(f"{target_name} must have at least as many positions as {draft_name} ({num_positions}), "
                         f"got {target_positions}")
    return batch, num_positions, vocab


class FeaturesArgs(NamedTuple):
    """distribution_features' (and the gate's) tensors after the checks: the op's arguments after the two logit
    tensors, and the shape they read."""
    vocab: int
    temperature: torch.Tensor  # float32 [B]
    target_rows: Optional[torch.Tensor]  # int64 [B, T] or None
    draft_rows: Optional[torch.Tensor]
    target_temperature: Optional[torch.Tensor]  # float32 [B] or None: the target rows at ``temperature`` too
    batch: int  # B and T of the positions read
    positions: int


def prepare_features(draft_logits, target_logits, *, temperature, target_temperature, target_rows, draft_rows,
                     check_inputs: bool, draft_from_logits: bool = True) -> FeaturesArgs:
    """Checks of distribution_features and the gate's statistics: logits [B, T, V] each, or [R, V] read through
    target_rows / draft_rows ([B, T]; B and T from a 3-D tensor, or from target_rows when both are row tensors); dtypes
    each float32, bfloat16 or float16; the temperatures float or [B]. ``draft_logits`` None (the gate's tokens-only
    drafts): the target alone; probabilities (``draft_from_logits`` False, the gate's ``draft_probs``) in its place.
    With ``check_inputs`` every index in [0, R) and the rows read finite logits with one above -inf (probabilities:
    finite, non-negative, some mass)."""
    draft_name = "draft_logits" if draft_from_logits else "draft_probs"
    batch, positions, vocab = _features_layout(draft_logits, target_logits, target_rows, draft_rows, draft_name)
    device = target_logits.device
    temperature_t = temperature_tensor(temperature, batch, device, check_inputs)
    target_temperature_t = (None if target_temperature is None else
                            temperature_tensor(target_temperature, batch, device, check_inputs, "target_temperature"))
    read_tensors = ((target_rows, target_logits, "target_rows", "target_logits"),
                    (draft_rows, draft_logits, "draft_rows", draft_name))
    rows = [None if values is None else
            normalize_rows(indices, rows_name, values, name, batch, positions, "[B, T]", device)
            for indices, values, rows_name, name in read_tensors]
    if check_inputs:
        read = torch.ones((batch, positions), dtype=torch.bool, device=device)
        checked = ((draft_logits, rows[1], "draft_rows", draft_name, draft_from_logits),
                   (target_logits, rows[0], "target_rows", "target_logits", True))
        for values, indices, rows_name, name, from_logits in checked:
            if values is None:
                continue
            if indices is None:
                check_values(values, name, from_logits=from_logits)
            else:
                check_row_indices(indices, rows_name, values.shape[0], name, read)
                check_indexed_values(values, indices, read, name, from_logits=from_logits)
    return FeaturesArgs(vocab, temperature_t, rows[0], rows[1], target_temperature_t, batch, positions)


def _features_layout(draft, target, target_rows, draft_rows, draft_name) -> tuple[int, int, int]:
    """(B, T, V) of distribution_features' logits (prepare_features); ``draft`` None: the target's alone."""
    if draft is None and draft_rows is not None:
        raise ValueError("draft_rows needs draft_logits or draft_probs: without them the drafts are tokens only")
    if target_rows is None and draft_rows is None and draft is not None:
        return _check_pair_shapes(draft, target, "logits", True, (draft_name, "target_logits"), same_dtype=False)
    read = ((draft, draft_rows, draft_name, "draft_rows"), (target, target_rows, "target_logits", "target_rows"))
    for values, indices, name, rows_name in read:
        if values is None:
            continue
        require_tensor(values, name)
        check_value_dtype(values.dtype, name, "logits" if name.endswith("logits") else "probabilities")
        if indices is not None:
            require_rank(values, 2, name, f"[R, V] (rows read through {rows_name})")
        else:
            require_rank(values, 3, name, "[B, T, V]")
    if draft is not None:
        require_device(draft, target.device, draft_name, "target_logits is")
    if draft is not None and draft_rows is None:
        batch, positions = draft.shape[:2]
    elif target_rows is None:
        batch, positions = target.shape[:2]
    else:
        require_tensor(target_rows, "target_rows")
        require_rank(target_rows, 2, "target_rows", "[B, T]")
        batch, positions = target_rows.shape
    vocab = target.shape[-1]
    if vocab == 0:
        raise ValueError(f"vocabulary size V must be positive, got target_logits shape {tuple(target.shape)}")
    if draft is not None and draft.shape[-1] != vocab:
        raise ValueError(f"{draft_name} has vocabulary size {draft.shape[-1]} but target_logits has {vocab}")
    return batch, positions, vocab
