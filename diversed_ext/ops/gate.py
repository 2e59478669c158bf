"""The log-probability gate's test, row by row: which drafted tokens it keeps outright (the rule and why:
:mod:`diversed_ext.decoding.gate`). Plain PyTorch, here beside the ops so that servers apply it to their own rows
without loading the decoding loop."""

from __future__ import annotations

from typing import Optional, Union

import torch

from .reference import target_forbids


def gate_keeps(margin: Union[float, torch.Tensor], draft_tokens: torch.Tensor, draft_probs: Optional[torch.Tensor],
               target_log_probs: torch.Tensor) -> torch.Tensor:
    """[M] bool: whether the gate keeps each of M drafted tokens outright, row by row. ``margin`` a float or [M]
    (NaN: no gate on that row); ``draft_tokens`` [M]; ``draft_probs`` [M, V] the draft's distributions, or None (q
    one-hot at the drafts); ``target_log_probs`` [M, V] the target's log-probabilities, both at the temperature the
    verifier samples at. ``diversed_ext.decoding.gate`` states the rule and applies it to a loop's [B, K] drafts.
    A token the target forbids (:func:`target_forbids`: a bad word, a token outside a request's allowed set) is never
    kept, whatever the margin: the verify ops would reject it anyway, and a weight zeroed for it would be counted."""
    log_p = target_log_probs.float()
    drafted_log_p = log_p.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    if draft_probs is None:
        mass, weighted = _one_hot_residual(log_p, drafted_log_p)
    else:
        mass, weighted = _residual(log_p, draft_probs.float())
    rejected_log_p = weighted / mass.clamp_min(torch.finfo(mass.dtype).tiny)
    # Without residual mass (p = q) nothing is rejected: the weight does not matter there.
    allowed = ~target_forbids(drafted_log_p.exp())
    return (mass > 0) & (drafted_log_p >= rejected_log_p - margin) & allowed


def _residual(log_p: torch.Tensor, q: torch.Tensor) -> tuple:
    """(the mass of (p - q)+, its sum of (p - q)+ log p), row by row."""
    residual = (log_p.exp() - q).clamp_min(0.0)
    # Ids the target rules out (log p = -inf) carry no residual; 0 x -inf must not turn the sum into NaN.
    weighted = torch.where(residual > 0, residual * log_p, torch.zeros_like(residual)).sum(-1)
    return residual.sum(-1), weighted


def _one_hot_residual(log_p: torch.Tensor, drafted_log_p: torch.Tensor) -> tuple:
    """:func:`_residual` for q one-hot at the draft x, in closed form with one [M, V] temporary: (p - q)+ is p off x,
    so its mass is 1 - p(x) and its sum of p log p is the row's, less x's term."""
    p_log_p = log_p.exp().mul_(log_p).nan_to_num_(nan=0.0)  # 0 x -inf = NaN where the target rules an id out: 0
    drafted_p = drafted_log_p.exp()
    drafted_term = torch.where(drafted_p > 0, drafted_p * drafted_log_p, torch.zeros_like(drafted_p))
    return 1.0 - drafted_p, p_log_p.sum(-1) - drafted_term
