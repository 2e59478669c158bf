"""Result types of the public API."""

from __future__ import annotations

from typing import NamedTuple

import torch


class VerifyResult(NamedTuple):
    """What one verification call returns for a batch of B draft blocks of K tokens.

    Attributes:
        tokens: int64 [B, K+1]. Row b holds its ``num_accepted[b]`` accepted drafts, then the correction token (first
            rejection) or the bonus token (all accepted), then -1 padding.
        num_accepted: int32 [B]. Accepted drafts, the final token not counted: row b emits ``num_accepted[b] + 1`` tokens.
        accept_prob: float32 [B, K]. ``min(1, nu_i(x_i) / q_i(x_i))`` at every drafted position i < num_draft (for greedy
            rows 1 if x_i is the argmax of nu_i, else 0); 0 past num_draft and for out-of-range ids.
    """

    tokens: torch.Tensor
    num_accepted: torch.Tensor
    accept_prob: torch.Tensor
