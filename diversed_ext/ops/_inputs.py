"""Validation and normalisation of verify arguments, one rule per argument, shared by the native ops and the
references (``_prepare`` applies them all to a verify call; ``_rows`` holds the rules of the row indices).

Structural checks (types, ranks, shapes, dtypes, devices) cost nothing and always run. Checks of values (token ids,
probabilities, weights, uniforms, draft lengths) read tensors back to the host, so they run only with
``check_inputs=True``; without them the kernels stay memory-safe by construction (see csrc/common/verify_math.h).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from .. import rules
from ._philox import draw_cuda_generator_seed, normalize_offset  # noqa: F401  (the offset rule lives there)

PROB_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOKEN_DTYPES = (torch.int32, torch.int64)


WeightLike = Union[float, torch.Tensor]
SeedLike = Union[int, torch.Tensor, None]


@dataclass(slots=True)
class VerifyArgs:
    """The positional arguments of ``diversed::verify_probs``, named, in its order (what
    :func:`~diversed_ext.ops._prepare.prepare_verify` returns as a plain tuple; verify_logits takes its temperatures
    in place of greedy and its temperature_value before the seed). Defaults stay scalars or None, so that a call with
    default arguments creates no tensor before the op; :meth:`materialized` spells them out as tensors."""

    draft_tokens: torch.Tensor  # int64 [B, K]
    draft: Optional[torch.Tensor]  # [B, K, V] probabilities or logits, contiguous; None: the draft gave tokens only
    target: torch.Tensor  # [B, K+1, V], of its own dtype (float32, bfloat16 or float16, like the draft's)
    weight: Optional[torch.Tensor]  # float32 [B, K], or None: weight_value everywhere
    num_draft: Optional[torch.Tensor]  # int64 [B], or None: K everywhere
    greedy: Optional[torch.Tensor]  # bool [B], or None: no greedy row
    uniforms: Optional[torch.Tensor]  # float64 [B, K+1] or None (then Philox with the seeds)
    seeds: Optional[torch.Tensor]  # int64 [B], or None: the shared `seed`
    offset: int
    per_row_seed: bool
    weight_value: float
    seed: Optional[int]  # a shared seed; None with seeds and uniforms None: the op draws one on the device
    target_rows: Optional[torch.Tensor] = None  # int64 [B, K+1]: target is then [R, V], read at these rows
    draft_rows: Optional[torch.Tensor] = None  # int64 [B, K]: draft is then [Rd, V]

    def materialized(self) -> "VerifyArgs":
        """The same arguments with every default as a tensor (weight [B, K], num_draft, greedy, and seeds [B] unless
        uniforms are given), which is what the pure-PyTorch reference works on. A seed left to the op is drawn here
        exactly as the op draws it."""
        batch, num_positions = self.draft_tokens.shape
        device = self.target.device
        weight = self.weight
        if weight is None:
            weight = torch.full((batch, num_positions), self.weight_value, dtype=torch.float32, device=device)
        num_draft = self.num_draft
        if num_draft is None:
            num_draft = torch.full((batch,), num_positions, dtype=torch.int64, device=device)
        greedy = self.greedy if self.greedy is not None else torch.zeros(batch, dtype=torch.bool, device=device)
        seeds = self.seeds
        if seeds is None and self.uniforms is None:
            seeds, _ = seed_tensor(self.seed, batch, device)
        return VerifyArgs(self.draft_tokens, self.draft, self.target, weight, num_draft, greedy, self.uniforms, seeds,
                          self.offset, self.per_row_seed, self.weight_value, self.seed, self.target_rows,
                          self.draft_rows)


def require_tensor(value, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def require_rank(tensor: torch.Tensor, rank: int, name: str, layout: str) -> None:
    if tensor.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions {layout}, got shape {tuple(tensor.shape)}")


def require_device(tensor: torch.Tensor, device: torch.device, name: str,
                   beside: str = "the probabilities are") -> None:
    """``beside``: what lies on ``device``, with its verb ("draft_probs is")."""
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but {beside} on {device}; put them on one device")


def check_value_dtype(dtype: torch.dtype, name: str, kind: str) -> None:
    if dtype in PROB_DTYPES:
        return
    if not dtype.is_floating_point:
        raise TypeError(f"{name} must hold floating-point {kind}, got dtype {dtype}")
    raise TypeError(f"{name} must be float32, bfloat16 or float16, got {dtype}")


def check_target_only(target: torch.Tensor, target_name: str, kind: str) -> tuple[int, int, int]:
    """The target tensor of a call without draft distributions (the draft gave tokens only); returns (B, K, V) with K
    one less than the target's positions."""
    require_tensor(target, target_name)
    check_value_dtype(target.dtype, target_name, kind)
    require_rank(target, 3, target_name, "[B, K+1, V]")
    batch, target_positions, vocab = target.shape
    if target_positions == 0:
        raise ValueError(f"{target_name} must have K+1 >= 1 positions (the bonus row), got shape {tuple(target.shape)}")
    if vocab == 0:
        raise ValueError(f"vocabulary size V must be positive, got {target_name} shape {tuple(target.shape)}")
    return batch, target_positions - 1, vocab


