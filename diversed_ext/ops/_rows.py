"""Rows read in place: the ``target_rows`` / ``draft_rows`` arguments of verify and verify_logits.

A server keeps its target rows flattened ([R, V]: each request's K+1 rows contiguous, the requests ragged) and its
draft rows by request slot ([slots * K, V]). An index per position lets the ops read the rows where they lie, with no
gather copy: position i of request b reads row ``target_rows[b, i]`` (``draft_rows[b, i]``). The positions a request
does not read (draft positions >= num_draft[b], target positions > num_draft[b]) may hold any index, padding included.

``check_inputs=True``: the indices at read positions must lie in [0, R) (ValueError naming the argument), and the
values of the rows read are checked (a row tensor's other rows are not: they may belong to no request of the call).
``check_inputs=False``: the kernels clamp an index into [0, R) (csrc/common/problems.h: indexed_row), so no read leaves
the tensor, and no host sync is added.

:func:`position_rows` builds such an index for positions laid out [S, P, V] (a loop's [B, K + 1, V] target logits, a
drafter's table of [slots, K, V] logits): the rows as [S P, V] and the indices of the first positions of some slots.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._inputs import (TOKEN_DTYPES, check_distributions, check_value_dtype, require_device, require_rank,
                      require_tensor)
from ._values import (FLAG_NAN, FLAG_NEGATIVE, FLAG_NO_MASS, FLAG_NO_TARGET_MASS, FLAG_POSITIVE_INFINITY, LOGIT_ERRORS,
                      NO_MASS, PROBABILITY_ERRORS, check_probability_positions, check_values, mass_flag,
                      read_positions, row_value_flags)

# The first flag of a row read through an index, worded; in the order the checks before a call raise them.
_PROBABILITY_MESSAGES = ((FLAG_NAN, "contains NaN"), (FLAG_NEGATIVE, "contains negative probabilities"),
                         (FLAG_POSITIVE_INFINITY, "contains infinite values"),
                         (FLAG_NO_MASS, f"has {NO_MASS[FLAG_NO_MASS]}"),
                         (FLAG_NO_TARGET_MASS, f"has {NO_MASS[FLAG_NO_TARGET_MASS]}"))
_LOGIT_MESSAGES = ((FLAG_NAN, "contains NaN"), (FLAG_POSITIVE_INFINITY, "contains +inf"),
                   (FLAG_NO_MASS, "has logits that are all -inf (no token is possible)"))


def check_verify_layout(draft_tokens, draft, target, target_rows, draft_rows, draft_name: str, target_name: str,
                        kind: str) -> tuple[int, int, int]:
    """(B, K, V) of verify's distribution tensors, either of which may be a row tensor [R, V] read through its index
    (then B and K come from draft_tokens, or from the other tensor). Without indices: check_distributions."""
    if target_rows is None and draft_rows is None:
        return check_distributions(draft, target, draft_name, target_name, kind)
    if draft is None and draft_rows is not None:
        raise ValueError(f"draft_rows indexes the rows of {draft_name}, which is None (the draft gave tokens only): "
                         f"pass draft_rows only with a draft tensor")
    require_tensor(target, target_name)
    check_value_dtype(target.dtype, target_name, kind)
    if target_rows is not None:
        require_rank(target, 2, target_name, "[R, V] (rows read through target_rows)")
        require_tensor(draft_tokens, "draft_tokens")
        require_rank(draft_tokens, 2, "draft_tokens", "[B, K]")
        batch, num_positions = draft_tokens.shape
    else:
        require_rank(target, 3, target_name, "[B, K+1, V]")
        if target.shape[1] == 0:
            raise ValueError(f"{target_name} must have K+1 >= 1 positions (the bonus row), got shape "
                             f"{tuple(target.shape)}")
        batch, num_positions = target.shape[0], target.shape[1] - 1
    vocab = target.shape[-1]
    if vocab == 0:
        raise ValueError(f"vocabulary size V must be positive, got {target_name} shape {tuple(target.shape)}")
    if draft is not None:
        _check_draft(draft, target, draft_rows is not None, batch, num_positions, draft_name, target_name, kind)
    return batch, num_positions, vocab


def _check_draft(draft, target: torch.Tensor, indexed: bool, batch: int, num_positions: int, draft_name: str,
                 target_name: str, kind: str) -> None:
    require_tensor(draft, draft_name)
    check_value_dtype(draft.dtype, draft_name, kind)  # its own dtype: the target's or another (each read as it lies)
    require_device(draft, target.device, draft_name, f"{target_name} is")
    if indexed:
        require_rank(draft, 2, draft_name, "[R, V] (rows read through draft_rows)")
    else:
        require_rank(draft, 3, draft_name, "[B, K, V]")
        if tuple(draft.shape[:2]) != (batch, num_positions):
            raise ValueError(f"{draft_name} must be [B, K, V] with B, K = {batch}, {num_positions}, got shape "
                             f"{tuple(draft.shape)}")
    if draft.shape[-1] != target.shape[-1]:
        raise ValueError(f"{draft_name} has vocabulary size {draft.shape[-1]} but {target_name} has "
                         f"{target.shape[-1]}")


def normalize_rows(rows, name: str, values: Optional[torch.Tensor], values_name: str, batch: int, width: int,
                   layout: str, device: torch.device) -> Optional[torch.Tensor]:
    """An index tensor (target_rows: ``layout`` "[B, K+1]", draft_rows: "[B, K]") as int64 [B, width], or None. Its
    values are read only by check_row_indices."""
    if rows is None:
        return None
    require_tensor(rows, name)
    if rows.dtype not in TOKEN_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {rows.dtype}")
    if tuple(rows.shape) != (batch, width):
        raise ValueError(f"{name} must have shape {layout} = [{batch}, {width}], got {tuple(rows.shape)}")
    require_device(rows, device, name)
    if batch * width > 0 and values.shape[0] == 0:
        raise ValueError(f"{values_name} has no rows for {name} to index")
    if rows.dtype != torch.int64:
        rows = rows.to(torch.int64)
    return rows.contiguous()


def check_row_indices(rows: Optional[torch.Tensor], name: str, row_count: int, values_name: str,
                      read: torch.Tensor) -> None:
    """Every index at a position the call reads (``read``, bool like ``rows``) must lie in [0, R)."""
    if rows is None or rows.numel() == 0:
        return
    outside = ((rows < 0) | (rows >= row_count)) & read
    if bool(outside.any()):
        request, position = (int(i) for i in outside.nonzero()[0])
        raise ValueError(f"{name}[{request}, {position}] = {int(rows[request, position])} is outside [0, R) with "
                         f"R = {row_count} rows of {values_name}")


def check_indexed_values(values: torch.Tensor, rows: torch.Tensor, read: torch.Tensor, name: str,
                         from_logits: bool, no_mass: int = FLAG_NO_MASS) -> None:
    """The value checks of the rows a call reads through an index (indices already in range): one pass over the row
    tensor, one host read when nothing is wrong. ``no_mass``: the flag of a probability row without the mass needed."""
    if rows.numel() == 0 or values.numel() == 0:
        return
    errors_mask = LOGIT_ERRORS if from_logits else PROBABILITY_ERRORS | no_mass
    flags = row_value_flags(values, from_logits)[rows.clamp(0, values.shape[0] - 1)]
    errors = torch.where(read, flags & errors_mask, 0)
    if not bool(errors.any()):
        return
    request, position = (int(i) for i in errors.nonzero()[0])
    bits = int(errors[request, position])
    for bit, message in _LOGIT_MESSAGES if from_logits else _PROBABILITY_MESSAGES:
        if bits & bit:
            raise ValueError(f"{name} row {int(rows[request, position])} (read at [{request}, {position}]) "
                             f"{message}")


def check_row_values(draft: Optional[torch.Tensor], target: torch.Tensor, draft_rows: Optional[torch.Tensor],
                     target_rows: Optional[torch.Tensor], num_draft: Optional[torch.Tensor], batch: int,
                     num_positions: int, draft_name: str, target_name: str, from_logits: bool) -> None:
    """The value checks of a call with an index: a row tensor's rows read, a [B, *, V] tensor's values by its own rule
    (check_values, check_probability_positions)."""
    for values, rows, name, last_offset in ((draft, draft_rows, draft_name, 0), (target, target_rows, target_name, 1)):
        if values is None:
            continue
        if rows is not None:
            read = read_positions(num_draft, batch, num_positions, last_offset, values.device)
            check_indexed_values(values, rows, read, name, from_logits, mass_flag(last_offset))
        elif from_logits:
            check_values(values, name, from_logits=True)
        else:
            check_probability_positions(values, name, num_draft, num_positions, last_offset)


def position_rows(values: torch.Tensor, width: Optional[int] = None,
                  slots: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` [S, P, V] as rows [S P, V] (a view when it is contiguous), and the int64 indices [M, width] of the
    first ``width`` positions (all P by default) of the slots ``slots`` [M] (all S by default): what ``target_rows`` /
    ``draft_rows`` take to read those positions in place, with no copy of them. ``width`` must lie in [0, P] (more
    would read the next slot's rows); the slots' values are not read (no host sync): they must lie in [0, S)."""
    if values.dim() != 3:
        raise ValueError(f"values must have shape [S, P, V], got {list(values.shape)}")
    count, positions = values.shape[:2]
    if width is not None and not 0 <= width <= positions:
        raise ValueError(f"width must lie in [0, P] with P = {positions} positions per slot, got {width}")
    device = values.device if slots is None else slots.device
    slots = torch.arange(count, device=device) if slots is None else slots.to(torch.int64)
    columns = torch.arange(positions if width is None else width, dtype=torch.int64, device=device)
    return values.flatten(0, 1), slots[:, None] * positions + columns


def gather_rows(values: Optional[torch.Tensor], rows: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The [B, width, V] tensor a row tensor's index describes, each index clamped into [0, R) as the kernels clamp
    it (the references' way of reading rows; the kernels read them in place)."""
    if values is None or rows is None:
        return values
    return values[rows.clamp(0, max(values.shape[0] - 1, 0))]
