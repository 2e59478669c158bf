"""The training objective: advantages, the stable mixture log-likelihood, gradients and the regulariser's sign."""

import math

import pytest
import torch

from diversed_ext.research.objective import (KL_GRID_POINTS, diversed_objective, interpolated_kl, log_mixture_prob,
                                             normalized_advantages)


def random_terms(num_sequences=4, length=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand(num_sequences, length, generator=generator, dtype=torch.float64) * 0.9 + 0.05
    target_logprob = -torch.rand(num_sequences, length, generator=generator, dtype=torch.float64) * 4
    draft_logprob = -torch.rand(num_sequences, length, generator=generator, dtype=torch.float64) * 4
    total_variation = torch.rand(num_sequences, length, generator=generator, dtype=torch.float64)
    rewards = torch.rand(num_sequences, generator=generator, dtype=torch.float64)
    mask = torch.rand(num_sequences, length, generator=generator) < 0.8
    return weights, target_logprob, draft_logprob, total_variation, rewards, mask


def test_advantages_are_normalised():
    advantages = normalized_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]))
    assert abs(advantages.mean().item()) < 1e-9
    assert abs(advantages.std(unbiased=False).item() - 1) < 1e-5
    assert torch.all(normalized_advantages(torch.tensor([2.0, 2.0, 2.0])) == 0)


def test_log_mixture_prob_matches_direct_formula_and_survives_underflow():
    weights = torch.tensor([0.2, 0.7], dtype=torch.float64)
    log_p, log_q = torch.tensor([-1.0, -2.0], dtype=torch.float64), torch.tensor([-3.0, -0.5], dtype=torch.float64)
    direct = (weights * log_p.exp() + (1 - weights) * log_q.exp()).log()
    torch.testing.assert_close(log_mixture_prob(weights, log_p, log_q), direct)
    tiny = log_mixture_prob(torch.tensor([0.5]), torch.tensor([-2000.0]), torch.tensor([-2001.0]))
    assert math.isfinite(tiny.item()) and abs(tiny.item() - (-2000.0 + math.log(0.5 + 0.5 * math.exp(-1)))) < 1e-3


@pytest.mark.parametrize("coef", [0.0, 0.3])
def test_gradient_matches_finite_differences(coef):
    weights, log_p, log_q, tv, rewards, mask = random_terms()
    weights.requires_grad_(True)
    terms = diversed_objective(weights, log_p, log_q, tv, rewards, mask, acceptance_coef=coef)
    (gradient,) = torch.autograd.grad(terms.loss, weights)
    step = 1e-6
    numeric = torch.zeros_like(weights)
    for index in range(weights.numel()):
        delta = torch.zeros_like(weights).view(-1)
        delta[index] = step
        delta = delta.view_as(weights)
        plus = diversed_objective(weights.detach() + delta, log_p, log_q, tv, rewards, mask, coef).loss
        minus = diversed_objective(weights.detach() - delta, log_p, log_q, tv, rewards, mask, coef).loss
        numeric.view(-1)[index] = (plus - minus) / (2 * step)
    torch.testing.assert_close(gradient, numeric, rtol=1e-5, atol=1e-7)
    assert torch.all(gradient[~mask] == 0)


