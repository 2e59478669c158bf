"""The DIVERSED training objective (REINFORCE++ style), free of models so it can be tested exactly.

For a batch of N sequences with rewards r_n, per-token weights w_t = head(h_draft_t, h_target_t) and, at each
generated token y_t, the target and draft probabilities p_t(y_t), q_t(y_t) and TV_t = TV(p_t, q_t):

    A_n   = (r_n - mean(r)) / (std(r) + eps)                                  advantage normalised over the batch
    loss  = (1/N) sum_n [ -A_n * sum_t log nu_t(y_t)  -  lambda * sum_t (1 - w_t * TV_t) ]
    log nu_t(y_t) = logaddexp(log w_t + log p_t(y_t), log(1 - w_t) + log q_t(y_t))

The first term is the policy gradient of the task reward through the mixture the tokens were sampled from; the second
rewards acceptance: the expected acceptance rate at position t is 1 - w_t TV_t, so the regulariser pushes w down where
the models disagree. (The authors' released code flips this sign, which pushes acceptance down instead.) Only the head
receives gradients: p, q and TV are constants.

Optional third term, the expected fidelity (coefficient mu >= 0, off by default):

    loss += -(mu/N) sum_n sum_t (1 - w_t) * G_t,     G_t = E_{q_t}[log p_t] - E_{p_t}[log p_t]

Drawing token t from nu_t = w_t p_t + (1 - w_t) q_t rather than from p_t changes its expected target log-probability
by exactly (1 - w_t) G_t, so this term is the fidelity reward's next-token part in closed form: no sampling variance,
at the price of ignoring how w_t shapes the later context. G_t < 0 where mixing in the draft costs fidelity, so the
term pushes w_t up there, against the acceptance regulariser; the balance of mu and lambda sets the operating point.

The acceptance and expected-fidelity terms are linear in w_t, with slope c_t = lambda TV_t + mu G_t per token: their
minimiser is w_t = 1 where c_t < 0 and 0 elsewhere, and through a sigmoid head their gradient c_t w_t (1 - w_t)
vanishes once w_t saturates, on the wrong side too. ``closed_form="logistic"`` replaces the two terms by the surrogate

    (1/N) sum_n sum_t |c_t| * BCE(w_t, 1[c_t < 0])

with the same token-by-token minimiser, whose gradient |c_t| (w_t - 1[c_t < 0]) in the head's logit does not vanish
where the head is wrong. (The logged acceptance and expected-fidelity terms stay the linear ones.)

Optional fourth term, the expected divergence from the target (coefficient kappa >= 0, off by default):

    loss += (kappa/N) sum_n sum_t KL(nu_t || p_t)

the KL divergence of the law token t is drawn from to the target's, 0 at w_t = 1. A colder output gains fidelity
(the third term rewards it) but never lowers this one, so a head trained on it with the acceptance regulariser
learns where mixing in the draft costs the target's law least per unit of acceptance. KL(nu || p) is convex in w with
no closed form in it, so the teacher-forced pass tabulates it at ``KL_GRID_POINTS`` evenly spaced weights from 0 to 1
(:func:`.teacher_forcing.mixture_divergence`) and :func:`interpolated_kl` reads it piecewise linearly, which keeps
it convex and differentiable almost everywhere in w. With the acceptance term its per-token minimiser lies between
0 and 1, where a sigmoid head does not saturate, so it goes with the linear closed form (the logistic surrogate is
for linear terms only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import rules
from ..ops import grid_weights

ADVANTAGE_EPSILON = 1e-6
CLOSED_FORMS = ("linear", "logistic")
WEIGHT_CLAMP = 1e-6  # keeps log w and log(1 - w) finite at the ends of (0, 1)
# weights 0, 1/16, ..., 1 at which KL(nu_w || p) is tabulated per token: mixture_divergence's default table
KL_GRID_POINTS = rules.DEFAULT_GRID_POINTS


def normalized_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """(r - mean) / (std + eps) over the batch; all-equal rewards give zero advantages (no policy signal)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    rewards = rewards.double()
    if rewards.numel() < 2:
        return torch.zeros_like(rewards)
    centered = rewards - rewards.mean()
    return centered / (rewards.std(unbiased=False) + ADVANTAGE_EPSILON)


def log_mixture_prob(weights: torch.Tensor, target_logprob: torch.Tensor, draft_logprob: torch.Tensor) -> torch.Tensor:
    """log(w p + (1 - w) q) from log p and log q, stable where either probability underflows."""
    weights = weights.clamp(WEIGHT_CLAMP, 1.0 - WEIGHT_CLAMP)
    return torch.logaddexp(weights.log() + target_logprob, torch.log1p(-weights) + draft_logprob)


