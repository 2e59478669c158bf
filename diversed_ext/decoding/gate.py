"""The log-probability gate: a lossy verification kind whose weight reads the drafted token.

DIVERSED's weight w is fixed before the draft is seen, so tokens follow nu = w p + (1 - w) q exactly. The gate gives
that up, as FLy does, and chooses w for each drafted token x from x itself:

    w(x) = 0                 if log p(x) >= E_r[log p] - margin      (x is kept: the test min(1, nu(x)/q(x)) = 1)
    w(x) = the usual weight  otherwise                               (the exact test with sd's, static or a head's w)

where r = norm((p - q)+) is the residual a rejection samples from (the same for every w > 0, since nu - q = w (p - q)).
This is the per-token maximiser of the objective the heads are trained on, fidelity + lambda x acceptance, once w may
read x: a rejection at x costs ``log p(x) - E_r[log p]`` nats of fidelity (the kept draft against the resampled
token) and buys nothing, a keep buys acceptance, so x is kept exactly when its log-probability is within
``margin`` = lambda / mu nats of what rejecting it would give. The margin is the only setting: margin -> -inf is the
plain exact test, margin -> +inf keeps every draft.

Lossy: tokens no longer follow nu (nor the target for ``sd``). The gate reads p and q at the decoding temperature, as
the verifier does; q is one-hot at x when the verifier sees the drafted tokens alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from .. import rules
from ..ops import gate_keeps_logits, is_greedy_temperature, position_rows


@dataclass(frozen=True)
class Gate:
    """The gate's margin in nats: a draft is kept when its target log-probability is at least that of a rejection's
    resampled token, in expectation, minus ``margin``."""

    margin: float = rules.GATE_DEFAULT_MARGIN

    def __post_init__(self):
        object.__setattr__(self, "margin", rules.gate_margin(self.margin, "Gate margin"))

    @property
    def label(self) -> str:
        return f"margin={self.margin:g}"


def require_sampling(temperature: float) -> None:
    """The gate compares log-probabilities, which greedy decoding (temperature 0) has not: ValueError there."""
    if is_greedy_temperature(temperature):
        raise ValueError("gate needs temperature > 0: it compares log-probabilities, which greedy decoding has not")


def gated_weights(gate: Gate, weight: Union[float, torch.Tensor], draft_tokens: torch.Tensor,
                  draft_logits: Optional[torch.Tensor], target_logits: torch.Tensor,
                  temperature: float) -> torch.Tensor:
    """The weights [B, K] the verifier gets: 0 where the gate keeps the drafted token, ``weight`` (a float or [B, K])
    elsewhere. ``draft_tokens`` [B, K]; ``draft_logits`` [B, K, V] or None (q one-hot at the drafts);
    ``target_logits`` [B, K + 1, V]; ``temperature`` > 0. The test is :func:`diversed_ext.ops.gate_keeps_logits`' (one
    fused call), which servers call on their own rows."""
    # The drafted positions' target rows, read in place in the [B (K + 1), V] view (no copy of the first K positions).
    target_rows, target_index = position_rows(target_logits, draft_tokens.shape[1])
    keep = gate_keeps_logits(gate.margin, draft_tokens, target_rows, draft_logits, temperature=temperature,
                             target_rows=target_index, check_inputs=False)
    if torch.is_tensor(weight):
        base = weight.to(device=draft_tokens.device, dtype=torch.float32).expand(draft_tokens.shape)
    else:  # filled on the device: a tensor made from a Python float would be a waiting host copy on CUDA
        base = torch.full(draft_tokens.shape, float(weight), dtype=torch.float32, device=draft_tokens.device)
    return torch.where(keep, torch.zeros_like(base), base)
