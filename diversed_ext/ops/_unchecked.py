"""The serving path of the verify ops: an unchecked call (``check_inputs=False``) whose arguments need no conversion
goes to the op as given; any other call goes through :func:`~diversed_ext.ops._prepare.prepare_verify`.

Whether the arguments need converting is decided up front, by tests of kind only: each tensor of the op's dtype and
contiguous, and of its rank where another rank is a form to convert (int32 ids, a [B] weight, a 0-d temperature or a
strided tensor need converting), each number through its own rule (rules.weight, rules.seed, normalize_offset,
rules.temperature: the same functions prepare_verify uses). Sizes and devices are not compared here (but for a seed
tensor's device: seeds elsewhere are moved), which would cost a microsecond of attribute reads on every call: the op
compares them itself (csrc/common/op_checks.h). A tensor of the right kind and the wrong size is a mistake, not a
form to convert, so when the op refuses the arguments, the caller (ops/api.py) runs the argument rules, which raise
the error naming the argument at fault; the op is never called a second time, and an error the rules do not explain
is raised as the op raised it.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import rules
from ._inputs import PROB_DTYPES, normalize_offset


_Tensor, _BOOL, _INT64, _FLOAT32, _FLOAT64 = torch.Tensor, torch.bool, torch.int64, torch.float32, torch.float64


def tensor_as_given(value, dtype: torch.dtype, rank: Optional[int] = None) -> bool:
    """Whether ``value`` is a tensor the op takes as it is: of ``dtype`` (and ``rank``, where another rank is a form
    the rule converts, as a [B] weight), contiguous."""
    return (isinstance(value, _Tensor) and value.dtype == dtype and (rank is None or value.dim() == rank)
            and value.is_contiguous())


def greedy_as_given(greedy) -> bool:
    """Whether verify's greedy goes to the op as given: absent, or a contiguous bool [B] tensor."""
    return greedy is None or tensor_as_given(greedy, _BOOL)


def temperature_as_given(temperature) -> Optional[tuple]:
    """verify_logits' (temperature, temperature_value) when the temperature goes to the op as given, else None."""
    if type(temperature) is float:
        return None, rules.temperature(temperature)
    if tensor_as_given(temperature, _FLOAT32, 1):
        return temperature, 1.0
    return None


def rows_as_given(target_rows, draft_rows) -> bool:
    """Whether the row indices go to the op as given: each absent or a contiguous int64 tensor (int32 is converted)."""
    return ((target_rows is None or tensor_as_given(target_rows, _INT64))
            and (draft_rows is None or tensor_as_given(draft_rows, _INT64)))


def target_temperature_as_given(target_temperature) -> Optional[tuple]:
    """verify_logits' (target_temperature, target_temperature_value) when it goes to the op as given (absent, a float
    or a contiguous float32 [B] tensor), else None."""
    if target_temperature is None:
        return None, None
    if type(target_temperature) is float:
        return None, rules.temperature(target_temperature, "target_temperature")
    if tensor_as_given(target_temperature, _FLOAT32, 1):
        return target_temperature, None
    return None


def unchecked_arguments(draft_tokens, draft, target, weight, num_draft, row_flags, uniforms, seed, offset,
                        *row_flag_value) -> Optional[tuple]:
    """The op's positional arguments when every argument goes to it as given, else None. ``row_flags``: greedy (bool
    [B]) or temperature (float32 [B]) or None, already judged by the caller; ``row_flag_value``: verify_logits'
    temperature_value, which goes before the seed. Written for speed: it runs on every serving call."""
    if not (isinstance(target, _Tensor) and target.dtype in PROB_DTYPES and target.is_contiguous()
            and (draft is None or (isinstance(draft, _Tensor) and draft.is_contiguous()))
            and isinstance(draft_tokens, _Tensor) and draft_tokens.dtype == _INT64 and draft_tokens.is_contiguous()):
        return None
    if type(weight) is float or not isinstance(weight, _Tensor):
        weight_t, weight_value = None, rules.weight(weight)
    elif tensor_as_given(weight, _FLOAT32, 2):
        weight_t, weight_value = weight, 1.0
    else:
        return None
    if num_draft is not None and not tensor_as_given(num_draft, _INT64):
        return None
    if uniforms is not None and (seed is not None or not tensor_as_given(uniforms, _FLOAT64)):
        return None  # both given: prepare_verify says which to drop
    if seed is None:
        seeds, seed_value, per_row_seed = None, None, False
    elif not isinstance(seed, _Tensor):
        seeds, seed_value, per_row_seed = None, rules.seed(seed), False
    elif tensor_as_given(seed, _INT64) and seed.device == target.device:  # seeds elsewhere are moved
        seeds, seed_value, per_row_seed = seed, None, True
    else:
        return None
    return (draft_tokens, draft, target, weight_t, num_draft, row_flags, uniforms, seeds, normalize_offset(offset),
            per_row_seed, weight_value, *row_flag_value, seed_value)