def test_expected_fidelity_gradient_matches_finite_differences():
    weights, log_p, log_q, tv, rewards, mask = random_terms()
    gap = -torch.rand(weights.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 3
    gap[0, 0] = 0.7  # a position where mixing in the draft raises the expected fidelity

    def loss(values):
        return diversed_objective(values, log_p, log_q, tv, rewards, mask, 0.2, gap, expected_fidelity_coef=0.5).loss

    weights.requires_grad_(True)
    (gradient,) = torch.autograd.grad(loss(weights), weights)
    step = 1e-6
    numeric = torch.zeros_like(weights)
    for index in range(weights.numel()):
        delta = torch.zeros(weights.numel(), dtype=weights.dtype)
        delta[index] = step
        numeric.view(-1)[index] = (loss(weights.detach() + delta.view_as(weights))
                                   - loss(weights.detach() - delta.view_as(weights))) / (2 * step)
    torch.testing.assert_close(gradient, numeric, rtol=1e-5, atol=1e-7)
    # Alone (equal rewards, lambda = 0) the term's gradient is mu G / N: descent raises w where G < 0.
    alone = diversed_objective(weights, log_p, log_q, tv, torch.ones(4, dtype=torch.float64), mask, 0.0, gap, 0.5)
    (gradient,) = torch.autograd.grad(alone.loss, weights)
    torch.testing.assert_close(gradient, torch.where(mask, 0.5 * gap / 4, torch.zeros_like(gap)))
    assert gradient[0, 0] > 0 and torch.all(gradient[mask & (gap < 0)] < 0)


def test_regulariser_pushes_weights_down_where_models_disagree():
    # Equal rewards: no policy signal, only the acceptance term; its gradient must lower w (more acceptance).
    weights, log_p, log_q, tv, _, _ = random_terms()
    weights.requires_grad_(True)
    terms = diversed_objective(weights, log_p, log_q, tv, torch.ones(4, dtype=torch.float64), acceptance_coef=1.0)
    (gradient,) = torch.autograd.grad(terms.loss, weights)
    torch.testing.assert_close(gradient, tv / 4)  # d/dw of -(1/N) sum (1 - w TV) = TV / N > 0: descent lowers w
    assert terms.expected_acceptance.item() > 0


def test_policy_term_follows_the_better_sequence():
    # Sequence 0 (rewarded) has tokens the target likes; descent must raise w on it.
    weights = torch.full((2, 3), 0.5, dtype=torch.float64, requires_grad=True)
    log_p = torch.log(torch.tensor([[0.9] * 3, [0.1] * 3], dtype=torch.float64))
    log_q = torch.log(torch.tensor([[0.1] * 3, [0.9] * 3], dtype=torch.float64))
    terms = diversed_objective(weights, log_p, log_q, torch.zeros(2, 3, dtype=torch.float64),
                               torch.tensor([1.0, 0.0], dtype=torch.float64), acceptance_coef=0.0)
    (gradient,) = torch.autograd.grad(terms.loss, weights)
    assert torch.all(gradient[0] < 0)  # descent raises w where target-favoured tokens were rewarded
    assert torch.all(gradient[1] < 0)  # and where draft-favoured tokens were penalised


def test_bad_arguments():
    weights, log_p, log_q, tv, rewards, mask = random_terms()
    with pytest.raises(ValueError, match="acceptance_coef"):
        diversed_objective(weights, log_p, log_q, tv, rewards, mask, acceptance_coef=-0.1)
    with pytest.raises(ValueError, match="total_variation"):
        diversed_objective(weights, log_p, log_q, tv[:, :2], rewards, mask)
    with pytest.raises(ValueError, match="rewards"):
        diversed_objective(weights, log_p, log_q, tv, rewards[:2], mask)
    with pytest.raises(ValueError, match="expected_fidelity_coef"):
        diversed_objective(weights, log_p, log_q, tv, rewards, mask, 0.1, tv, expected_fidelity_coef=-1.0)
    with pytest.raises(ValueError, match="needs fidelity_gap"):
        diversed_objective(weights, log_p, log_q, tv, rewards, mask, 0.1, None, expected_fidelity_coef=1.0)
    with pytest.raises(ValueError, match="fidelity_gap must have"):
        diversed_objective(weights, log_p, log_q, tv, rewards, mask, 0.1, tv[:, :2], expected_fidelity_coef=1.0)
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        normalized_advantages(torch.ones(2, 2))


def test_logistic_surrogate_has_the_linear_minimiser_and_live_gradients():
    generator = torch.Generator().manual_seed(5)
    total_variation = torch.rand(3, 8, generator=generator, dtype=torch.float64)
    gap = -3 * torch.rand(3, 8, generator=generator, dtype=torch.float64)
    mask = torch.ones(3, 8, dtype=torch.bool)
    zeros, rewards = torch.zeros(3, 8, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    slope = 2.0 * total_variation + gap
    # A head saturated on the wrong side of every token: the linear terms' gradient has all but vanished there ...
    logits = torch.where(slope < 0, -12.0, 12.0).to(torch.float64).requires_grad_(True)

    def gradient(closed_form):
        logits.grad = None
        weights = torch.sigmoid(logits)
        diversed_objective(weights, zeros, zeros, total_variation, rewards, mask, 2.0, gap, 1.0,
                           closed_form=closed_form).loss.backward()
        return logits.grad.clone()

    assert gradient("linear").abs().max() < 1e-4
    surrogate = gradient("logistic")  # ... the surrogate's is |c| (w - y): it points every token the right way
    torch.testing.assert_close(surrogate, slope.abs() * (torch.sigmoid(logits.detach()) - (slope < 0).double()) / 3)
    assert torch.all(torch.sign(surrogate) == torch.sign(slope))
    # Its minimiser is the linear one: w = 1 exactly where lambda TV + mu G < 0.
    best = torch.where(slope < 0, 1.0 - 1e-6, 1e-6).to(torch.float64)
    values = [diversed_objective(candidate, zeros, zeros, total_variation, rewards, mask, 2.0, gap, 1.0,
                                 closed_form="logistic").loss.item()
              for candidate in (best, torch.full_like(best, 0.5), 1.0 - best)]
    assert values[0] < values[1] < values[2]
    with pytest.raises(ValueError, match="closed_form"):
        diversed_objective(best, zeros, zeros, total_variation, rewards, mask, closed_form="square")


def kl_table_of(curvature: torch.Tensor) -> torch.Tensor:
    """KL(nu_w || p) shaped as near its minimum, c (1 - w)^2, on the objective's grid."""
    return curvature.unsqueeze(-1) * (1 - torch.linspace(0, 1, KL_GRID_POINTS, dtype=torch.float64)) ** 2


def test_interpolated_kl_reads_the_table_linearly_between_grid_points():
    table = torch.arange(KL_GRID_POINTS, dtype=torch.float64).pow(2).expand(2, KL_GRID_POINTS).clone()
    step = 1 / (KL_GRID_POINTS - 1)
    weights = torch.tensor([[0.0, 1.0], [2.5 * step, -0.3]], dtype=torch.float64).requires_grad_(True)
    values = interpolated_kl(weights, table.unsqueeze(0).expand(2, 2, KL_GRID_POINTS))
    # grid points exactly; halfway between 2 and 3 the mean of 4 and 9; below 0 the first entry
    torch.testing.assert_close(values.detach(), torch.tensor([[0.0, (KL_GRID_POINTS - 1) ** 2], [6.5, 0.0]],
                                                             dtype=torch.float64))
    values.sum().backward()
    assert weights.grad[1, 0].item() == pytest.approx((9 - 4) / step)  # the segment's slope
    assert weights.grad[1, 1].item() == 0.0  # clamped: no gradient outside [0, 1]
    with pytest.raises(ValueError, match="kl_table"):
        interpolated_kl(weights, table)


def test_kl_term_gradient_and_its_minimiser():
    weights, log_p, log_q, tv, rewards, mask = random_terms(seed=3)
    curvature = torch.rand(weights.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64) + 0.5
    table = kl_table_of(curvature)

    def loss(values):
        return diversed_objective(values, log_p, log_q, tv, rewards, mask, 0.3, kl_table=table,
                                  expected_kl_coef=2.0).loss

    point = weights.clone().requires_grad_(True)
    loss(point).backward()
    delta = 1e-6
    for index in [(0, 0), (1, 2), (3, 5)]:
        if not mask[index]:
            continue
        plus, minus = weights.clone(), weights.clone()
        plus[index] += delta
        minus[index] -= delta
        numeric = (loss(plus) - loss(minus)).item() / (2 * delta)
        assert point.grad[index].item() == pytest.approx(numeric, rel=1e-3, abs=1e-6)
    terms = diversed_objective(weights, log_p, log_q, tv, rewards, mask, 0.3, kl_table=table, expected_kl_coef=2.0)
    total = (interpolated_kl(weights, table) * mask).sum().item()
    assert terms.expected_kl.item() == pytest.approx(total / mask.sum().item())
    assert terms.expected_kl_term.item() == pytest.approx(2.0 * total / 4)  # kappa x the sum per sequence
    # Acceptance against KL alone: the best weight of each token is 1 - lambda TV / (2 kappa c), inside (0, 1).
    zeros = torch.zeros_like(weights)
    best = (1 - 0.3 * tv / (2 * 2.0 * curvature)).clamp(0, 1)
    candidates = [best, (best + 0.1).clamp(max=1), (best - 0.1).clamp(min=0)]
    values = [diversed_objective(candidate, zeros, zeros, tv, torch.zeros(4, dtype=torch.float64), mask, 0.3,
                                 kl_table=table, expected_kl_coef=2.0).loss.item() for candidate in candidates]
    assert values[0] < min(values[1:]) + 1e-3


def test_kl_term_needs_its_table_and_the_linear_closed_form():
    weights, log_p, log_q, tv, rewards, mask = random_terms()
    table = kl_table_of(torch.ones_like(weights))
    with pytest.raises(ValueError, match="needs kl_table"):
        diversed_objective(weights, log_p, log_q, tv, rewards, mask, expected_kl_coef=1.0)
    with pytest.raises(ValueError, match="closed_form='linear'"):
        diversed_objective(weights, log_p, log_q, tv, rewards, mask, 0.1, tv, 1.0, "logistic", table, 1.0)
    with pytest.raises(ValueError, match="expected_kl_coef must be >= 0"):
        diversed_objective(weights, log_p, log_q, tv, rewards, mask, kl_table=table, expected_kl_coef=-1.0)
    off = diversed_objective(weights, log_p, log_q, tv, rewards, mask, 0.1)
    assert off.expected_kl_term.item() == 0.0 and math.isnan(off.expected_kl.item())
