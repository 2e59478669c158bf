"""What a sampler verified so far, kept on the device so that counting never waits for it."""

from __future__ import annotations

import torch

DRAFTED, ACCEPTED, WEIGHT_SUM, WITHOUT_HEAD = range(4)


class VerifyCounts:
    """Drafted and accepted tokens, the sum of the weights drafted tokens were verified with, and the drafted tokens
    of head requests verified at the static weight because their drafts' hidden states were not captured."""

    def __init__(self, device):
        self.totals = torch.zeros(4, dtype=torch.float64, device=device)

    def add(self, num_draft: torch.Tensor, num_accepted: torch.Tensor, weight: torch.Tensor) -> None:
        """One step: ``num_draft`` [R] drafted tokens per request, ``weight`` [R] or [R, K] what they were verified
        with (positions past a request's drafts are not counted)."""
        self.totals[DRAFTED] += num_draft.sum()
        self.totals[ACCEPTED] += num_accepted.sum()
        if weight.dim() == 1:
            self.totals[WEIGHT_SUM] += (weight.to(torch.float64) * num_draft).sum()
        else:
            positions = torch.arange(weight.shape[1], device=weight.device)
            drafted = positions[None, :] < num_draft[:, None]
            self.totals[WEIGHT_SUM] += (weight.to(torch.float64) * drafted).sum()

    def add_without_head(self, tokens: torch.Tensor) -> None:
        self.totals[WITHOUT_HEAD] += tokens.sum()

    def read(self) -> dict:
        drafted, accepted, weight_sum, without_head = self.totals.tolist()
        return {"drafted": int(drafted), "accepted": int(accepted), "weight_sum": weight_sum,
                "verified_without_head": int(without_head)}
