"""Logits path, per-token statistics and the materialised mixture, as fused native ops.

Servers hold logits, not probabilities; the trainer needs p(y), q(y) and TV(p, q) over whole sequences. These ops
never materialise [B, K, V] probabilities: each needed row gets its softmax normaliser (max, sum of exp) in one pass,
and later passes recompute softmax on the fly. Temperature divides the logits before the softmax; temperature 0 marks
a greedy row, decided on the untempered (T = 1) distributions.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _ops  # noqa: F401  (registers the native ops and their fake kernels)
from ._inputs import (check_distributions, check_values, normalize_stat_tokens, normalize_temperature,
                      normalize_weight, prepare_verify)
from .types import VerifyResult


class TokenStats(NamedTuple):
    """Per-position statistics of a draft/target pair at given tokens y, each float32 [B, T].

    Attributes:
        target_prob: p(y).
        draft_prob: q(y).
        total_variation: TV(p, q) = 0.5 * sum_v |p(v) - q(v)|; the acceptance rate at weight w is 1 - w * TV.
        target_logprob: log p(y), exact even where p(y) underflows (from logits).
        draft_logprob: log q(y).
    Not differentiable: the trainer's gradient flows through w in log(w p(y) + (1 - w) q(y)).
    """

    target_prob: torch.Tensor
    draft_prob: torch.Tensor
    total_variation: torch.Tensor
    target_logprob: torch.Tensor
    draft_logprob: torch.Tensor


def verify_logits(draft_tokens, draft_logits, target_logits, weight, *, temperature=1.0, num_draft=None,
                  uniforms=None, seed=None, offset=0, check_inputs=True) -> VerifyResult:
    """:func:`diversed_ext.verify` straight from logits, with a fused online softmax.

    Args:
        draft_logits: [B, K, V] draft logits (float32, bfloat16 or float16); -inf entries mask tokens out.
        target_logits: [B, K+1, V] target logits, same dtype and device.
        temperature: float or [B] tensor, >= 0. Probabilities are softmax(logits / temperature); 0 makes the row
            greedy (accept while x_i = argmax nu_i, with nu formed from the temperature-1 softmax).
        Everything else as :func:`diversed_ext.verify` (weights, ragged rows, uniforms, seeds, offset, check_inputs).
    """
    args = prepare_verify(draft_tokens, draft_logits, target_logits, weight, num_draft=num_draft, greedy=None,
                          uniforms=uniforms, seed=seed, offset=offset, check_inputs=check_inputs,
                          draft_name="draft_logits", target_name="target_logits", kind="logits")
    temperature_t = normalize_temperature(temperature, args.draft.shape[0], args.draft.device, check_inputs)
    tokens, num_accepted, accept_prob = torch.ops.diversed.verify_logits(
        args.draft_tokens, args.draft, args.target, args.weight, args.num_draft, temperature_t, args.uniforms,
        args.seeds, args.offset, args.per_row_seed)
    return VerifyResult(tokens, num_accepted, accept_prob)


def _prepare_pair(draft, target, *, from_logits, temperature, check_inputs, same_positions):
    kind = "logits" if from_logits else "probabilities"
    batch, draft_positions, vocab = check_distributions_any(draft, target, kind, same_positions)
    temperature_t = normalize_temperature(temperature, batch, draft.device, check_inputs)
    if check_inputs:
        check_values(draft, "draft", from_logits)
        check_values(target, "target", from_logits)
    return batch, draft_positions, vocab, temperature_t


def check_distributions_any(draft, target, kind, same_positions):
    """Like check_distributions, but target may have K (same_positions) or K and more positions."""
    if isinstance(target, torch.Tensor) and isinstance(draft, torch.Tensor) and target.dim() == 3 and draft.dim() == 3:
        if same_positions and target.shape[1] != draft.shape[1]:
            raise ValueError(f"target must have the same number of positions as draft ({draft.shape[1]}), "
                             f"got {target.shape[1]}")
        if not same_positions and target.shape[1] < draft.shape[1]:
            raise ValueError(f"target must have at least as many positions as draft ({draft.shape[1]}), "
                             f"got {target.shape[1]}")
        padded = target[:, :1].expand(target.shape[0], draft.shape[1] + 1, target.shape[2])
        check_distributions(draft, padded, "draft", "target", kind)
    else:
        check_distributions(draft, target, "draft", "target", kind)
    return tuple(draft.shape)


def token_stats(draft, target, tokens, *, from_logits=False, temperature=1.0, check_inputs=True) -> TokenStats:
    """p(y), q(y), TV(p, q) and log-probabilities per position, in one or two passes over V.

    Args:
        draft: [B, T, V] draft probabilities or logits.
        target: [B, T, V] target probabilities or logits (same dtype and device).
        tokens: int32/int64 [B, T], the tokens y (for example a generated sequence, teacher-forced).
        from_logits: treat draft and target as logits (softmax(x / temperature) per row).
        temperature: float or [B]; only used with logits (0 counts as 1).
    Returns :class:`TokenStats` with float32 [B, T] fields. No [B, T, V] temporary is created.
    """
    batch, length, vocab, temperature_t = _prepare_pair(draft, target, from_logits=from_logits,
                                                        temperature=temperature, check_inputs=check_inputs,
                                                        same_positions=True)
    tokens_t = normalize_stat_tokens(tokens, batch, length, vocab, draft.device, check_inputs)
    fields = torch.ops.diversed.token_stats(draft.contiguous(), target.contiguous(), tokens_t, temperature_t,
                                            bool(from_logits))
    return TokenStats(*fields)


def mix(draft, target, weight, *, from_logits=False, temperature=1.0, check_inputs=True) -> torch.Tensor:
    """nu = w * p + (1 - w) * q materialised as float32 [B, K, V], for callers who need the whole distribution.

    Args:
        draft: [B, K, V] draft probabilities or logits.
        target: [B, K, V] or [B, K+1, V] target probabilities or logits (positions past K are ignored).
        weight: float, [B] or [B, K] weight on the target, in [0, 1].
        from_logits: treat draft and target as logits, softmax(x / temperature) per row.
        temperature: float or [B]; only used with logits (0 counts as 1).
    """
    batch, positions, _, temperature_t = _prepare_pair(draft, target, from_logits=from_logits,
                                                       temperature=temperature, check_inputs=check_inputs,
                                                       same_positions=False)
    weight_t = normalize_weight(weight, batch, positions, draft.device, check_inputs)
    return torch.ops.diversed.mix(draft.contiguous(), target.contiguous(), weight_t, temperature_t, bool(from_logits))
