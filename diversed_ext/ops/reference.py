"""Pure-PyTorch DIVERSED verification: the same contract as the native ops, written the way a user would write it.

It is the correctness oracle of the test suite and the baseline of every benchmark. It follows the arithmetic model of
csrc/common/verify_math.h (float32 mixture without fused multiply-add, float64 accept test and cumulative sums), so
on identical uniforms it returns the same tokens as the kernels, and the same support rule: a target probability below
MIN_TARGET_MASS counts as zero, and a drafted token the target forbids (or, without checks, an id outside [0, V))
verifies with w = 1.
"""

from __future__ import annotations

import math

import torch

from .. import rules
from ._divergence import divergence_table
from ._fly import fly_arguments, fly_deferred, fly_entropy, fly_tensors
from ._inputs import VerifyArgs, weight_tensor
from ._pair_inputs import normalize_stat_tokens, prepare_features, prepare_pair
from ._philox import philox_uniforms
from ._prepare import prepare_verify
from ._rows import gather_rows
from ._temperature import distribution_temperature, is_greedy_temperature, temperature_tensor
from ._values import MIN_TARGET_MASS
from .api import TokenStats, VerifyResult

FLOAT32_MAX = torch.finfo(torch.float32).max
LARGEST_UNIFORM = 1.0 - 2.0 ** -53  # the largest double below 1: where the kernels clamp a uniform of 1 or more
LOG_FLOOR = -1e4  # 0 * log 0 is taken as 0: a ruled-out token's -inf log probability is floored before the product

def target_forbids(target_probs: torch.Tensor) -> torch.Tensor:
    """bool, like ``target_probs``: where the target forbids a token (probability below MIN_TARGET_MASS, or NaN). The
    verify ops never accept such a draft, verify its position with w = 1, and never emit such a token."""
    return ~(target_probs >= MIN_TARGET_MASS)


def _sanitize_mass(values: torch.Tensor, floor: float = 0.0) -> torch.Tensor:
    """NaN, negative and infinite mass count as zero (reachable only with check_inputs=False), and so does mass below
    ``floor`` (MIN_TARGET_MASS for the verify ops' target rows)."""
    return torch.where((values >= floor) & (values <= FLOAT32_MAX), values, torch.zeros_like(values))


def _target_mass(values: torch.Tensor) -> torch.Tensor:
    """The verify ops' target probabilities as float32: sanitised, and zero outside the target's support."""
    return _sanitize_mass(values.float(), MIN_TARGET_MASS)


def _sanitize_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(weight), torch.ones_like(weight), weight.clamp(0.0, 1.0))


