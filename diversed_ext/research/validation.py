"""Choosing head inputs and coefficients without decoding: closed-form next-token quantities on held-out contexts.

At a context t with next-token distributions p_t (target) and q_t (draft), a weight w_t gives

    expected acceptance         a_t = 1 - w_t TV(p_t, q_t)
    expected fidelity change    f_t = (1 - w_t) G_t,     G_t = E_q[log p_t] - E_p[log p_t] <= 0 mostly
    divergence from the target  d_t = KL(nu_t || p_t),  nu_t = w_t p_t + (1 - w_t) q_t

(the closed-form terms the trainer optimises; d_t read from its table over w). Over the same contexts a static ensemble
c traces the line a = 1 - c mean(TV), f = (1 - c) mean(G), and a convex curve of d; a head is worth keeping where its
point lies above that line at its own acceptance, or below that curve. Fidelity rewards a sharper output, so only the
divergence tells a head that follows the target's law better from one that runs colder. The contexts come from
completions of held-out prompts, sampled once through the speculative loop (static w = 0.5 by default) and
teacher-forced through both models. Means are taken per prompt, then over prompts, so standard errors and differences
are paired over prompts.

For coefficients (lambda on acceptance, mu on expected fidelity) the loss is minimised token by token by w_t = 1 where
mu (-G_t) > lambda TV_t and w_t = 0 elsewhere; with kappa on the divergence too, by the w_t of the table's grid that
minimises lambda w_t TV_t - mu (1 - w_t) G_t + kappa d_t. That rule's acceptance at each lambda shows, before any
training, which coefficients spread the heads' acceptances over a wanted range.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional, Sequence

import torch

from ..decoding import DEFAULT_MAX_DRAFT, SpeculativeDecoder
from ..decoding.runners import model_device
from .objective import interpolated_kl, kl_grid
from .report import _mean, paired_difference, standard_error
from .rollouts import draft_steps
from .teacher_forcing import TokenBatch, teacher_forced_tokens


@dataclasses.dataclass
class ClosedFormPoint:
    """Per-prompt means of one weighting's closed-form quantities on a :class:`TokenBatch` (lists over prompts)."""

    label: str
    weight: list[float]
    acceptance: list[float]
    fidelity_change: list[float]
    kl: list[float]  # KL(nu || p)


def sample_validation_tokens(target, draft, prompts: Sequence[Sequence[int]], *, weight: float = 0.5,
                             max_draft: int = DEFAULT_MAX_DRAFT, max_new_tokens: int = 128, temperature: float = 1.0, seed: int = 0,
                             eos_token_id=None, batch_size: Optional[int] = 16) -> TokenBatch:
    """Completions of ``prompts`` sampled from the static ensemble ``weight`` (prompt i with seed + i), then one
    teacher-forced pass of both models over them; the batch is returned on the CPU."""
    decoder = SpeculativeDecoder(target, draft, method="static", weight=weight, max_draft=max_draft,
                                 temperature=temperature)
    output = decoder.generate([list(prompt) for prompt in prompts], max_new_tokens=max_new_tokens,
                              eos_token_id=eos_token_id, seed=seed, batch_size=batch_size, progress=True)
    # On the CPU: the closed forms are sums over a few thousand tokens, and a token file loads there.
    return teacher_forced_tokens(target, draft, prompts, [tokens.tolist() for tokens in output.sequences],
                                 temperature, [draft_steps(rounds) for rounds in output.rounds]).to("cpu")


# The safetensors metadata entry of a token file that records the settings its contexts were sampled under.
SETTINGS_KEY = "settings"


def save_tokens(tokens: TokenBatch, path: str, settings: Optional[dict] = None) -> None:
    """A :class:`TokenBatch` as a safetensors file (nothing executable in it); ``settings`` (JSON-ready), the ones
    its contexts were sampled under, go into its metadata for :func:`recorded_token_settings`."""
    from safetensors.torch import save_file

    save_file({field.name: getattr(tokens, field.name).contiguous() for field in dataclasses.fields(TokenBatch)},
              path, metadata=None if settings is None else {SETTINGS_KEY: json.dumps(settings, sort_keys=True)})


def recorded_token_settings(path: str) -> Optional[dict]:
    """The settings :func:`save_tokens` recorded in a token file (its header alone is read), None where it recorded
    none, or a ValueError naming what is wrong."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
    except (SafetensorError, OSError, RuntimeError) as error:
        raise ValueError(f"not a readable safetensors file ({error})") from None
    if SETTINGS_KEY not in metadata:
        return None
    try:
        settings = json.loads(metadata[SETTINGS_KEY])
    except json.JSONDecodeError as error:
        raise ValueError(f"its recorded settings are not JSON ({error})") from None
    if not isinstance(settings, dict):
        raise ValueError(f"its recorded settings are not an object: {settings!r}")
    return settings


def load_tokens(path: str) -> TokenBatch:
    """The :class:`TokenBatch` :func:`save_tokens` wrote, or a ValueError naming the file and what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        stored = load_file(path)
    except (SafetensorError, OSError, RuntimeError) as error:
        raise ValueError(f"{path} is not a readable safetensors file ({error})") from None
    names = [field.name for field in dataclasses.fields(TokenBatch)]
    missing = [name for name in names if name not in stored]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}: not a token file of this version")
    return TokenBatch(**{name: stored[name] for name in names})


