"""Argument checks of the decoding loop: each raises TypeError or ValueError naming the argument."""

from __future__ import annotations

from numbers import Integral
from typing import Callable, Optional, Sequence, Union

import torch

from .. import rules
from .gate import Gate, require_sampling

METHODS = ("ar", "sd", "static", "diversed", "fly")
# What the verifier gets from a draft: its distributions q (the draft samples from q), or its tokens only (q one-hot at
# each drafted token: the draft's argmax, or a sample of its distribution for "sampled_tokens").
DRAFT_MODES = ("distributions", "tokens", "sampled_tokens")

PromptLike = Union[torch.Tensor, Sequence[int]]
HeadLike = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
DrafterLike = Callable[[list, int], Sequence[int]]


def check_method(method) -> str:
    """One of METHODS; ``fly`` (sd with FLy) is resolved by the decoder before it asks."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    return method


def check_weight(method: str, weight) -> float:
    """The static weight on the target: required for ``static``, 1 for ``sd``, absent otherwise."""
    if weight is not None:
        weight = rules.weight(weight)
    if method == "static" and weight is None:
        raise ValueError("method 'static' needs weight=w in [0, 1] (the weight on the target)")
    if method == "sd" and weight not in (None, 1.0):
        raise ValueError(f"method 'sd' is the w = 1 case; got weight={weight} (use method='static')")
    if method in ("ar", "diversed") and weight is not None:
        raise ValueError(f"weight applies to 'static' (and 'sd' with w = 1), not to method {method!r}")
    return 1.0 if weight is None else weight


def check_gate(gate, method: str, temperature: float):
    """The log-probability gate: a :class:`~.gate.Gate` or None, for a method that drafts, sampled (temperature > 0:
    greedy decoding has no log-probabilities to compare)."""
    if gate is None:
        return None
    if not isinstance(gate, Gate):
        raise TypeError(f"gate must be a diversed_ext.decoding.Gate or None, got {type(gate).__name__}")
    if method == "ar":
        raise ValueError("gate applies to methods that draft (sd, static, diversed), not to 'ar'")
    require_sampling(temperature)
    return gate


def check_head(method: str, head):
    if method == "diversed":
        if head is None:
            raise ValueError("method 'diversed' needs head=..., a callable (draft_hidden, target_hidden) -> w")
        if not callable(head):
            raise TypeError(f"head must be callable (draft_hidden, target_hidden) -> w, got {type(head).__name__}")
    elif head is not None:
        raise ValueError(f"head applies only to method 'diversed', not {method!r}")
    return head


def check_head_device(head, device: torch.device) -> None:
    """A head module must sit where its inputs meet, on the target's device: one elsewhere is refused here, with the
    fix, rather than inside its first forward pass."""
    parameter = next(head.parameters(), None) if isinstance(head, torch.nn.Module) else None
    if parameter is not None and parameter.device != torch.device(device):
        raise ValueError(f"head is on {parameter.device} and the target on {device}: the head reads both models' "
                         f"outputs on the target's device, so move it there (head.to({str(device)!r}))")


def check_draft_mode(method: str, draft_mode, drafter) -> str:
    """What the verifier sees of the drafts: ``draft_mode`` (None: "tokens" with a callable ``drafter``, else
    "distributions"). A callable drafter gives tokens only, and only sd and static run without a head's inputs."""
    if draft_mode is not None and draft_mode not in DRAFT_MODES:
        raise ValueError(f"draft_mode must be one of {', '.join(DRAFT_MODES)} (or None); got {draft_mode!r}")
    if drafter is None:
        if method == "ar" and draft_mode not in (None, "distributions"):
            raise ValueError(f"draft_mode applies to methods with a draft, not to method 'ar'; got {draft_mode!r}")
        return draft_mode or "distributions"
    if not callable(drafter):
        raise TypeError(f"drafter must be callable (context_token_ids, k) -> list of token ids, "
                        f"got {type(drafter).__name__}")
    if method not in ("sd", "static"):
        reason = ("the head of 'diversed' reads the draft model's hidden states, which a callable drafter does not "
                  "have: pass draft=<model> with draft_mode='tokens'" if method == "diversed" else
                  "'ar' drafts nothing")
        raise ValueError(f"drafter (a callable) works with methods 'sd' and 'static', not {method!r}: {reason}")
    if draft_mode not in (None, "tokens"):
        raise ValueError(f"drafter gives tokens only, so draft_mode must be 'tokens' (or None); got {draft_mode!r}")
    return "tokens"


def check_drafted(tokens, k: int, vocab: Optional[int]) -> list[int]:
    """A callable drafter's proposal as a list of at most ``k`` ids in [0, vocab)."""
    if torch.is_tensor(tokens):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TypeError(f"drafter must return a list of int token ids (or a 1-D integer tensor), got a "
                            f"{tokens.dim()}-D {tokens.dtype} tensor")
        tokens = tokens.tolist()
    if not isinstance(tokens, (list, tuple)):
        raise TypeError(f"drafter must return a list of int token ids, got {type(tokens).__name__}")
    for token in tokens:
        if isinstance(token, bool) or not isinstance(token, Integral):
            raise TypeError(f"drafter must return a list of int token ids, got an element of type "
                            f"{type(token).__name__}: {token!r}")
    if len(tokens) > k:
        raise ValueError(f"drafter returned {len(tokens)} tokens; it was asked for at most k = {k}")
    outside = [int(token) for token in tokens if token < 0 or (vocab is not None and token >= vocab)]
    if outside:
        raise ValueError(f"drafter returned token ids outside [0, {'inf' if vocab is None else vocab}): {outside}")
    return [int(token) for token in tokens]


def check_max_new_tokens(max_new_tokens) -> int:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, Integral) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    return int(max_new_tokens)


def check_prompt(tokens: list[int], vocab: Optional[int]) -> None:
    if not tokens:
        raise ValueError("input_ids: a prompt must hold at least one token")
    low, high = min(tokens), max(tokens)
    if low < 0 or (vocab is not None and high >= vocab):
        raise ValueError(f"input_ids: token ids must be in [0, {vocab}), got values in [{low}, {high}]")


def check_seed(seed) -> int:
    """A seed (:func:`diversed_ext.rules.seed`) as a counter in [0, 2**63); None draws one from torch's default
    generator (so torch.manual_seed repeats runs)."""
    if seed is None:
        return int(torch.randint(0, 2**62, (1,)))
    return rules.seed(seed) % rules.SEED_RANGE


def check_batch_size(batch_size, num_prompts: int) -> int:
    """Rows decoded together: ``batch_size`` (an int >= 1), or every prompt for None."""
    if batch_size is None:
        return max(num_prompts, 1)
    if isinstance(batch_size, bool) or not isinstance(batch_size, Integral):
        raise TypeError(f"batch_size must be an int >= 1 or None, got {type(batch_size).__name__}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 (or None for all prompts), got {batch_size}")
    return int(batch_size)