def inverse_cdf_sample(mass: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """min{v : sum_{j<=v} mass_j > u * sum_j mass_j} per row, guarded so the id always has positive mass.

    Args:
        mass: [B, V] non-negative float32 (unnormalised).
        uniform: [B] float64 in [0, 1).
    Returns int64 [B]; rows with no mass give 0.
    """
    cdf = mass.to(torch.float64).cumsum(-1)
    threshold = (uniform * cdf[:, -1]).unsqueeze(1)
    chosen = torch.searchsorted(cdf, threshold, right=True).squeeze(1)
    vocab_ids = torch.arange(mass.shape[1], device=mass.device)
    last_positive = torch.where(mass > 0, vocab_ids, -1).amax(-1).clamp_min(0)
    chosen = chosen.clamp_max(mass.shape[1] - 1)
    chosen_mass = mass.gather(1, chosen.unsqueeze(1)).squeeze(1)
    return torch.where(chosen_mass > 0, chosen, last_positive)


def one_hot_drafts(draft_tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """The draft distributions of a drafter that gives tokens only: float32 [B, K, V], one-hot at each drafted id (a
    row of zeros for an id outside [0, V), which the verifier counts as rejected)."""
    valid = (draft_tokens >= 0) & (draft_tokens < vocab)
    one_hot = torch.nn.functional.one_hot(draft_tokens.clamp(0, vocab - 1), vocab).float()
    return one_hot * valid.unsqueeze(-1)


def reference_core(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                   weight: torch.Tensor, num_draft: torch.Tensor, greedy: torch.Tensor,
                   uniforms: torch.Tensor, fly=None) -> VerifyResult:
    """Verification on normalised arguments (see diversed_ext.ops._inputs.VerifyArgs) with explicit float64 uniforms;
    ``fly``: FLy's (window int64 [B], threshold float32 [B], top_k), or None. Draft and target may have different
    dtypes: both are read as float32."""
    batch, num_positions, vocab = draft_probs.shape
    rows = torch.arange(batch, device=draft_probs.device)
    positions = torch.arange(num_positions, device=draft_probs.device)
    weight = _sanitize_weight(weight)
    num_draft = num_draft.clamp(0, num_positions)  # as the kernels do when the checks are off
    target = _target_mass(target_probs)  # [B, K+1, V], zero outside the target's support
    draft = _sanitize_mass(draft_probs.float())

    drafted = positions.unsqueeze(0) < num_draft.unsqueeze(1)
    valid_id = (draft_tokens >= 0) & (draft_tokens < vocab)
    valid = valid_id & drafted
    safe_tokens = draft_tokens.clamp(0, vocab - 1).unsqueeze(-1)
    q_token = draft.gather(2, safe_tokens).squeeze(-1)
    p_token = target[:, :num_positions].gather(2, safe_tokens).squeeze(-1)
    # A draft the target forbids verifies with w = 1: nu(x) = p(x) = 0, never accepted, corrected by the residual. So
    # does an id outside [0, V) (p = 0 there): a server's mark for a draft it withdrew, such as vLLM's -1.
    forbidden = target_forbids(torch.where(valid_id, p_token, 0.0))
    verify_weight = torch.where(forbidden, torch.ones_like(weight), weight)
    nu_token = verify_weight * p_token + (1 - verify_weight) * q_token

    ratio = torch.where(q_token > 0, (nu_token / q_token).clamp(max=1.0), (nu_token > 0).float())
    accept_sampled = uniforms[:, :num_positions] * q_token.double() < nu_token.double()

    # Greedy rows compare against argmax nu over the target's support at every position (first index wins ties).
    nu_full = weight.unsqueeze(-1) * target[:, :num_positions] + (1 - weight).unsqueeze(-1) * draft
    nu_full = torch.where(target_forbids(target[:, :num_positions]), float("-inf"), nu_full)
    greedy_choice = nu_full.argmax(-1)
    accept_greedy = (draft_tokens == greedy_choice) & ~forbidden

    accepted = torch.where(greedy.unsqueeze(1), accept_greedy, accept_sampled) & valid
    accept_prob = torch.where(greedy.unsqueeze(1), accepted.float(), ratio) * valid
    if fly is not None:
        window, threshold, top_k = fly
        deferrable = valid & ~forbidden & (greedy.unsqueeze(1) | (q_token > 0))
        entropy = fly_entropy(target[:, :num_positions], top_k)
        accepted = accepted | fly_deferred(accepted, deferrable, entropy, window, threshold, num_draft)
    num_accepted = accepted.long().cumprod(1).sum(1)

    # The final token: residual at the first rejection, else the bonus from target row num_draft.
    rejected = num_accepted < num_draft
    draft_position = num_accepted.clamp(max=max(num_positions - 1, 0))
    p_row = target[rows, num_accepted]
    if num_positions > 0:
        q_row = draft[rows, draft_position]
        w_row = verify_weight[rows, draft_position]
        greedy_at_rejection = greedy_choice[rows, draft_position]
    else:
        q_row = torch.zeros_like(p_row)
        w_row = torch.ones(batch, device=p_row.device)
        greedy_at_rejection = torch.zeros(batch, dtype=torch.int64, device=p_row.device)
    residual = (p_row - q_row).clamp_min(0.0)
    use_residual = rejected & (w_row > 0) & (residual.sum(-1) > 0)
    mass = torch.where(use_residual.unsqueeze(1), residual, p_row)
    sampled = inverse_cdf_sample(mass, uniforms[:, num_positions])
    greedy_final = torch.where(rejected, greedy_at_rejection, p_row.argmax(-1))  # p_row is 0 off the support
    final = torch.where(greedy, greedy_final, sampled)

    tokens = torch.where(positions.unsqueeze(0) < num_accepted.unsqueeze(1), draft_tokens, -1)
    tokens = torch.cat([tokens, torch.full((batch, 1), -1, dtype=torch.int64, device=tokens.device)], dim=1)
    tokens = tokens.scatter(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return VerifyResult(tokens, num_accepted.to(torch.int32), accept_prob)


def _gathered(args: VerifyArgs) -> VerifyArgs:
    """Rows read through target_rows / draft_rows, gathered into [B, K+1, V] / [B, K, V] (clamped as the kernels
    clamp them)."""
    args.target = gather_rows(args.target, args.target_rows)
    args.draft = gather_rows(args.draft, args.draft_rows)
    args.target_rows = args.draft_rows = None
    return args


def _fly_of(args: VerifyArgs, fly: tuple, check_inputs: bool):
    """FLy's settings through their rules, as reference_core takes them (None when off)."""
    batch, num_positions = args.draft_tokens.shape
    return fly_tensors(fly_arguments(*fly, batch, num_positions, args.target.device, check_inputs), batch,
                       args.target.device)


def _reference_arguments(tensors: tuple, options: dict, names: tuple, fly: tuple):
    """A reference call's arguments through the ops' rules, rows gathered and every default materialised (uniforms
    drawn from the seeds when none are given), and FLy's settings: ``tensors`` (draft_tokens, draft, target, weight),
    ``options`` prepare_verify's keywords, ``names`` (draft name, target name, kind)."""
    draft_name, target_name, kind = names
    args = prepare_verify(*tensors, draft_name=draft_name, target_name=target_name, kind=kind, **options)
    args = _gathered(VerifyArgs(*args).materialized())
    fly_t = _fly_of(args, fly, options["check_inputs"])
    if args.uniforms is None:
        args.uniforms = philox_uniforms(args.seeds, args.offset, args.draft_tokens.shape[1] + 1, args.per_row_seed)
    args.uniforms = sanitized_uniforms(args.uniforms)
    return args, fly_t


def sanitized_uniforms(uniforms: torch.Tensor) -> torch.Tensor:
    """float64 uniforms clamped into [0, 1), NaN as 0: the kernels' rule (sanitize_uniform) for values only unchecked
    calls pass."""
    uniforms = uniforms.double()
    return torch.where(uniforms >= 0.0, uniforms, 0.0).clamp(max=LARGEST_UNIFORM)


def verify_reference(draft_tokens, draft_probs, target_probs, weight, *, num_draft=None, greedy=None, uniforms=None,
                     seed=None, offset=0, check_inputs=True, target_rows=None, draft_rows=None, fly_window=0,
                     fly_threshold=rules.FLY_DEFAULT_THRESHOLD, fly_top_k=rules.FLY_DEFAULT_TOP_K) -> VerifyResult:
    """Reference implementation of :func:`diversed_ext.verify` in plain PyTorch (same arguments, same result)."""
    args, fly = _reference_arguments(
        (draft_tokens, draft_probs, target_probs, weight), dict(num_draft=num_draft, greedy=greedy, uniforms=uniforms,
                                                               seed=seed, offset=offset, check_inputs=check_inputs,
                                                               target_rows=target_rows, draft_rows=draft_rows),
        ("draft_probs", "target_probs", "probabilities"), (fly_window, fly_threshold, fly_top_k))
    draft_probs = one_hot_drafts(args.draft_tokens, args.target.shape[-1]) if args.draft is None else args.draft
    return reference_core(args.draft_tokens, draft_probs, args.target, args.weight, args.num_draft, args.greedy,
                          args.uniforms, fly)


def _tempered_softmax(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """softmax(logits / T) per row in float32; T = 0 (greedy rows) uses T = 1. Rows without a finite logit -> 0."""
    effective = distribution_temperature(temperature)
    probs = (logits.float() / effective.view(-1, *([1] * (logits.dim() - 1)))).softmax(-1)
    return torch.nan_to_num(probs, nan=0.0)


def verify_logits_reference(draft_tokens, draft_logits, target_logits, weight, *, temperature=1.0, num_draft=None,
                            uniforms=None, seed=None, offset=0, check_inputs=True, target_rows=None, draft_rows=None,
                            target_temperature=None, fly_window=0, fly_threshold=rules.FLY_DEFAULT_THRESHOLD,
                            fly_top_k=rules.FLY_DEFAULT_TOP_K) -> VerifyResult:
    """Reference of :func:`diversed_ext.verify_logits`: softmax everything, then verify on probabilities (one-hot
    draft rows when ``draft_logits`` is None)."""
    args, fly = _reference_arguments(
        (draft_tokens, draft_logits, target_logits, weight), dict(num_draft=num_draft, greedy=None, uniforms=uniforms,
                                                                 seed=seed, offset=offset, check_inputs=check_inputs,
                                                                 target_rows=target_rows, draft_rows=draft_rows),
        ("draft_logits", "target_logits", "logits"), (fly_window, fly_threshold, fly_top_k))
    temperature_t = temperature_tensor(temperature, args.target.shape[0], args.target.device, check_inputs)
    target_temperature_t = temperature_t if target_temperature is None else temperature_tensor(
        target_temperature, args.target.shape[0], args.target.device, check_inputs, "target_temperature")
    if args.draft is None:
        draft_probs = one_hot_drafts(args.draft_tokens, args.target.shape[-1])
    else:
        draft_probs = _tempered_softmax(args.draft, temperature_t)
    return reference_core(args.draft_tokens, draft_probs, _tempered_softmax(args.target, target_temperature_t),
                          args.weight, args.num_draft, is_greedy_temperature(temperature_t), args.uniforms, fly)


def token_stats_reference(draft, target, tokens, *, from_logits=False, temperature=1.0, check_inputs=True):
    """Reference of :func:`diversed_ext.token_stats` (materialises the probabilities)."""
    batch, length, vocab, temperature_t = prepare_pair(draft, target, from_logits=from_logits,
                                                        temperature=temperature, check_inputs=check_inputs,
                                                        same_positions=True)
    tokens_t = normalize_stat_tokens(tokens, batch, length, vocab, draft.device, check_inputs).unsqueeze(-1)
    if from_logits:
        effective = distribution_temperature(temperature_t).view(-1, 1, 1)
        target_logprobs = (target.float() / effective).log_softmax(-1)
        draft_logprobs = (draft.float() / effective).log_softmax(-1)
        target_probs, draft_probs = target_logprobs.exp(), draft_logprobs.exp()
        target_logprob = target_logprobs.gather(-1, tokens_t).squeeze(-1)
        draft_logprob = draft_logprobs.gather(-1, tokens_t).squeeze(-1)
    else:
        target_probs, draft_probs = _sanitize_mass(target.float()), _sanitize_mass(draft.float())
        target_logprob = target_probs.gather(-1, tokens_t).squeeze(-1).log()
        draft_logprob = draft_probs.gather(-1, tokens_t).squeeze(-1).log()
    total_variation = 0.5 * (target_probs.double() - draft_probs.double()).abs().sum(-1)
    return TokenStats(target_probs.gather(-1, tokens_t).squeeze(-1), draft_probs.gather(-1, tokens_t).squeeze(-1),
                      total_variation.float(), target_logprob, draft_logprob)


def _log_and_mass(logits: torch.Tensor, effective: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / T) and its probabilities in float32. A row without a finite logit has no mass (the
    softmax's NaN counts as 0) and so no entropy (its log probabilities floored)."""
    log_probs = (logits.float() / effective).log_softmax(-1)
    return log_probs.nan_to_num(nan=LOG_FLOOR), log_probs.exp().nan_to_num(nan=0.0)


def distribution_features_reference(draft_logits, target_logits, *, temperature=1.0, target_temperature=None,
                                    target_rows=None, draft_rows=None, check_inputs=True):
    """Reference of :func:`diversed_ext.distribution_features` (gathers the rows read through an index, materialises
    the log-probabilities)."""
    args = prepare_features(draft_logits, target_logits, temperature=temperature,
                            target_temperature=target_temperature, target_rows=target_rows, draft_rows=draft_rows,
                            check_inputs=check_inputs)
    entropy_scale = 1.0 / math.log(args.vocab) if args.vocab > 1 else 0.0
    draft_effective = distribution_temperature(args.temperature).view(-1, 1, 1)
    target_effective = (draft_effective if args.target_temperature is None
                        else distribution_temperature(args.target_temperature).view(-1, 1, 1))
    draft_log, draft_probs = _log_and_mass(gather_rows(draft_logits, args.draft_rows), draft_effective)
    target_log, target_probs = _log_and_mass(gather_rows(target_logits, args.target_rows), target_effective)
    features = torch.stack([
        -(draft_probs * draft_log.clamp_min(LOG_FLOOR)).sum(-1) * entropy_scale,
        -(target_probs * target_log.clamp_min(LOG_FLOOR)).sum(-1) * entropy_scale,
        draft_probs.amax(-1), target_probs.amax(-1),
        0.5 * (target_probs.double() - draft_probs.double()).abs().sum(-1).float()], dim=-1)
    return features.nan_to_num(0.0).clamp(0.0, 1.0)


def mix_reference(draft, target, weight, *, from_logits=False, temperature=1.0, check_inputs=True) -> torch.Tensor:
    """Reference of :func:`diversed_ext.mix`."""
    batch, positions, _, temperature_t = prepare_pair(draft, target, from_logits=from_logits,
                                                       temperature=temperature, check_inputs=check_inputs,
                                                       same_positions=False)
    weight_t = _sanitize_weight(weight_tensor(weight, batch, positions, draft.device, check_inputs)).unsqueeze(-1)
    target = target[:, :positions]
    if from_logits:
        draft_probs, target_probs = _tempered_softmax(draft, temperature_t), _tempered_softmax(target, temperature_t)
    else:
        draft_probs, target_probs = _sanitize_mass(draft.float()), _sanitize_mass(target.float())
    return weight_t * target_probs + (1 - weight_t) * draft_probs


def mixture_divergence_reference(draft_logits, target_logits, *, temperature=1.0,
                                 grid_points=rules.DEFAULT_GRID_POINTS, log_floor=rules.DEFAULT_LOG_FLOOR,
                                 check_inputs=True) -> torch.Tensor:
    """Reference of :func:`diversed_ext.mixture_divergence` (torch ops over chunks of positions; float64 logits are
    computed in float64)."""
    grid_points, log_floor = rules.grid_points(grid_points), rules.log_floor(log_floor)
    _, _, _, temperature_t = prepare_pair(draft_logits, target_logits, from_logits=True, temperature=temperature,
                                          check_inputs=check_inputs, same_positions=True)
    return divergence_table(draft_logits, target_logits, temperature_t, grid_points, log_floor)
