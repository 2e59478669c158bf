"""Validation of the draft/target pairs of token_stats, mix and distribution_features (the verify ops' arguments are
in ``_inputs``)."""

from __future__ import annotations

import torch

from ._inputs import TOKEN_DTYPES, check_pair_layout, require_device, require_tensor
from ._temperature import temperature_tensor
from ._values import check_values


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


def prepare_pair(draft, target, *, from_logits, temperature, check_inputs, same_positions,
                 names=("draft", "target")):
    """Checks of token_stats, mix and distribution_features: (B, K, V, temperature [B]) of a draft/target pair, which
    errors call by ``names``."""
    kind = "logits" if from_logits else "probabilities"
    batch, draft_positions, vocab = _check_pair_shapes(draft, target, kind, same_positions, names)
    temperature_t = temperature_tensor(temperature, batch, draft.device, check_inputs)
    if check_inputs:
        check_values(draft, names[0], from_logits)
        check_values(target, names[1], from_logits)
    return batch, draft_positions, vocab, temperature_t


def _check_pair_shapes(draft, target, kind, same_positions, names):
    """The pair's layout (check_pair_layout); the target has K positions (same_positions) or at least K. Returns
    (B, K, V)."""
    draft_name, target_name = names
    batch, num_positions, vocab, target_positions = check_pair_layout(draft, target, draft_name, target_name, kind)
    if same_positions and target_positions != num_positions:
        raise ValueError(f"{target_name} must have the same number of positions as {draft_name} ({num_positions}), "
                         f"got {target_positions}")
    if not same_positions and target_positions < num_positions:
        raise ValueError(f"{target_name} must have at least as many positions as {draft_name} ({num_positions}), "
                         f"got {target_positions}")
    return batch, num_positions, vocab