def _per_prompt(values: torch.Tensor, mask: torch.Tensor) -> list[float]:
    counts = mask.sum(-1).clamp_min(1)
    return ((values * mask).sum(-1) / counts).tolist()


def weighted_point(label: str, weights: torch.Tensor, tokens: TokenBatch) -> ClosedFormPoint:
    """The closed-form point of per-token ``weights`` [N, T] on ``tokens``."""
    mask = tokens.mask.to(weights.dtype)
    weights = weights.detach().to(tokens.total_variation.dtype)
    return ClosedFormPoint(label, _per_prompt(weights, mask),
                           _per_prompt(1.0 - weights * tokens.total_variation, mask),
                           _per_prompt((1.0 - weights) * tokens.fidelity_gap, mask),
                           _per_prompt(interpolated_kl(weights, tokens.kl_table), mask))


@torch.no_grad()
def head_point(label: str, head, tokens: TokenBatch) -> ClosedFormPoint:
    """A head's closed-form point (its weights from the contexts' hidden states and distribution features), the head
    run on its own device."""
    device = model_device(head)
    weights = head(*(inputs.to(device) for inputs in tokens.head_inputs(head)))
    return weighted_point(label, weights.float().to(tokens.mask.device), tokens)


def static_point(weight: float, tokens: TokenBatch) -> ClosedFormPoint:
    label = "sd" if weight == 1.0 else f"static w={weight:g}"
    return weighted_point(label, torch.full(tokens.mask.shape, float(weight)), tokens)


def rule_point(acceptance_coef: float, expected_fidelity_coef: float, tokens: TokenBatch,
               expected_kl_coef: float = 0.0) -> ClosedFormPoint:
    """The token-by-token minimiser of the closed-form loss: w = 1 where mu (-G) > lambda TV, else 0; with
    ``expected_kl_coef`` kappa > 0, the weight of the KL table's grid that minimises
    lambda w TV - mu (1 - w) G + kappa d."""
    label = f"rule lambda={acceptance_coef:g}" + (f" kappa={expected_kl_coef:g}" if expected_kl_coef > 0 else "")
    if expected_kl_coef <= 0:
        keep_target = expected_fidelity_coef * -tokens.fidelity_gap > acceptance_coef * tokens.total_variation
        return weighted_point(label, keep_target.float(), tokens)
    grid = kl_grid(tokens.kl_table.dtype)
    loss = (acceptance_coef * grid * tokens.total_variation.unsqueeze(-1)
            - expected_fidelity_coef * (1.0 - grid) * tokens.fidelity_gap.unsqueeze(-1)
            + expected_kl_coef * tokens.kl_table)
    return weighted_point(label, grid[loss.argmin(-1)], tokens)


def _mean_total_variation(tokens: TokenBatch) -> float:
    """Mean over prompts of each prompt's mean TV: 1 minus sd's closed-form acceptance."""
    return _mean(_per_prompt(tokens.total_variation, tokens.mask.to(tokens.total_variation.dtype)))


def gap_to_static_line(point: ClosedFormPoint, tokens: TokenBatch,
                       figure: str = "fidelity_change") -> tuple[float, float]:
    """(mean, standard error over prompts) of the point's ``figure`` (``"fidelity_change"`` or ``"kl"``) minus that of
    the static ensemble with the same mean acceptance on the same prompts."""
    mean_tv = _mean_total_variation(tokens)
    static_weight = min(max((1.0 - _mean(point.acceptance)) / max(mean_tv, 1e-12), 0.0), 1.0)
    static = static_point(static_weight, tokens)
    return paired_difference(getattr(point, figure), getattr(static, figure))


def point_row(point: ClosedFormPoint, tokens: TokenBatch) -> dict:
    """What the validate table shows of a point: its distances to the static ensembles of equal acceptance are
    positive where it is better (``gap``: fidelity above their line; ``kl_below``: KL below their curve)."""
    sd_acceptance = 1.0 - _mean_total_variation(tokens)  # w = 1 everywhere
    gap, gap_se = gap_to_static_line(point, tokens)
    kl_above, kl_se = gap_to_static_line(point, tokens, "kl")
    acceptance = _mean(point.acceptance)
    return {"label": point.label, "mean_weight": _mean(point.weight), "acceptance": acceptance,
            "acceptance_se": standard_error(point.acceptance), "x_sd": acceptance / sd_acceptance,
            "fidelity_change": _mean(point.fidelity_change), "gap": gap, "gap_se": gap_se, "kl": _mean(point.kl),
            "kl_below": -kl_above, "kl_below_se": kl_se}
