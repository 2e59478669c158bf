"""The log-probability gate's test, row by row: which drafted tokens it keeps outright (the rule and why:
:mod:`diversed_ext.decoding.gate`). Plain PyTorch, here beside the ops so that servers apply it to their own rows
without loading the decoding loop."""

from __future__ import annotations

from typing import Optional, Union

import torch


def gate_keeps(margin: Union[float, torch.Tensor], draft_tokens: torch.Tensor, draft_probs: Optional[torch.Tensor],
               target_log_probs: torch.Tensor) -> torch.Tensor:
    """[M] bool: whether the gate keeps each of M drafted tokens outright, row by row. ``margin`` a float or [M]
    (NaN: no gate on that row); ``draft_tokens`` [M]; ``draft_probs`` [M, V] the draft's distributions, or None (q
    one-hot at the drafts); ``target_log_probs`` [M, V] the target's log-probabilities, both at the temperature the
    verifier samples at. ``diversed_ext.decoding.gate`` states the rule and applies it to a loop's [B, K] drafts."""
    log_p = target_log_probs.float()
    p = log_p.exp()
    if draft_probs is None:
        q = torch.zeros_like(p).scatter_(-1, draft_tokens.unsqueeze(-1), 1.0)
    else:
        q = draft_probs.float()
    residual = (p - q).clamp_min(0.0)
    mass = residual.sum(-1)
    # Ids the target rules out (log p = -inf) carry no residual; 0 x -inf must not turn the sum into NaN.
    weighted = torch.where(residual > 0, residual * log_p, torch.zeros_like(residual)).sum(-1)
    rejected_log_p = weighted / mass.clamp_min(torch.finfo(mass.dtype).tiny)
    drafted_log_p = log_p.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    # Without residual mass (p = q) nothing is rejected: the weight does not matter there.
    return (mass > 0) & (drafted_log_p >= rejected_log_p - margin)
