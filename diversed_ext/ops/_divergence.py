"""KL(nu_w || p) over a grid of weights, in torch ops: mixture_divergence's reference, and what it runs on devices
without a native kernel of it.

    KL(nu_w || p) = sum_v nu_w log nu_w - w sum_v p log p - (1 - w) sum_v q log p,    nu_w = w p + (1 - w) q,

the two cross sums once and the first sum once per weight, with log p floored (a token the target rules out costs a
bounded amount), over chunks of positions so the [positions, V] temporaries stay small. Computed in float32, or in
float64 for float64 logits (the tests' oracle).
"""

from __future__ import annotations

import torch

from ._temperature import distribution_temperature

POSITIONS_PER_CHUNK = 64  # positions whose [positions, V] temporaries exist at once


def grid_weights(grid_points: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The weights w = g / (G - 1), g = 0 .. G - 1, of a divergence table's columns ([G]; exactly 0 and 1 at the
    ends)."""
    points = torch.arange(grid_points, dtype=torch.float64, device=device)
    return (points / (grid_points - 1)).to(dtype)


def divergence_table(draft_logits: torch.Tensor, target_logits: torch.Tensor, temperature: torch.Tensor,
                     grid_points: int, log_floor: float) -> torch.Tensor:
    """The table from checked arguments: logits [B, T, V], temperature float32 [B] (0 counts as 1) -> float32
    [B, T, G]."""
    batch, positions, vocab = target_logits.shape
    dtype = torch.promote_types(target_logits.dtype, torch.float32)
    scale = (1.0 / distribution_temperature(temperature).to(dtype)).repeat_interleave(positions).unsqueeze(-1)
    weights = grid_weights(grid_points, dtype, target_logits.device)
    draft_rows, target_rows = draft_logits.reshape(-1, vocab), target_logits.reshape(-1, vocab)
    tables = [target_logits.new_zeros(0, grid_points, dtype=torch.float32)]
    for start in range(0, batch * positions, POSITIONS_PER_CHUNK):
        rows = slice(start, start + POSITIONS_PER_CHUNK)
        target_log = (target_rows[rows].to(dtype) * scale[rows]).log_softmax(-1)
        target_probs = target_log.exp().nan_to_num(nan=0.0)  # a row without a finite logit has no mass
        draft_probs = (draft_rows[rows].to(dtype) * scale[rows]).softmax(-1).nan_to_num(nan=0.0)
        log_p = target_log.nan_to_num(nan=log_floor).clamp_min(log_floor)
        on_target, on_draft = ((probs * log_p).sum(-1, keepdim=True) for probs in (target_probs, draft_probs))
        negentropy = torch.stack([torch.special.xlogy(mixture, mixture).sum(-1) for mixture in
                                  (weight * target_probs + (1 - weight) * draft_probs for weight in weights)], dim=-1)
        tables.append((negentropy - weights * on_target - (1 - weights) * on_draft).clamp_min(0.0).float())
    return torch.cat(tables).view(batch, positions, grid_points)
