"""A divergence to the target that a sharper sampler cannot fake: what each rule does to one position, in closed form.

The per-position law of a rule at a position with target p and draft q (both at the user's temperature) is the law
of the FIRST token the rule emits at that position when a draft x ~ q is made there and verified: x itself when the
verifier keeps it, else the token the verifier samples in its place. It is what the rule does to one position,
whatever the round around it (a bonus position, which no draft reaches, emits from p). Writing a(x) for the
probability that the draft x is kept and r_x for the law of the replacement,

    out(y) = sum_x q(x) [a(x) 1{y = x} + (1 - a(x)) r_x(y)]

which each rule gives in closed form (:func:`position_law`), the verifier's support rule of
:mod:`diversed_ext.ops.reference` included (a target probability below MIN_TARGET_MASS counts as zero, and a draft
the target forbids verifies with w = 1):

    exact sd        out = p
    static w, head  out = nu = w p + (1 - w) q  (a head's w at each position; with the forbidden rule, the mass of
                    forbidden drafts goes to the residual r = norm((p - q)+))
    gate            a(x) = 1 where the gate keeps x outright (:func:`diversed_ext.ops.gate_keeps`), else the exact
                    test with the method's weight, min(1, nu(x) / q(x)); r_x = r
    typical         a(x) = 1{p(x) > min(eps, delta exp(-H(p)))} (:mod:`diversed_ext.decoding.typical`); r_x = p

When the verifier sees the drafted tokens alone (``draft_mode`` "tokens"), q is one-hot at x for the verifier: the
test is a(x) = w p(x) + 1 - w and r_x = norm(p off x); the law still averages over x ~ q, the draft's sampler.

At every position the output visited (teacher forcing of both models over the generated text,
:func:`position_divergences`) this gives KL(out || p) and TV(out, p); a prompt's figure is the mean over its tokens,
and reports pair them over prompts with standard errors. Exact sampling has both 0; a colder sampler shows up here
(where it does not in fidelity). FLy, whose keep decision reads the drafts that follow, has no closed form: see
:mod:`.fly_divergence`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..decoding.typical import Typical, typical_threshold
from ..head import distribution_features, wants_distributions
from ..ops import MIN_TARGET_MASS, distribution_temperature

KINDS = ("exact", "static", "gate", "typical")


@dataclass(frozen=True)
class RuleLaw:
    """A rule's per-position law, as :func:`position_law` takes it: ``kind`` one of :data:`KINDS`; ``weight`` the
    weight on the target (static; the gate's weight for drafts it does not keep; None with ``head``); ``head`` a
    head giving w at each position; ``margin`` the gate's; ``typical`` typical acceptance's settings; ``tokens_only``
    whether the verifier sees the drafted tokens alone (q one-hot for the test)."""

    kind: str
    weight: Optional[float] = 1.0
    head: object = None
    margin: Optional[float] = None
    typical: Optional[Typical] = None
    tokens_only: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "gate" and self.margin is None:
            raise ValueError("a gate's law needs its margin")
        if self.kind == "typical" and self.typical is None:
            raise ValueError("typical acceptance's law needs its settings (typical=Typical(...))")


def rule_law(decoder) -> Optional[RuleLaw]:
    """The per-position law of a :class:`~diversed_ext.decoding.SpeculativeDecoder` (read from its method, weight,
    head, gate, typical acceptance and draft mode), or None where it has no closed form here: ``ar`` (it drafts
    nothing), FLy (:mod:`.fly_divergence`), and a callable drafter (its q is not a model's)."""
    method = decoder.method
    if method == "ar" or decoder.fly is not None or decoder.drafter is not None:
        return None
    tokens_only = decoder.draft_mode != "distributions"
    head = decoder.head if method == "diversed" else None
    weight = None if head is not None else float(decoder.weight)
    if getattr(decoder, "typical", None) is not None:
        return RuleLaw("typical", typical=decoder.typical)
    if decoder.gate is not None:
        return RuleLaw("gate", weight, head, margin=decoder.gate.margin, tokens_only=tokens_only)
    if head is None and weight == 1.0:
        return RuleLaw("exact")
    return RuleLaw("static", weight, head, tokens_only=tokens_only)


def _verifier_mass(p: torch.Tensor) -> torch.Tensor:
    """The target as the verify ops read it: zero below MIN_TARGET_MASS (their support rule)."""
    return torch.where(p >= MIN_TARGET_MASS, p, torch.zeros_like(p))


def _normalized(mass: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """``mass`` normalised row by row; ``fallback`` (normalised) on rows without mass, as the verifier samples p
    there."""
    total = mass.sum(-1, keepdim=True)
    fallback = fallback / fallback.sum(-1, keepdim=True).clamp_min(1e-300)
    return torch.where(total > 0, mass / total.clamp_min(1e-300), fallback)


def _mixed_law(q: torch.Tensor, keep: torch.Tensor, replacement: torch.Tensor) -> torch.Tensor:
    """sum_x q(x) [a(x) delta_x + (1 - a(x)) r] with one replacement law r for every x."""
    kept = q * keep
    return kept + (1 - kept.sum(-1, keepdim=True)).clamp_min(0) * replacement


def _one_hot_law(q: torch.Tensor, keep: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """sum_x q(x) [a(x) delta_x + (1 - a(x)) norm(p off x)]: out(y) = q(y) a(y) + p(y) (S - q(y)(1 - a(y)) /
    (1 - p(y))), S = sum_x q(x) (1 - a(x)) / (1 - p(x)). A draft with p(x) = 1 is always kept (a = 1): no term."""
    spare = 1 - p
    share = torch.where(spare > 0, q * (1 - keep) / spare.clamp_min(1e-300), torch.zeros_like(q))
    return q * keep + p * (share.sum(-1, keepdim=True) - share)


def _exact_keep(p: torch.Tensor, q: torch.Tensor, weight: torch.Tensor, tokens_only: bool) -> torch.Tensor:
    """The exact test's a(x) = min(1, nu(x) / q(x)) for every x ([N, V]), ``weight`` [N, 1], forbidden drafts with
    w = 1 (so never kept); q one-hot at x when ``tokens_only``: a(x) = w p(x) + 1 - w."""
    allowed = p > 0
    w = torch.where(allowed, weight, torch.ones_like(p))
    if tokens_only:
        return w * p + 1 - w
    nu = w * p + (1 - w) * q
    return torch.where(q > 0, (nu / q.clamp_min(1e-300)).clamp(max=1.0), torch.ones_like(q))


def _gate_keeps_all(margin: float, p: torch.Tensor, q: torch.Tensor, log_p: torch.Tensor,
                    tokens_only: bool) -> torch.Tensor:
    """:func:`diversed_ext.ops.gate_keeps` for every candidate x at once ([N, V] bool): the same test, with E_r[log p]
    in closed form (shared r = norm((p - q)+), or norm(p off x) for one-hot q)."""
    safe_log_p = torch.where(p > 0, log_p, torch.zeros_like(log_p))
    if tokens_only:
        p_log_p = (p * safe_log_p).sum(-1, keepdim=True)
        mass = 1 - p
        rejected_log_p = (p_log_p - p * safe_log_p) / mass.clamp_min(torch.finfo(p.dtype).tiny)
    else:
        residual = (p - q).clamp_min(0)
        mass = residual.sum(-1, keepdim=True)
        rejected_log_p = (residual * safe_log_p).sum(-1, keepdim=True) / mass.clamp_min(torch.finfo(p.dtype).tiny)
    allowed = p >= MIN_TARGET_MASS
    return (mass > 0) & (log_p >= rejected_log_p - margin) & allowed


def position_law(law: RuleLaw, target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float = 1.0,
                 weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rule's per-position output law (see the module) at N positions: float64 [N, V] from the target's and the
    draft's logits [N, V] at ``temperature`` (0 counts as 1). ``weight`` [N]: the head's w at each position (needed
    when ``law.head`` is set; else ``law.weight`` everywhere)."""
    scale = distribution_temperature(temperature)
    log_p = (target_logits.double() / scale).log_softmax(-1)
    p_full = log_p.exp()
    q = (draft_logits.double() / scale).softmax(-1)
    if law.kind == "exact":
        return p_full
    p = _verifier_mass(p_full)
    if law.kind == "typical":
        # typical_passes for every candidate x at once; a draft the target forbids verifies with w = 1 and is
        # rejected, whatever its typicality.
        passes = p_full.float() > typical_threshold(p_full, law.typical).unsqueeze(-1)
        keep = (passes & (p > 0)).double()
        return _mixed_law(q, keep, _normalized(p, p_full))
    if weight is None:
        if law.weight is None:
            raise ValueError("a head's law needs its weight at each position (weight=[N])")
        weight = torch.full((p.shape[0],), float(law.weight), dtype=torch.float64)
    w = weight.double().clamp(0, 1).reshape(-1, 1)
    keep = _exact_keep(p, q, w, law.tokens_only)
    if law.kind == "gate":
        keep = torch.where(_gate_keeps_all(law.margin, p_full, q, log_p, law.tokens_only), torch.ones_like(keep), keep)
    if law.tokens_only:
        return _one_hot_law(q, keep, p)
    return _mixed_law(q, keep, _normalized((p - q).clamp_min(0), p))


def divergences(out: torch.Tensor, target_logits: torch.Tensor, temperature: float = 1.0) -> tuple:
    """(KL(out || p), TV(out, p)) per position, float64 [N] each, p = softmax(target_logits / T)."""
    log_p = (target_logits.double() / distribution_temperature(temperature)).log_softmax(-1)
    positive = out > 0
    kl = torch.where(positive, out * (out.clamp_min(1e-300).log() - log_p), torch.zeros_like(out)).sum(-1)
    tv = 0.5 * (out - log_p.exp()).abs().sum(-1)
    return kl.clamp_min(0), tv


def head_position_weights(head, draft_hidden: torch.Tensor, target_hidden: torch.Tensor, draft_logits: torch.Tensor,
                          target_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The head's w at N teacher-forced positions ([N]), from what it reads while decoding: both hidden states, and
    the distribution features where it takes them."""
    extra = ((distribution_features(draft_logits.float(), target_logits.float(), temperature).unsqueeze(0),)
             if wants_distributions(head) else ())
    device = next(head.parameters()).device if isinstance(head, torch.nn.Module) and any(
        True for _ in head.parameters()) else draft_hidden.device
    weight = head(draft_hidden.float().unsqueeze(0).to(device), target_hidden.float().unsqueeze(0).to(device),
                  *(tensor.to(device) for tensor in extra))
    return torch.as_tensor(weight).detach().reshape(-1).double().cpu()


@torch.no_grad()
def position_divergences(target, draft, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                         law: RuleLaw, temperature: float = 1.0, score_temperature: Optional[float] = None,
                         draft_steps: Optional[Sequence[Optional[Sequence[int]]]] = None) -> list[tuple[float, float]]:
    """(mean KL(out || p), mean TV(out, p)) over each completion's positions, the rule's per-position law taken at the
    contexts the completion visited (one teacher-forced pass of each model, through the runners the loop uses);
    (NaN, NaN) for an empty completion. The law is the rule's at its decoding ``temperature``, p the target's at
    ``score_temperature`` (default: the same), so sd run colder (the temperature family) has KL(p_T' || p_T). With an
    EAGLE-3 head for the draft, q at each token is the head's at the draft step the loop drafted it at
    (``draft_steps``, from :func:`.rollouts.draft_steps`; None: step 0 everywhere)."""
    from .teacher_forcing import pair_outputs

    results = [(float("nan"), float("nan"))] * len(completions)
    if not any(completions):
        return results
    filled, target_outputs, draft_outputs = pair_outputs(target, draft, prompts, completions, draft_steps)
    # exact sampling's law is p itself: no draft needed (ar, or sd run at another temperature)
    draft_outputs = target_outputs if draft_outputs is None else draft_outputs
    for index, (target_hidden, target_logits), (draft_hidden, draft_logits) in zip(filled, target_outputs,
                                                                                  draft_outputs):
        target_logits, draft_logits = target_logits.cpu(), draft_logits.cpu()
        weight = None
        if law.head is not None:
            weight = head_position_weights(law.head, draft_hidden, target_hidden.to(draft_hidden.device),
                                           draft_logits, target_logits, temperature)
        vocab = min(target_logits.shape[-1], draft_logits.shape[-1])  # the verifier's shared vocabulary
        out = position_law(law, target_logits[:, :vocab], draft_logits[:, :vocab], temperature, weight)
        scoring = temperature if score_temperature is None else score_temperature
        kl, tv = divergences(out, target_logits[:, :vocab], scoring)
        results[index] = (float(kl.mean()), float(tv.mean()))
    return results
