"""A careful plain-PyTorch verifier: what a user would write instead of the fused kernel.

Same contract as ``diversed_ext.verify`` on the inputs the benchmark gives it (a float weight, every row drafting all
K tokens, sampled rows, explicit float64 uniforms). Unlike the project's reference (the test oracle, which forms the
whole [B, K, V] mixture), it touches only what verification needs: p(x) and q(x) gathered at the drafted ids, the
accept tests on those values, then one [B, V] residual (or bonus) row per request for the final sample.
"""

from __future__ import annotations

import torch


def plain_verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, weight: float,
                 uniforms: torch.Tensor):
    """(tokens [B, K+1] with -1 padding, num_accepted [B]) of one verification call."""
    batch, num_positions, vocab = draft_probs.shape
    index = draft_tokens.unsqueeze(-1)
    q = draft_probs.gather(2, index).squeeze(-1).float()
    p = target_probs[:, :num_positions].gather(2, index).squeeze(-1).float()
    nu = weight * p + (1.0 - weight) * q
    accepted = uniforms[:, :num_positions] * q.double() < nu.double()
    num_accepted = accepted.long().cumprod(1).sum(1)

    rows = torch.arange(batch, device=draft_probs.device)
    target_row = target_probs[rows, num_accepted].float()
    draft_row = draft_probs[rows, num_accepted.clamp(max=num_positions - 1)].float()
    residual = (target_row - draft_row).clamp_min(0.0)
    use_residual = (num_accepted < num_positions) & (weight > 0) & (residual.sum(-1) > 0)
    mass = torch.where(use_residual.unsqueeze(1), residual, target_row)
    cdf = mass.double().cumsum(-1)
    threshold = (uniforms[:, num_positions] * cdf[:, -1]).unsqueeze(1)
    final = torch.searchsorted(cdf, threshold, right=True).squeeze(1).clamp_max(vocab - 1)

    positions = torch.arange(num_positions + 1, device=draft_probs.device)
    padded = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), -1)], dim=1)
    tokens = torch.where(positions < num_accepted.unsqueeze(1), padded, -1)
    tokens = tokens.scatter(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return tokens, num_accepted
