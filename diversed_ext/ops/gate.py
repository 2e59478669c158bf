"""The log-probability gate's test: which drafted tokens it keeps outright (the rule and why:
:mod:`diversed_ext.decoding.gate`), here beside the ops so that servers apply it to their own rows without loading the
decoding loop.

For a drafted token x of target p and draft q (one-hot at x when the verifier sees the drafted tokens alone), the test
compares two numbers: log p(x), and E_r[log p], the log-probability a rejection's token has in expectation, r =
norm((p - q)+) the residual it is drawn from (+inf where the residual has no mass: p = q rejects nothing). x is kept
when log p(x) >= E_r[log p] - margin and the target allows x (:func:`target_forbids`).

:func:`gate_statistics` computes both numbers in one native call from logits (csrc/common/gate_math.h: one exp per
element on the CPU, rows read where they lie, no [B, T, V] temporary), and :func:`gate_keeps_logits` applies the test
to them; :func:`gate_keeps` is the same test in plain PyTorch from probabilities and log-probabilities already at hand,
and :func:`gate_statistics_reference` the native call's oracle.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

import torch

from .. import rules
from ._inputs import normalize_tokens
from ._pair_inputs import prepare_features
from ._rows import gather_rows
from ._temperature import distribution_temperature
from .reference import target_forbids

_GATE_STATISTICS = torch.ops.diversed.gate_statistics.default


class GateStatistics(NamedTuple):
    """What the gate compares at each drafted position, float32 [B, T] each.

    Attributes:
        drafted_logprob: log p(x) of the drafted token x; -inf for an id outside [0, V), which is never kept.
        rejected_logprob: E_r[log p] over the residual r = norm((p - q)+); +inf where the residual has no mass.
    """

    drafted_logprob: torch.Tensor
    rejected_logprob: torch.Tensor


def keeps(margin: Union[float, torch.Tensor], statistics: GateStatistics) -> torch.Tensor:
    """bool, like the statistics: the gate's test. ``margin`` a float or a tensor broadcast against them (NaN: no gate
    there). A token the target forbids (a bad word, a token outside a request's allowed set) is never kept, whatever
    the margin: the verify ops would reject it anyway, and a weight zeroed for it would be counted."""
    drafted, rejected = statistics
    margin = _margin(margin)
    # +inf - margin stays +inf (nothing to keep without a residual); NaN compares false.
    return (drafted >= rejected - margin) & ~target_forbids(drafted.exp())


def _margin(margin: Union[float, torch.Tensor]) -> Union[float, torch.Tensor]:
    """The margin by the gate's rule (rules.gate_margin: finite nats), NaN allowed (no gate); a tensor's dtype only
    (its values are not read: no host sync)."""
    if isinstance(margin, torch.Tensor):
        if not margin.dtype.is_floating_point:
            raise TypeError(f"margin must be a float or a floating-point tensor (NaN: no gate), got {margin.dtype}")
        return margin
    if isinstance(margin, float) and math.isnan(margin):
        return margin
    return rules.gate_margin(margin)


def gate_statistics(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                    draft_logits: Optional[torch.Tensor] = None, *, draft_probs: Optional[torch.Tensor] = None,
                    temperature=1.0, target_temperature=None, target_rows=None, draft_rows=None,
                    check_inputs: bool = True) -> GateStatistics:
    """log p(x) and E_r[log p] at every drafted position, from logits, in one fused native call.

    Args:
        draft_tokens: int32/int64 [B, T], the drafted ids x (an id outside [0, V) gets log p(x) = -inf).
        target_logits: [B, T, V] target logits ([R, V] with ``target_rows``), float32, bfloat16 or float16.
        draft_logits: [B, T, V] draft logits ([Rd, V] with ``draft_rows``), of any of those dtypes, or None: the
            drafts are tokens only, q one-hot at x.
        draft_probs: the draft's probabilities in place of ``draft_logits`` (laid out alike), read as they lie (a
            server that holds the draft's distributions, as vLLM's draft_probs); ``temperature`` then divides only
            the target.
        temperature, target_temperature, target_rows, draft_rows, check_inputs: as for
            :func:`diversed_ext.distribution_features` (the draft at ``temperature``, the target at
            ``target_temperature`` when given; rows read in place; 0 counts as 1).
    Returns :class:`GateStatistics`.
    """
    draft, args, tokens = _prepare(draft_tokens, target_logits, draft_logits, draft_probs, temperature,
                                   target_temperature, target_rows, draft_rows, check_inputs)
    return GateStatistics(*_GATE_STATISTICS(tokens, None if draft is None else draft.contiguous(),
                                            target_logits.contiguous(), args.temperature, args.target_rows,
                                            args.draft_rows, args.target_temperature, draft_probs is not None))


def gate_keeps_logits(margin: Union[float, torch.Tensor], draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                      draft_logits: Optional[torch.Tensor] = None, **options) -> torch.Tensor:
    """[B, T] bool: whether the gate keeps each drafted token outright, from logits (:func:`gate_statistics`, whose
    keyword ``options`` it takes). ``margin`` a float or [B, T] (NaN: no gate at that position)."""
    return keeps(margin, gate_statistics(draft_tokens, target_logits, draft_logits, **options))


def gate_keeps(margin: Union[float, torch.Tensor], draft_tokens: torch.Tensor, draft_probs: Optional[torch.Tensor],
               target_log_probs: torch.Tensor) -> torch.Tensor:
    """[M] bool: the gate's test row by row in plain PyTorch, for M drafted tokens ``draft_tokens`` [M] whose
    distributions are at hand: ``draft_probs`` [M, V] (None: q one-hot at the drafts) and ``target_log_probs`` [M, V],
    both at the temperature the verifier samples at. ``margin`` a float or [M] (NaN: no gate on that row)."""
    return keeps(margin, residual_statistics(draft_tokens, draft_probs, target_log_probs))


def residual_statistics(draft_tokens: torch.Tensor, draft_probs: Optional[torch.Tensor],
                        target_log_probs: torch.Tensor) -> GateStatistics:
    """:class:`GateStatistics` [M] of M rows in plain PyTorch (the residual's sums in float64; float64 rows are read
    as they are)."""
    log_p = target_log_probs.to(torch.promote_types(target_log_probs.dtype, torch.float32))
    vocab = log_p.shape[-1]
    tokens = draft_tokens.to(torch.int64)
    valid = (tokens >= 0) & (tokens < vocab)
    at_token = tokens.clamp(0, max(vocab - 1, 0)).unsqueeze(-1)
    drafted = torch.where(valid, log_p.gather(-1, at_token).squeeze(-1), -torch.inf)
    p = log_p.exp()
    if draft_probs is None:  # (p - q)+ is p off x; an id outside the vocabulary has q = 0 on it
        residual = torch.where(valid.unsqueeze(-1), p.scatter(-1, at_token, 0.0), p)
    else:
        residual = (p - draft_probs.to(log_p.dtype)).clamp_min(0.0)
    mass = residual.sum(-1, dtype=torch.float64)
    # Ids the target rules out (log p = -inf) carry no residual; 0 x -inf must not turn the sum into NaN.
    weighted = torch.where(residual > 0, residual * log_p, torch.zeros_like(residual)).sum(-1, dtype=torch.float64)
    rejected = torch.where(mass > 0, weighted / mass.clamp_min(torch.finfo(torch.float64).tiny), torch.inf)
    return GateStatistics(drafted.float(), rejected.float())


def gate_statistics_reference(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                              draft_logits: Optional[torch.Tensor] = None, *, draft_probs: Optional[torch.Tensor] = None,
                              temperature=1.0, target_temperature=None, target_rows=None, draft_rows=None,
                              check_inputs: bool = True) -> GateStatistics:
    """Reference of :func:`gate_statistics`: gathers the rows, materialises both distributions in float64."""
    draft, args, tokens = _prepare(draft_tokens, target_logits, draft_logits, draft_probs, temperature,
                                   target_temperature, target_rows, draft_rows, check_inputs)
    draft_scale = distribution_temperature(args.temperature).view(-1, 1, 1).double()
    target_scale = (draft_scale if args.target_temperature is None
                    else distribution_temperature(args.target_temperature).view(-1, 1, 1).double())
    log_p = (gather_rows(target_logits, args.target_rows).double() / target_scale).log_softmax(-1)
    log_p = log_p.nan_to_num(nan=-torch.inf)  # a row without a finite logit has no mass
    q = None if draft is None else gather_rows(draft, args.draft_rows).double()
    if draft_logits is not None:
        q = (q / draft_scale).softmax(-1).nan_to_num(nan=0.0)
    elif q is not None:  # probabilities count as the kernels read them: NaN, negative or infinite mass is none
        q = torch.where((q >= 0) & (q < torch.inf), q, torch.zeros_like(q))
    drafted, rejected = residual_statistics(tokens.flatten(), None if q is None else q.flatten(0, 1),
                                            log_p.flatten(0, 1))
    shape = tokens.shape
    return GateStatistics(drafted.view(shape), rejected.view(shape))


def _prepare(draft_tokens, target_logits, draft_logits, draft_probs, temperature, target_temperature, target_rows,
             draft_rows, check_inputs: bool) -> tuple:
    """(the draft tensor or None, prepare_features' FeaturesArgs, the drafted ids int64 [B, T]) of a gate_statistics
    call: the draft's logits, its probabilities or neither (tokens only), never both; B and T from the logits."""
    if draft_logits is not None and draft_probs is not None:
        raise ValueError("give draft_logits or draft_probs, not both")
    draft = draft_probs if draft_logits is None else draft_logits
    args = prepare_features(draft, target_logits, temperature=temperature, target_temperature=target_temperature,
                            target_rows=target_rows, draft_rows=draft_rows, check_inputs=check_inputs,
                            draft_from_logits=draft_probs is None)
    tokens = normalize_tokens(draft_tokens, args.batch, args.positions, target_logits.device,
                              "target_logits" if draft is None else "the draft", "target_logits")
    return draft, args, tokens
