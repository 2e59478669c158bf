"""Value checks of the ops' inputs (``check_inputs=True``): they read every value, so they synchronise with the device.

On the CPU one native pass (``diversed::value_flags``) reads every value once and flags what is wrong with each row;
one host read of the flags then decides, and only a failing check reads more to say where. On other devices the
checks are torch reductions. Without them the kernels stay memory-safe by construction and treat bad
values by fixed rules (csrc/common/verify_math.h).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _fake  # noqa: F401  (loads the library with diversed::value_flags)

# The target's support (csrc/common/verify_math.h: kMinTargetMass, which says why this value): a target probability
# below it counts as zero in the verify ops. A hard constraint of a server (bad words, allowed token ids, a -inf or
# -100 logit bias, min_tokens) reaches the verifier only as such a probability, and must hold whatever the weight.
MIN_TARGET_MASS = 2.0 ** -64

# The bits of diversed::value_flags, per row (csrc/cpu/kernel_prelude.h sets the same ones).
FLAG_NAN = 1
FLAG_NEGATIVE = 2
FLAG_POSITIVE_INFINITY = 4
FLAG_NO_MASS = 8  # no positive probability; for logits, no entry above -inf
FLAG_NO_TARGET_MASS = 16  # probabilities only: none at or above MIN_TARGET_MASS, so none the verifier may emit
NO_MASS = {FLAG_NO_MASS: "no probability mass (all zeros)",
           FLAG_NO_TARGET_MASS: "no probability mass (nothing at or above 2^-64)"}
PROBABILITY_ERRORS = FLAG_NAN | FLAG_NEGATIVE | FLAG_POSITIVE_INFINITY
LOGIT_ERRORS = FLAG_NAN | FLAG_POSITIVE_INFINITY | FLAG_NO_MASS


def _native_flags(tensor: torch.Tensor, from_logits: bool) -> Optional[torch.Tensor]:
    """Per-row flags from the native pass on the CPU; None elsewhere (the torch reductions below serve)."""
    if tensor.device.type != "cpu":
        return None
    return torch.ops.diversed.value_flags(tensor, from_logits)


def row_value_flags(tensor: torch.Tensor, from_logits: bool) -> torch.Tensor:
    """int32 [...] per row of ``tensor`` [..., V], with value_flags' bits: the native pass on the CPU, torch reductions
    elsewhere (a few passes; only checked calls come here)."""
    flags = _native_flags(tensor, from_logits)
    if flags is not None:
        return flags
    bits = torch.isnan(tensor).any(-1).int() * FLAG_NAN + (tensor == float("inf")).any(-1).int() * FLAG_POSITIVE_INFINITY
    if from_logits:
        return bits + (~(tensor > float("-inf")).any(-1)).int() * FLAG_NO_MASS
    bits = bits + (tensor < 0).any(-1).int() * FLAG_NEGATIVE + (~(tensor > 0).any(-1)).int() * FLAG_NO_MASS
    return bits + (~(tensor >= MIN_TARGET_MASS).any(-1)).int() * FLAG_NO_TARGET_MASS


def _raise_first(name: str, flags: int, messages) -> None:
    """The error of the first (bit, message) in ``messages`` whose bit is among ``flags`` (or-ed row flags)."""
    for bit, message in messages:
        if flags & bit:
            raise ValueError(f"{name} {message}")


def _raise_probability_error(tensor: torch.Tensor, name: str, flags: int) -> None:
    negative = f"contains negative probabilities (minimum {float(tensor.min())})" if flags & FLAG_NEGATIVE else ""
    _raise_first(name, flags, ((FLAG_NAN, "contains NaN"), (FLAG_NEGATIVE, negative),
                               (FLAG_POSITIVE_INFINITY, "contains infinite values")))


def _first_empty_row(empty: torch.Tensor, name: str, mass_flag: int) -> None:
    if bool(empty.any()):
        batch_index, position = (int(index) for index in empty.nonzero()[0])
        raise ValueError(f"{name} has a row with {NO_MASS[mass_flag]} at [{batch_index}, {position}]")


def _or_reduce(flags: torch.Tensor) -> int:
    """The or of every row's flags (4 bits: whether any row has each), for the error message of a failed check."""
    bits = torch.tensor([FLAG_NAN, FLAG_NEGATIVE, FLAG_POSITIVE_INFINITY, FLAG_NO_MASS, FLAG_NO_TARGET_MASS],
                        dtype=flags.dtype)
    return int(((flags.reshape(-1, 1) & bits) != 0).any(0).mul(bits).sum())


