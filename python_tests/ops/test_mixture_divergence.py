"""mixture_divergence: the fused op against KL(nu_w || p) written out in float64 and against its PyTorch reference,
its grid (w = 0 is KL(q || p), w = 1 gives 0, monotone between), the floor on log p, the edges (V = 1, q = p, T = 0,
rows ruled out entirely), its registration (opcheck) and its argument errors.

Tests that take `device` run on the CPU and on CUDA (skipped where no GPU is visible; there the op runs as torch ops);
the builds' bitwise agreement is in test_logits.py."""

import math

import pytest
import torch

import diversed_ext as dx
from helpers import DTYPES, on_device, ruled_out_logits

FLOOR = -100.0


def expected_table(draft_logits, target_logits, temperature, grid_points=17, log_floor=FLOOR):
    """KL(nu_w || p) = sum_v nu_w (log nu_w - max(log p, floor)) at w = g / (G - 1), in float64, written out, and at
    least 0 (a draft row without mass leaves nu_w with mass w, whose sum is w log w); temperature [B] (0 counts as
    1)."""
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).double().view(-1, 1, 1)
    q = (draft_logits.double() / scale).softmax(-1).nan_to_num(nan=0.0)
    target_log = (target_logits.double() / scale).log_softmax(-1)
    p = target_log.exp().nan_to_num(nan=0.0)
    log_p = target_log.nan_to_num(nan=log_floor).clamp_min(log_floor)
    columns = []
    for point in range(grid_points):
        weight = point / (grid_points - 1)
        nu = weight * p + (1 - weight) * q
        terms = torch.where(nu > 0, nu * (nu.clamp_min(1e-300).log() - log_p), torch.zeros_like(nu))
        columns.append(terms.sum(-1).clamp_min(0.0))
    return torch.stack(columns, dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 2, 7, 129, 4099, 49152])
def test_matches_float64_and_reference(device, dtype, vocab):
    """A quarter of every row ruled out (-inf), so the draft puts mass where the target has none and the floor counts;
    V = 4099 leaves a tail after the last group of lanes and spans several blocks; 49152 is SmolLM2's."""
    draft, target, temperature = ruled_out_logits(4, 3, vocab, dtype, seed=vocab)
    table = on_device(device, dx.mixture_divergence, draft, target, temperature=temperature)
    assert table.shape == (4, 3, 17) and table.dtype == torch.float32
    expected = expected_table(draft, target, temperature)
    torch.testing.assert_close(table.double(), expected, atol=2e-5, rtol=2e-6)
    reference = dx.mixture_divergence_reference(draft, target, temperature=temperature)
    torch.testing.assert_close(table, reference, atol=5e-5, rtol=1e-5)
    if vocab > 1:
        assert float(expected[..., 0].max()) > 10.0  # mass on ruled-out tokens costs: the check is not of zeros


@pytest.mark.parametrize("grid_points", [2, 5, 17, 33])
def test_grid_ends_and_monotone(device, grid_points):
    """Column 0 is KL(q || p), the last 0 (nu = p); convex with its minimum at w = 1, so non-increasing along w."""
    generator = torch.Generator().manual_seed(grid_points)
    draft, target = (torch.randn(2, 5, 300, generator=generator) * 2 for _ in range(2))
    table = on_device(device, dx.mixture_divergence, draft, target, grid_points=grid_points)
    assert table.shape == (2, 5, grid_points)
    q, log_p = draft.double().softmax(-1), target.double().log_softmax(-1)
    forward_kl = (q * (q.log() - log_p)).sum(-1)
    torch.testing.assert_close(table[..., 0].double(), forward_kl, atol=1e-5, rtol=1e-5)
    assert float(table[..., -1].abs().max()) < 1e-6
    assert float(table.diff(dim=-1).max()) < 1e-6
    torch.testing.assert_close(table.double(), expected_table(draft, target, torch.ones(2), grid_points), atol=1e-5,
                               rtol=1e-5)


def test_floor_bounds_a_ruled_out_target(device):
    """A target that rules out the draft's only token: log p there is the floor, so KL(nu_w || p) = (1 - w)(log(1 - w)
    - floor) rather than infinity; a lower floor costs more."""
    draft = torch.tensor([[[5.0, float("-inf"), float("-inf")]]])
    target = torch.tensor([[[float("-inf"), 0.0, 0.0]]])
    for floor in (-100.0, -20.0):
        table = on_device(device, dx.mixture_divergence, draft, target, grid_points=5, log_floor=floor)[0, 0]
        expected = []
        for point in range(5):
            weight = point / 4
            nu = torch.tensor([1 - weight, weight / 2, weight / 2], dtype=torch.float64)
            log_p = torch.tensor([floor, math.log(0.5), math.log(0.5)], dtype=torch.float64)
            expected.append(float(torch.where(nu > 0, nu * (nu.clamp_min(1e-300).log() - log_p), 0.0).sum()))
        torch.testing.assert_close(table.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-4, rtol=1e-6)
        assert abs(float(table[0]) + floor) < 1e-4  # w = 0: all of q on the ruled-out token, at -floor nats


