"""Medusa's typical acceptance, a verifier a user has for free: a drafted token x is accepted when the target finds it
typical enough,

    p(x) > min(eps, delta * exp(-H(p)))        (H(p) the target's entropy at that position)

with no random test; the first drafted token that fails ends the round, and the token emitted there is sampled from
the target p (the verifier's final sample from the target row at that position). Medusa's published settings are
eps = ``posterior_threshold`` = 0.09 and delta = ``posterior_alpha`` = 0.3 (its ``medusa_generate`` defaults, delta
"recommended to be sqrt(eps)"); its entropy is ``-sum p log(p + 1e-5)``, kept here so the rule is Medusa's to the
letter. Lossy: at a position the emitted token's law is q on the typical set A plus (1 - q(A)) p
(:mod:`diversed_ext.research.divergence`), not the target.

The loop runs it through the ordinary verify call: the accepted prefix verifies with w = 0 (nu = q, accepted with
certainty) and the row's draft count is cut to that prefix, so the final sample comes from the target row at the
first failing position (or the bonus row when every draft passed). The round's drafted count stays the full draft,
so acceptance rates are accepted over drafted, as for every other rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MEDUSA_EPS = 0.09  # Medusa's posterior_threshold
MEDUSA_DELTA = 0.3  # Medusa's posterior_alpha
ENTROPY_EPS = 1e-5  # Medusa's entropy: -sum p log(p + 1e-5)


@dataclass(frozen=True)
class Typical:
    """Typical acceptance's settings: the hard threshold ``eps`` and the entropy-scaled one ``delta`` (a draft passes
    when p(x) > min(eps, delta exp(-H(p))))."""

    eps: float = MEDUSA_EPS
    delta: float = MEDUSA_DELTA

    def __post_init__(self):
        for name in ("eps", "delta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"Typical {name} must be a finite number >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))

    @property
    def label(self) -> str:
        return f"eps={self.eps:g} delta={self.delta:g}"


def typical_threshold(target_probs: torch.Tensor, typical: Typical) -> torch.Tensor:
    """min(eps, delta exp(-H)) per row of target probabilities [..., V] (Medusa's entropy): [...]."""
    probs = target_probs.float()
    entropy = -(probs * torch.log(probs + ENTROPY_EPS)).sum(-1)
    return torch.minimum(torch.full_like(entropy, typical.eps), torch.exp(-entropy) * typical.delta)


def typical_passes(target_probs: torch.Tensor, tokens: torch.Tensor, typical: Typical) -> torch.Tensor:
    """bool [...]: whether each drafted token of ``tokens`` [...] passes typical acceptance under the target
    probabilities ``target_probs`` [..., V] of its position."""
    picked = target_probs.float().gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked > typical_threshold(target_probs, typical)


def typical_verify_arguments(typical: Typical, draft_tokens: torch.Tensor, num_draft: torch.Tensor,
                             target_logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_draft, weight) for the verify call that applies typical acceptance: each row's draft count cut to its
    passing prefix (capped at its own drafts), and w = 0 everywhere, so that prefix is accepted with certainty when
    the verifier sees the drafted tokens alone (q one-hot: nu = q) and the emitted token is sampled from the target
    row that follows it. ``draft_tokens`` [B, K], ``num_draft`` int64 [B], ``target_logits`` [B, K + 1, V] at
    ``temperature`` > 0."""
    width = draft_tokens.shape[1]
    probs = torch.softmax(target_logits[:, :width].float() / temperature, dim=-1)
    passes = typical_passes(probs, draft_tokens, typical).long().cumprod(1).sum(1)
    return torch.minimum(passes, num_draft), torch.zeros(draft_tokens.shape, dtype=torch.float32,
                                                         device=draft_tokens.device)


def check_typical(typical, method: str, temperature: float, fly, gate) -> "Typical | None":
    """The decoder's typical acceptance: a :class:`Typical` or None, for ``sd`` only (the rule replaces the exact
    test, so a weight has nothing to act on), sampled (temperature > 0), and alone (not with FLy or the gate, which
    modify the exact test it replaces)."""
    if typical is None:
        return None
    if not isinstance(typical, Typical):
        raise TypeError(f"typical must be a diversed_ext.decoding.Typical or None, got {type(typical).__name__}")
    if method != "sd":
        raise ValueError(f"typical applies to method 'sd' (it replaces the exact test), not to {method!r}")
    if temperature <= 0:
        raise ValueError("typical needs temperature > 0: it reads the target's probabilities at that temperature")
    if fly is not None or gate is not None:
        raise ValueError("typical replaces the exact test: it does not combine with fly or gate")
    return typical