def _probability_row_maxima(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Per-row minima and maxima find NaN (both propagate it), negative and infinite entries; returns every row's
    largest entry, so rows without mass are found without reading the tensor again. amin and amax along the last
    dimension are two fast vectorised reductions; torch's aminmax along a dimension is about 25x slower on the CPU."""
    row_min, row_max = tensor.amin(-1), tensor.amax(-1)
    low, high = float(row_min.min()), float(row_max.max())
    if low != low or high != high:
        raise ValueError(f"{name} contains NaN")
    if low < 0:
        raise ValueError(f"{name} contains negative probabilities (minimum {low})")
    if high == float("inf"):
        raise ValueError(f"{name} contains infinite values")
    return row_max


def _drafted_lengths(num_draft: Optional[torch.Tensor], batch: int, num_positions: int,
                     device: torch.device) -> torch.Tensor:
    """num_draft, or K for every row when it is absent."""
    return torch.full((batch,), num_positions, device=device) if num_draft is None else num_draft


def read_positions(num_draft: Optional[torch.Tensor], batch: int, num_positions: int, last_offset: int,
                   device: torch.device) -> torch.Tensor:
    """bool [B, K + last_offset]: the positions the verifier reads, i < num_draft[b] + last_offset (0 for draft rows,
    1 for target rows, whose position num_draft[b] is the bonus row)."""
    drafted = _drafted_lengths(num_draft, batch, num_positions, device)
    positions = torch.arange(num_positions + last_offset, device=device).unsqueeze(0)
    return positions < (drafted + last_offset).unsqueeze(1)


def check_verify_probabilities(draft: Optional[torch.Tensor], target: torch.Tensor,
                               num_draft: Optional[torch.Tensor], draft_name: str, target_name: str) -> None:
    """The value checks of verify's probabilities, and every row the verifier reads needs some mass: draft rows
    k < num_draft[b] (q at a rejection; positive) and target rows k <= num_draft[b] (some at or above MIN_TARGET_MASS,
    or the verifier has no token to emit). Rows past them are never read, so a server may leave them as zero padding.
    One pass over each tensor; a draft of None (tokens only) has nothing to check."""
    num_positions = target.shape[1] - 1
    for tensor, name, last_offset in ((draft, draft_name, 0), (target, target_name, 1)):
        if tensor is not None:
            check_probability_positions(tensor, name, num_draft, num_positions, last_offset)


def mass_flag(last_offset: int) -> int:
    """The flag of a row without the mass the verifier needs: a target row's (``last_offset`` 1, with the bonus row)
    or a draft row's (0)."""
    return FLAG_NO_TARGET_MASS if last_offset else FLAG_NO_MASS


def check_probability_positions(tensor: torch.Tensor, name: str, num_draft: Optional[torch.Tensor],
                                num_positions: int, last_offset: int) -> None:
    """check_verify_probabilities for one [B, K + last_offset, V] tensor: its values, and mass on the rows read."""
    if tensor.numel() == 0:
        return

    def read_rows() -> torch.Tensor:
        return read_positions(num_draft, tensor.shape[0], num_positions, last_offset, tensor.device)

    no_mass = mass_flag(last_offset)
    flags = _native_flags(tensor, from_logits=False)
    if flags is None:
        row_max = _probability_row_maxima(tensor, name)
        empty = row_max < MIN_TARGET_MASS if no_mass == FLAG_NO_TARGET_MASS else row_max == 0
        _first_empty_row(empty & read_rows(), name, no_mass)
        return
    # Nothing flagged, the common case, costs one host read. Only a flagged tensor needs the rows the verifier
    # reads: the no-mass bit counts on those rows alone (padding past num_draft may be all zeros).
    if not bool(flags.any()):
        return
    relevant = (flags & PROBABILITY_ERRORS) | torch.where(read_rows(), flags & no_mass, 0)
    if bool(relevant.any()):
        _raise_probability_error(tensor, name, _or_reduce(relevant))
        _first_empty_row((relevant & no_mass) != 0, name, no_mass)


def check_token_ids(draft_tokens: torch.Tensor, num_draft: Optional[torch.Tensor], vocab: int) -> None:
    """Token ids at drafted positions (i < num_draft) must lie in [0, V); padding past num_draft is ignored."""
    if draft_tokens.numel() == 0:
        return
    outside = (draft_tokens < 0) | (draft_tokens >= vocab)
    if not bool(outside.any()):  # the common case: one host read, and the drafted positions do not matter
        return
    num_draft = _drafted_lengths(num_draft, draft_tokens.shape[0], draft_tokens.shape[1], draft_tokens.device)
    drafted = torch.arange(draft_tokens.shape[1], device=draft_tokens.device) < num_draft.unsqueeze(1)
    _raise_first_bad_token(draft_tokens, drafted & outside, vocab)


def _raise_first_bad_token(draft_tokens: torch.Tensor, bad: torch.Tensor, vocab: int) -> None:
    if bool(bad.any()):
        row, position = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"draft_tokens[{row}, {position}] = {int(draft_tokens[row, position])} is outside [0, V) "
                         f"with V = {vocab}")


def _raise_logit_error(name: str, flags: int) -> None:
    _raise_first(name, flags, ((FLAG_NAN, "contains NaN"), (FLAG_POSITIVE_INFINITY, "contains +inf"),
                               (FLAG_NO_MASS, "has a row whose logits are all -inf (no token is possible)")))


def check_logit_flags(flags: torch.Tensor, name: str) -> None:
    """Raise for the first logit rule that per-row flags (value_flags' bits) break; one host read when none does."""
    errors = flags & LOGIT_ERRORS
    if bool(errors.any()):
        _raise_logit_error(name, _or_reduce(errors))


def _check_logit_values(tensor: torch.Tensor, name: str) -> None:
    """Logits may be -inf (masked vocabulary) but not NaN or +inf, and every row needs one finite entry."""
    if tensor.numel() == 0:
        return
    flags = _native_flags(tensor, from_logits=True)
    if flags is not None:
        check_logit_flags(flags, name)
        return
    if bool(torch.isnan(tensor).any()):
        raise ValueError(f"{name} contains NaN")
    row_max = tensor.amax(-1)
    if bool((row_max == float("inf")).any()):
        raise ValueError(f"{name} contains +inf")
    if bool((row_max == float("-inf")).any()):
        raise ValueError(f"{name} has a row whose logits are all -inf (no token is possible)")


def check_values(tensor: torch.Tensor, name: str, from_logits: bool) -> None:
    """Value checks of a probability or logit tensor (one or two passes, one host sync)."""
    if tensor.numel() == 0:
        return
    if from_logits:
        _check_logit_values(tensor, name)
        return
    flags = _native_flags(tensor, from_logits=False)
    if flags is None:
        _probability_row_maxima(tensor, name)
        return
    errors = flags & PROBABILITY_ERRORS
    if bool(errors.any()):
        _raise_probability_error(tensor, name, _or_reduce(errors))