def check_pair_layout(draft: torch.Tensor, target: torch.Tensor, draft_name: str, target_name: str,
                      kind: str, same_dtype: bool = True) -> tuple[int, int, int, int]:
    """Types, ranks, dtypes, devices and B/V agreement of a draft and a target tensor; returns (B, K, V, the
    target's positions). How many positions the target must have is the caller's rule: K + 1 for verify, K or at
    least K for token_stats and mix. Each dtype is one of PROB_DTYPES; ``same_dtype`` asks them to be equal
    (token_stats and mix); the verify ops read a draft and a target of different dtypes each as it lies."""
    # Every check is a cheap test first and the helper that words the error only when it fails: this runs on every
    # call, and each Python call or .shape read costs a fraction of a microsecond.
    if not (isinstance(draft, torch.Tensor) and isinstance(target, torch.Tensor)):
        require_tensor(draft, draft_name)
        require_tensor(target, target_name)
    draft_dtype, target_dtype = draft.dtype, target.dtype
    if draft_dtype not in PROB_DTYPES or target_dtype not in PROB_DTYPES:
        check_value_dtype(draft_dtype, draft_name, kind)
        check_value_dtype(target_dtype, target_name, kind)
    draft_shape, target_shape = draft.shape, target.shape
    if len(draft_shape) != 3 or len(target_shape) != 3:
        require_rank(draft, 3, draft_name, "[B, K, V]")
        require_rank(target, 3, target_name, "[B, K+1, V]")
    if same_dtype and draft_dtype != target_dtype:
        raise TypeError(f"{draft_name} ({draft_dtype}) and {target_name} ({target_dtype}) must have the same dtype")
    if target.device != draft.device:
        require_device(target, draft.device, target_name, f"{draft_name} is")
    batch, num_positions, vocab = draft_shape
    target_batch, target_positions, target_vocab = target_shape
    if vocab == 0 or target_vocab == 0:
        raise ValueError(f"vocabulary size V must be positive, got {draft_name} shape {tuple(draft.shape)}")
    if target_batch != batch:
        raise ValueError(f"{target_name} has batch size {target_batch} but {draft_name} has {batch}")
    if target_vocab != vocab:
        raise ValueError(f"{target_name} has vocabulary size {target_vocab} but {draft_name} has {vocab}")
    return batch, num_positions, vocab, target_positions


def check_distributions(draft: Optional[torch.Tensor], target: torch.Tensor, draft_name: str, target_name: str,
                        kind: str) -> tuple[int, int, int]:
    """verify's draft [B, K, V] and target [B, K+1, V] (check_pair_layout, then K + 1 target positions); returns
    (B, K, V). Their dtypes may differ (each float32, bfloat16 or float16). A draft of None (tokens only) leaves the
    target alone to check."""
    if draft is None:
        return check_target_only(target, target_name, kind)
    batch, num_positions, vocab, target_positions = check_pair_layout(draft, target, draft_name, target_name, kind,
                                                                      same_dtype=False)
    if target_positions != num_positions + 1:
        raise ValueError(f"{target_name} must have K+1 = {num_positions + 1} positions (K from {draft_name}), "
                         f"got {target_positions}")
    return batch, num_positions, vocab