def kl_grid(dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The weights w = 0, 1/16, ..., 1 at which a token's KL(nu_w || p) is tabulated ([KL_GRID_POINTS]): the columns
    of :func:`diversed_ext.mixture_divergence`'s table."""
    return grid_weights(KL_GRID_POINTS, dtype, device)


def interpolated_kl(weights: torch.Tensor, kl_table: torch.Tensor) -> torch.Tensor:
    """KL(nu_w || p) at each token's ``weights`` [...] from its table [..., KL_GRID_POINTS] at w = 0, 1/16, ..., 1,
    linear between grid points (weights outside [0, 1] read the ends); differentiable in ``weights``."""
    if kl_table.shape != weights.shape + (KL_GRID_POINTS,):
        raise ValueError(f"kl_table must have shape {tuple(weights.shape) + (KL_GRID_POINTS,)} (the weights' and "
                         f"{KL_GRID_POINTS} grid points), got {tuple(kl_table.shape)}")
    position = weights.clamp(0.0, 1.0) * (KL_GRID_POINTS - 1)
    lower = position.detach().floor().clamp(max=KL_GRID_POINTS - 2)
    below = kl_table.gather(-1, lower.long().unsqueeze(-1)).squeeze(-1).to(weights.dtype)
    above = kl_table.gather(-1, lower.long().unsqueeze(-1) + 1).squeeze(-1).to(weights.dtype)
    return below + (position - lower) * (above - below)


@dataclass
class ObjectiveTerms:
    """The loss and what it is made of, for logging."""

    loss: torch.Tensor  # scalar, differentiable in the weights
    policy_term: torch.Tensor  # -(1/N) sum_n A_n sum_t log nu
    acceptance_term: torch.Tensor  # -(lambda/N) sum_n sum_t (1 - w TV)
    expected_fidelity_term: torch.Tensor  # -(mu/N) sum_n sum_t (1 - w) G
    expected_kl_term: torch.Tensor  # (kappa/N) sum_n sum_t KL(nu_t || p_t)
    mean_weight: torch.Tensor
    expected_acceptance: torch.Tensor  # mean over tokens of 1 - w TV
    expected_kl: torch.Tensor  # mean over tokens of KL(nu_t || p_t) (NaN without a kl_table)
    advantages: torch.Tensor


def diversed_objective(weights: torch.Tensor, target_logprob: torch.Tensor, draft_logprob: torch.Tensor,
                       total_variation: torch.Tensor, rewards: torch.Tensor, mask: Optional[torch.Tensor] = None,
                       acceptance_coef: float = 0.1, fidelity_gap: Optional[torch.Tensor] = None,
                       expected_fidelity_coef: float = 0.0, closed_form: str = "linear",
                       kl_table: Optional[torch.Tensor] = None, expected_kl_coef: float = 0.0) -> ObjectiveTerms:
    """The DIVERSED loss for a batch of N generated sequences of up to T tokens.

    Args:
        weights: [N, T] head outputs w_t in (0, 1) (requires grad).
        target_logprob, draft_logprob, total_variation: [N, T] from :func:`diversed_ext.token_stats` at the
            generated tokens.
        rewards: [N] sequence rewards.
        mask: [N, T] bool, True at generated tokens (padding excluded); None means every position counts.
        acceptance_coef: lambda >= 0, the weight of the acceptance regulariser.
        fidelity_gap: [N, T] G_t (see the module docstring; :func:`diversed_ext.research.teacher_forcing.fidelity_gap`),
            needed when ``expected_fidelity_coef`` > 0.
        expected_fidelity_coef: mu >= 0, the weight of the expected-fidelity term.
        closed_form: ``"linear"`` (the two terms as written) or ``"logistic"`` (their surrogate; module docstring).
        kl_table: [N, T, KL_GRID_POINTS] KL(nu || p) of each token at w = 0, 1/16, ..., 1
            (:func:`diversed_ext.research.teacher_forcing.mixture_divergence`), needed when ``expected_kl_coef`` > 0.
        expected_kl_coef: kappa >= 0, the weight of the expected-divergence term (linear closed form only).
    """
    if closed_form not in CLOSED_FORMS:
        raise ValueError(f"closed_form must be one of {', '.join(CLOSED_FORMS)}, got {closed_form!r}")
    if acceptance_coef < 0:
        raise ValueError(f"acceptance_coef must be >= 0 (it rewards acceptance), got {acceptance_coef}")
    if expected_fidelity_coef < 0:
        raise ValueError(f"expected_fidelity_coef must be >= 0, got {expected_fidelity_coef}")
    if expected_fidelity_coef > 0 and fidelity_gap is None:
        raise ValueError("expected_fidelity_coef > 0 needs fidelity_gap")
    check_kl_options(expected_kl_coef, closed_form)
    if expected_kl_coef > 0 and kl_table is None:
        raise ValueError("expected_kl_coef > 0 needs kl_table")
    shape = weights.shape
    named = [("target_logprob", target_logprob), ("draft_logprob", draft_logprob), ("total_variation", total_variation)]
    if fidelity_gap is not None:
        named.append(("fidelity_gap", fidelity_gap))
    for name, tensor in named:
        if tensor.shape != shape:
            raise ValueError(f"{name} must have the weights' shape {tuple(shape)}, got {tuple(tensor.shape)}")
    if rewards.shape != shape[:1]:
        raise ValueError(f"rewards must have shape [N] = [{shape[0]}], got {tuple(rewards.shape)}")
    mask = torch.ones(shape, dtype=torch.bool, device=weights.device) if mask is None else mask.bool()
    if mask.shape != shape:
        raise ValueError(f"mask must have the weights' shape {tuple(shape)}, got {tuple(mask.shape)}")

    advantages = normalized_advantages(rewards).to(weights.dtype)
    log_nu = log_mixture_prob(weights, target_logprob.to(weights.dtype), draft_logprob.to(weights.dtype))
    sequence_log_nu = torch.where(mask, log_nu, torch.zeros_like(log_nu)).sum(-1)
    acceptance = torch.where(mask, 1.0 - weights * total_variation.to(weights.dtype), torch.zeros_like(weights))
    num_sequences = shape[0]
    policy_term = -(advantages * sequence_log_nu).sum() / num_sequences
    acceptance_term = -acceptance_coef * acceptance.sum() / num_sequences
    expected_fidelity_term = torch.zeros((), dtype=weights.dtype, device=weights.device)
    if expected_fidelity_coef > 0:
        fidelity_change = torch.where(mask, (1.0 - weights) * fidelity_gap.to(weights.dtype), torch.zeros_like(weights))
        expected_fidelity_term = -expected_fidelity_coef * fidelity_change.sum() / num_sequences
    num_tokens = mask.sum().clamp_min(1)
    expected_kl_term = torch.zeros((), dtype=weights.dtype, device=weights.device)
    expected_kl = torch.full((), float("nan"), dtype=weights.dtype, device=weights.device)
    if kl_table is not None:
        divergence = torch.where(mask, interpolated_kl(weights, kl_table), torch.zeros_like(weights))
        expected_kl_term = expected_kl_coef * divergence.sum() / num_sequences
        expected_kl = divergence.detach().sum() / num_tokens
    closed_form_loss = acceptance_term + expected_fidelity_term
    if closed_form == "logistic":
        closed_form_loss = _logistic_surrogate(weights, total_variation, fidelity_gap, mask, acceptance_coef,
                                               expected_fidelity_coef)
    return ObjectiveTerms(
        loss=policy_term + closed_form_loss + expected_kl_term,
        policy_term=policy_term.detach(),
        acceptance_term=acceptance_term.detach(),
        expected_fidelity_term=expected_fidelity_term.detach(),
        expected_kl_term=expected_kl_term.detach(),
        mean_weight=(torch.where(mask, weights, torch.zeros_like(weights)).sum() / num_tokens).detach(),
        expected_acceptance=(acceptance.sum() / num_tokens).detach(),
        expected_kl=expected_kl,
        advantages=advantages.detach(),
    )


def check_kl_options(expected_kl_coef: float, closed_form: str) -> None:
    """ValueError unless the expected-divergence coefficient is >= 0 and, when on, goes with the linear closed form."""
    if expected_kl_coef < 0:
        raise ValueError(f"expected_kl_coef must be >= 0, got {expected_kl_coef}")
    if expected_kl_coef > 0 and closed_form != "linear":
        raise ValueError("expected_kl_coef > 0 needs closed_form='linear': the logistic surrogate replaces linear "
                         "terms by their per-token minimiser, and the KL term is convex, not linear")


def _logistic_surrogate(weights, total_variation, fidelity_gap, mask, acceptance_coef: float,
                        expected_fidelity_coef: float) -> torch.Tensor:
    """(1/N) sum |c_t| BCE(w_t, 1[c_t < 0]) with c_t = lambda TV_t + mu G_t (see the module docstring)."""
    slope = acceptance_coef * total_variation.to(weights.dtype)
    if expected_fidelity_coef > 0:
        slope = slope + expected_fidelity_coef * fidelity_gap.to(weights.dtype)
    keep_target = (slope < 0).to(weights.dtype)
    clamped = weights.clamp(WEIGHT_CLAMP, 1.0 - WEIGHT_CLAMP)
    cross_entropy = -(keep_target * clamped.log() + (1.0 - keep_target) * torch.log1p(-clamped))
    per_token = torch.where(mask, slope.abs() * cross_entropy, torch.zeros_like(weights))
    return per_token.sum() / weights.shape[0]