def test_edges(device):
    logits = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(0))
    same = on_device(device, dx.mixture_divergence, logits, logits.clone())
    assert float(same.abs().max()) < 1e-6  # q = p: mixing costs nothing
    single = on_device(device, dx.mixture_divergence, torch.zeros(2, 3, 1), torch.ones(2, 3, 1))  # V = 1
    assert torch.equal(single, torch.zeros(2, 3, 17))
    assert on_device(device, dx.mixture_divergence, logits[:, :0], logits[:, :0]).shape == (2, 0, 17)
    assert on_device(device, dx.mixture_divergence, logits[:0], logits[:0], grid_points=3).shape == (0, 3, 3)


def test_rows_without_a_finite_logit_unchecked(device):
    """Only check_inputs=False lets such rows through: a target without mass has log p at the floor everywhere, a
    draft without mass mixes in nothing; the table stays finite and >= 0 and equals the written-out sums."""
    ruled_out = torch.full((6,), float("-inf"))
    uniform = torch.zeros(6)
    draft = torch.stack([uniform, ruled_out, ruled_out]).unsqueeze(0)
    target = torch.stack([ruled_out, uniform, ruled_out]).unsqueeze(0)
    table = on_device(device, dx.mixture_divergence, draft, target, check_inputs=False)
    torch.testing.assert_close(table.double(), expected_table(draft, target, torch.ones(1)), atol=1e-5, rtol=1e-6)
    with pytest.raises(ValueError, match="draft has a row whose logits are all -inf"):
        dx.mixture_divergence(draft, target)
    with pytest.raises(ValueError, match="target has a row whose logits are all -inf"):
        dx.mixture_divergence(torch.zeros(1, 3, 6), target)


def test_temperature(device):
    draft, target, _ = ruled_out_logits(3, 2, 33, torch.float32, seed=1)
    with_float = on_device(device, dx.mixture_divergence, draft, target, temperature=0.6)
    with_tensor = on_device(device, dx.mixture_divergence, draft, target, temperature=torch.full((3,), 0.6))
    assert torch.equal(with_float, with_tensor)
    greedy = on_device(device, dx.mixture_divergence, draft, target, temperature=0.0)  # 0 counts as 1
    assert torch.equal(greedy, on_device(device, dx.mixture_divergence, draft, target))
    torch.testing.assert_close(with_float.double(), expected_table(draft, target, torch.full((3,), 0.6)), atol=2e-5,
                               rtol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_opcheck(dtype):
    draft, target, temperature = ruled_out_logits(4, 3, 40, dtype, seed=5)
    torch.library.opcheck(torch.ops.diversed.mixture_divergence.default, (draft, target, temperature, 9, -50.0))


@pytest.mark.parametrize("options, error, match", [
    ({"grid_points": 1}, ValueError, r"grid_points must lie in \[2, 1025\], got 1"),
    ({"grid_points": 1026}, ValueError, r"grid_points must lie in \[2, 1025\]"),
    ({"grid_points": 2.5}, TypeError, "grid_points must be an int in"),
    ({"grid_points": True}, TypeError, "grid_points must be an int in"),
    ({"log_floor": float("nan")}, ValueError, "log_floor must be a finite number of nats"),
    ({"log_floor": float("-inf")}, ValueError, "log_floor must be a finite number of nats"),
    ({"log_floor": "low"}, TypeError, "log_floor must be a finite number of nats"),
    ({"temperature": -1.0}, ValueError, "temperature"),
])
def test_argument_errors(options, error, match):
    logits = torch.zeros(1, 2, 5)
    with pytest.raises(error, match=match):
        dx.mixture_divergence(logits, logits, **options)


def test_layout_and_value_errors():
    logits = torch.zeros(1, 2, 5)
    with pytest.raises(ValueError, match="same number of positions"):
        dx.mixture_divergence(logits, torch.zeros(1, 3, 5))
    with pytest.raises(ValueError, match="target"):
        dx.mixture_divergence(logits, torch.zeros(1, 2, 6))
    with pytest.raises(ValueError, match="draft"):
        dx.mixture_divergence(torch.full((1, 2, 5), float("nan")), logits)
    with pytest.raises(RuntimeError, match="grid_points must lie in"):  # the op's own check, called directly
        torch.ops.diversed.mixture_divergence(logits, logits, torch.ones(1), 1, -100.0)
    with pytest.raises(RuntimeError, match="log_floor must be finite"):
        torch.ops.diversed.mixture_divergence(logits, logits, torch.ones(1), 17, float("inf"))