def weight_argument(weight: WeightLike, batch: int, num_positions: int, device: torch.device,
                    check_inputs: bool) -> tuple[Optional[torch.Tensor], float]:
    """The weight rule, for every caller: the op's (weight, weight_value). A number stays a scalar (rules.weight, no
    tensor made); a 0-d, [B] or [B, K] floating-point tensor becomes float32 [B, K], untouched when it already is one
    (contiguous). Its values are read only with ``check_inputs``."""
    if not isinstance(weight, torch.Tensor):
        return None, rules.weight(weight)
    if not (weight.dtype == torch.float32 and weight.shape == (batch, num_positions) and weight.is_contiguous()):
        weight = _weight_as_op_layout(weight, batch, num_positions)
    if weight.device != device:
        require_device(weight, device, "weight")
    if check_inputs and weight.numel() > 0:
        if bool(torch.isnan(weight).any()):
            raise ValueError("weight contains NaN")
        low, high = float(weight.min()), float(weight.max())
        if low < 0.0 or high > 1.0:
            raise ValueError(f"weight must lie in [0, 1], got values in [{low}, {high}]")
    return weight, 1.0


def _weight_as_op_layout(weight: torch.Tensor, batch: int, num_positions: int) -> torch.Tensor:
    """A 0-d, [B] or [B, K] floating-point weight tensor as contiguous float32 [B, K]."""
    if not weight.is_floating_point():
        raise TypeError(f"weight must be a floating-point tensor, got dtype {weight.dtype}")
    if weight.dim() == 0:
        weight = weight.reshape(1, 1)
    elif weight.dim() == 1:
        if weight.shape[0] != batch:
            raise ValueError(f"weight of shape [B] must have B = {batch} entries, got {weight.shape[0]}")
        weight = weight.unsqueeze(1)
    elif weight.dim() == 2:
        if tuple(weight.shape) != (batch, num_positions):
            raise ValueError(f"weight of shape [B, K] must be [{batch}, {num_positions}], got {tuple(weight.shape)}")
    else:
        raise ValueError(f"weight must be a float or a tensor of shape [B] or [B, K], got shape {tuple(weight.shape)}")
    return weight.to(torch.float32).expand(batch, num_positions).contiguous()


def weight_tensor(weight: WeightLike, batch: int, num_positions: int, device: torch.device,
                  check_inputs: bool) -> torch.Tensor:
    """The weight as float32 [B, K] even when it is a float (mix and the references work on tensors); the rule is
    weight_argument's."""
    weight_t, weight_value = weight_argument(weight, batch, num_positions, device, check_inputs)
    if weight_t is None:
        weight_t = torch.full((batch, num_positions), weight_value, dtype=torch.float32, device=device)
    return weight_t


def normalize_tokens(draft_tokens, batch: int, num_positions: int, device: torch.device, draft_name: Optional[str],
                     target_name: str) -> torch.Tensor:
    """int64 [B, K] drafted ids; B and K come from the draft tensor ``draft_name``, or from the target's K+1 rows when
    there is no draft (None). The names only word an error."""
    if not isinstance(draft_tokens, torch.Tensor):
        require_tensor(draft_tokens, "draft_tokens")
    dtype = draft_tokens.dtype
    if dtype not in TOKEN_DTYPES:
        raise TypeError(f"draft_tokens must be int32 or int64, got {dtype}")
    shape = draft_tokens.shape
    if len(shape) != 2:
        require_rank(draft_tokens, 2, "draft_tokens", "[B, K]")
    if shape != (batch, num_positions):
        shape_source = draft_name if draft_name is not None else f"{target_name}, which has K+1 positions"
        raise ValueError(f"draft_tokens must be [B, K] = [{batch}, {num_positions}] (from {shape_source}), "
                         f"got {tuple(draft_tokens.shape)}")
    if draft_tokens.device != device:
        require_device(draft_tokens, device, "draft_tokens")
    if dtype != torch.int64:  # .to() costs a microsecond even when it has nothing to do
        draft_tokens = draft_tokens.to(torch.int64)
    return draft_tokens.contiguous()


def normalize_num_draft(num_draft, batch: int, num_positions: int, device: torch.device,
                        check_inputs: bool) -> Optional[torch.Tensor]:
    """int64 [B], or None when absent (every row drafts K)."""
    if num_draft is None:
        return None
    require_tensor(num_draft, "num_draft")
    if num_draft.is_floating_point() or num_draft.is_complex() or num_draft.dtype == torch.bool:
        raise TypeError(f"num_draft must be an integer tensor, got {num_draft.dtype}")
    if tuple(num_draft.shape) != (batch,):
        raise ValueError(f"num_draft must have shape [B] = [{batch}], got {tuple(num_draft.shape)}")
    require_device(num_draft, device, "num_draft")
    num_draft = num_draft.to(torch.int64).contiguous()
    if check_inputs and batch > 0:
        low, high = int(num_draft.min()), int(num_draft.max())
        if low < 0 or high > num_positions:
            raise ValueError(f"num_draft must lie in [0, K] = [0, {num_positions}], got values in [{low}, {high}]")
    return num_draft


def normalize_greedy(greedy, batch: int, device: torch.device) -> Optional[torch.Tensor]:
    """bool [B], or None when no row is greedy."""
    if greedy is None or greedy is False:
        return None
    if isinstance(greedy, bool):
        return torch.full((batch,), greedy, dtype=torch.bool, device=device)
    require_tensor(greedy, "greedy")
    if greedy.dtype != torch.bool:
        raise TypeError(f"greedy must be a bool tensor of shape [B], got dtype {greedy.dtype}")
    if tuple(greedy.shape) != (batch,):
        raise ValueError(f"greedy must have shape [B] = [{batch}], got {tuple(greedy.shape)}")
    require_device(greedy, device, "greedy")
    return greedy.contiguous()


def normalize_uniforms(uniforms, batch: int, num_positions: int, device: torch.device,
                       check_inputs: bool) -> Optional[torch.Tensor]:
    if uniforms is None:
        return None
    require_tensor(uniforms, "uniforms")
    if not uniforms.is_floating_point():
        raise TypeError(f"uniforms must be a floating-point tensor, got dtype {uniforms.dtype}")
    if tuple(uniforms.shape) != (batch, num_positions + 1):
        raise ValueError(f"uniforms must have shape [B, K+1] = [{batch}, {num_positions + 1}], "
                         f"got {tuple(uniforms.shape)}")
    require_device(uniforms, device, "uniforms")
    uniforms = uniforms.to(torch.float64).contiguous()
    if check_inputs and uniforms.numel() > 0:
        if bool(torch.isnan(uniforms).any()):
            raise ValueError("uniforms contains NaN")
        low, high = float(uniforms.min()), float(uniforms.max())
        if low < 0.0 or high >= 1.0:
            raise ValueError(f"uniforms must lie in [0, 1), got values in [{low}, {high}]")
    return uniforms


def seed_tensor(seed: SeedLike, batch: int, device: torch.device) -> tuple[torch.Tensor, bool]:
    """Seeds as int64 [B] and whether they are per row, for the reference (the rule is seed_argument's). No seed: one
    is drawn from torch's default generator, as the op draws it."""
    seeds, value, per_row = seed_argument(seed, batch, device)
    if seeds is not None:
        return seeds, per_row
    if value is None and device.type == "cuda":
        # The CUDA kernels draw their seed from the CUDA generator's Philox state inside the kernel.
        return torch.full((batch,), draw_cuda_generator_seed(device), dtype=torch.int64, device=device), False
    if value is None:
        # Drawn where it is used, from that device's default generator: a CPU draw copied to a GPU would make every
        # call synchronise with the host. The native ops draw theirs the same way (csrc/common/op_outputs.h).
        drawn = torch.randint(0, rules.SEED_RANGE - 1, (1,), dtype=torch.int64, device=device)
        return drawn.expand(batch).contiguous(), False
    return torch.full((batch,), value, dtype=torch.int64, device=device), False


def seed_argument(seed: SeedLike, batch: int, device: torch.device) -> tuple[Optional[torch.Tensor], Optional[int], bool]:
    """The seed rule, for every caller: the op's (seeds, seed, per_row_seed). Per-request seeds as int64 [B] (moved
    to the device), or one int seed (rules.seed), or neither (the op then draws a seed on the device, as seed_tensor
    does)."""
    if seed is None:
        return None, None, False
    if not isinstance(seed, torch.Tensor):
        return None, rules.seed(seed), False
    if seed.dtype == torch.int64 and seed.shape == (batch,) and seed.is_contiguous() and seed.device == device:
        return seed, None, True  # already the op's layout: nothing to convert
    if seed.dtype not in TOKEN_DTYPES:
        raise TypeError(f"seed tensor must be int32 or int64, got {seed.dtype}")
    if tuple(seed.shape) != (batch,):
        raise ValueError(f"seed tensor must have shape [B] = [{batch}], got {tuple(seed.shape)}")
    return seed.to(device=device, dtype=torch.int64).contiguous(), None, True
