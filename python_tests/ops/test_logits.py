"""verify_logits, token_stats and mix: native against the references, statistics, edges and bad inputs.

Tests that take `device` run on the CPU and on CUDA (skipped where no GPU is visible); the opchecks of these ops are
in test_verify_api.py::test_opcheck."""

import pytest
import torch
from scipy.stats import chisquare

import diversed_ext as dx
from helpers import (DTYPES, assert_verify_close, cpu_builds_here, logits_verify_case, on_device,
                     poisoned_logits_inputs, random_logits, token_stats_edge_inputs, use_cpu_build)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 33, 1000, 8195])
@pytest.mark.parametrize("num_positions", [0, 1, 4])
def test_verify_logits_matches_reference(dtype, vocab, num_positions):
    tokens, draft, target, weight, kwargs = logits_verify_case(num_positions, vocab, dtype)
    assert_verify_close(dx.verify_logits(tokens, draft, target, weight, **kwargs),
                        dx.verify_logits_reference(tokens, draft, target, weight, **kwargs))


def test_verify_logits_equals_verify_on_softmax():
    tokens, draft, target = random_logits(8, 3, 300, seed=2)
    for temperature in (0.5, 1.0, 2.0):
        with_logits = dx.verify_logits(tokens, draft, target, 0.6, temperature=temperature, seed=4, offset=1)
        with_probs = dx.verify(tokens, (draft / temperature).softmax(-1), (target / temperature).softmax(-1), 0.6,
                               seed=4, offset=1)
        assert torch.equal(with_logits.tokens, with_probs.tokens)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_verify_logits_samples_the_mixture(temperature):
    vocab, samples, weight = 8, 40_000, 0.4
    generator = torch.Generator().manual_seed(int(temperature * 10))
    draft_logits = torch.randn(vocab, generator=generator) * 1.5
    target_logits = torch.randn(vocab, generator=generator) * 1.5
    draft = (draft_logits / temperature).softmax(-1)
    target = (target_logits / temperature).softmax(-1)
    tokens = torch.multinomial(draft, samples, replacement=True, generator=generator).reshape(-1, 1)
    result = dx.verify_logits(tokens, draft_logits.expand(samples, 1, vocab).contiguous(),
                              target_logits.expand(samples, 2, vocab).contiguous(), weight, temperature=temperature,
                              seed=5)
    counts = torch.bincount(result.tokens[:, 0], minlength=vocab).double()
    mixture = (weight * target + (1 - weight) * draft).double()
    assert chisquare(counts.numpy(), (mixture / mixture.sum() * samples).numpy()).pvalue > 1e-4


def test_greedy_rows_from_zero_temperature():
    tokens, draft, target = random_logits(4, 3, 50, seed=6)
    greedy_tokens = (0.5 * target[:, :3].softmax(-1) + 0.5 * draft.softmax(-1)).argmax(-1)
    result = dx.verify_logits(greedy_tokens, draft, target, 0.5, temperature=0.0)
    assert torch.all(result.num_accepted == 3)
    assert torch.equal(result.tokens[:, 3], target[:, 3].argmax(-1))


def test_masked_and_huge_logits():
    tokens, draft, target = random_logits(6, 3, 500, seed=7, scale=1e4)
    draft[:, :, 400:] = float("-inf")
    target[:, :, 450:] = float("-inf")
    tokens = tokens.clamp(max=399)
    draft[0, 0, tokens[0, 0]] = 1e4  # make sure the drafted tokens are not masked out
    uniforms = torch.rand(6, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    native = dx.verify_logits(tokens, draft, target, 0.5, uniforms=uniforms)
    reference = dx.verify_logits_reference(tokens, draft, target, 0.5, uniforms=uniforms)
    assert_verify_close(native, reference)
    emitted = native.tokens[native.tokens >= 0]
    assert torch.all(emitted < 450)


@pytest.mark.parametrize("from_logits", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_token_stats_against_float64(from_logits, dtype):
    batch, length, vocab = 3, 17, 1003
    generator = torch.Generator().manual_seed(8)
    draft = (torch.randn(batch, length, vocab, generator=generator) * 2).to(dtype)
    target = (torch.randn(batch, length, vocab, generator=generator) * 2).to(dtype)
    if not from_logits:
        draft, target = draft.float().softmax(-1).to(dtype), target.float().softmax(-1).to(dtype)
    tokens = torch.randint(0, vocab, (batch, length), generator=generator)
    temperature = torch.tensor([1.0, 0.7, 0.0])
    stats = dx.token_stats(draft, target, tokens, from_logits=from_logits, temperature=temperature)
    effective = torch.tensor([1.0, 0.7, 1.0], dtype=torch.float64).view(-1, 1, 1)
    if from_logits:
        p64, q64 = (target.double() / effective).softmax(-1), (draft.double() / effective).softmax(-1)
    else:
        p64, q64 = target.double(), draft.double()
    index = tokens.unsqueeze(-1)
    torch.testing.assert_close(stats.target_prob.double(), p64.gather(-1, index).squeeze(-1), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(stats.draft_prob.double(), q64.gather(-1, index).squeeze(-1), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(stats.total_variation.double(), 0.5 * (p64 - q64).abs().sum(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats.target_logprob.double(), p64.gather(-1, index).squeeze(-1).log(), rtol=1e-5,
                               atol=1e-5)
    reference = dx.token_stats_reference(draft, target, tokens, from_logits=from_logits, temperature=temperature)
    for native_field, reference_field in zip(stats, reference):
        torch.testing.assert_close(native_field, reference_field, rtol=1e-5, atol=1e-6)



def online_softmax_rows(vocab):
    """Rows whose running max changes between the kernel's 2048-element blocks in every way the online softmax meets."""
    ramp = torch.linspace(-60.0, 60.0, vocab)
    masked_start = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    masked_start[: vocab // 2] = float("-inf")  # whole leading blocks without a finite logit
    late_spike = torch.randn(vocab, generator=torch.Generator().manual_seed(4))
    late_spike[-3] = 1e4  # the max sits in the last, partial block and dwarfs everything before it
    huge_flat = torch.full((vocab,), 1e4)
    huge_flat[::7] = -1e4
    return torch.stack([ramp, ramp.flip(0), masked_start, late_spike, huge_flat])


@pytest.mark.parametrize("vocab", [5000, 8195])
def test_online_softmax_across_blocks(vocab):
    target = online_softmax_rows(vocab).unsqueeze(0)  # [1, 5, V]
    draft = target.roll(1, dims=1)
    tokens = torch.tensor([[vocab - 1, 0, vocab - 2, vocab - 3, 1]])
    stats = dx.token_stats(draft, target, tokens, from_logits=True)
    p64, q64 = target.double().softmax(-1), draft.double().softmax(-1)
    index = tokens.unsqueeze(-1)
    torch.testing.assert_close(stats.target_prob.double(), p64.gather(-1, index).squeeze(-1), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(stats.total_variation.double(), 0.5 * (p64 - q64).abs().sum(-1), rtol=1e-5, atol=1e-6)
    uniforms = torch.rand(1, 5, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    native = dx.verify_logits(tokens[:, :4], draft[:, :4], target, 0.3, uniforms=uniforms)
    assert_verify_close(native, dx.verify_logits_reference(tokens[:, :4], draft[:, :4], target, 0.3, uniforms=uniforms))


def test_token_stats_edges(device):
    draft, target, tokens = token_stats_edge_inputs()
    underflow_logprob = -300.0 - torch.logsumexp(target[0, 0], -1).item()
    # The log-probability survives underflow, with the checks on (position 0 alone) and off.
    stats = on_device(device, dx.token_stats, draft[:, :1], target[:, :1], tokens[:, :1], from_logits=True)
    assert stats.target_prob.item() == 0.0
    assert abs(stats.target_logprob.item() - underflow_logprob) < 1e-3
    stats = on_device(device, dx.token_stats, draft, target, tokens, from_logits=True, check_inputs=False)
    assert stats.target_prob[0, 0].item() == 0.0
    assert abs(stats.target_logprob[0, 0].item() - underflow_logprob) < 1e-3
    # A row of -inf logits has no mass: probability 0, log-probability -inf.
    assert stats.target_prob[0, 1].item() == 0.0 and stats.target_logprob[0, 1].item() == float("-inf")


@pytest.mark.parametrize("from_logits", [False, True])
def test_mix_matches_reference(from_logits):
    tokens, draft, target = random_logits(3, 4, 777, seed=9)
    if not from_logits:
        draft, target = draft.softmax(-1), target.softmax(-1)
    weight = torch.rand(3, 4, generator=torch.Generator().manual_seed(2))
    mixed = dx.mix(draft, target, weight, from_logits=from_logits, temperature=0.8)
    reference = dx.mix_reference(draft, target, weight, from_logits=from_logits, temperature=0.8)
    torch.testing.assert_close(mixed, reference, rtol=2e-5, atol=1e-7)
    torch.testing.assert_close(mixed.sum(-1), torch.ones(3, 4), rtol=1e-5, atol=1e-5)


def test_torch_compile_fullgraph_traces_verify_logits():
    tokens, draft, target = random_logits(3, 2, 40, seed=1)

    def step(tokens, draft, target):
        return dx.verify_logits(tokens, draft, target, 0.5, temperature=0.7, seed=3, check_inputs=False)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(tokens, draft, target).tokens, step(tokens, draft, target).tokens)


def test_poisoned_logits_without_checks_stay_in_range(device):
    for bad_temperatures_and_num_draft in (False, True):
        tokens, draft, target, generator = poisoned_logits_inputs()
        temperature = torch.rand(32, generator=generator)
        kwargs = {}
        if bad_temperatures_and_num_draft:
            temperature[1] = float("nan")  # greedy, like 0
            temperature[2] = -1.0
            kwargs["num_draft"] = torch.randint(-2, 7, (32,), generator=generator)
        result = on_device(device, dx.verify_logits, tokens, draft, target, 0.5, temperature=temperature,
                           check_inputs=False, seed=1, **kwargs)
        emitted = torch.arange(5) <= result.num_accepted.unsqueeze(1).long()
        assert torch.all((result.tokens[emitted] >= 0) & (result.tokens[emitted] < 37))
        assert torch.all(result.tokens[~emitted] == -1)


def bad_logit_cases():
    tokens, draft, target = random_logits(2, 2, 9)
    nan_draft = draft.clone()
    nan_draft[0, 0, 0] = float("nan")
    masked = target.clone()
    masked[1, 2] = float("-inf")
    return {
        "NaN logits": (lambda: dx.verify_logits(tokens, nan_draft, target, 0.5), ValueError, "draft_logits.*NaN"),
        "+inf logits": (lambda: dx.verify_logits(tokens, draft, target.clone().fill_(float("inf")), 0.5), ValueError,
                        "target_logits.*inf"),
        "all masked row": (lambda: dx.verify_logits(tokens, draft, masked, 0.5), ValueError, "target_logits.*-inf"),
        "negative temperature": (lambda: dx.verify_logits(tokens, draft, target, 0.5, temperature=-1.0), ValueError,
                                 "temperature"),
        "NaN temperature": (lambda: dx.verify_logits(tokens, draft, target, 0.5, temperature=torch.tensor(
            [float("nan"), 1.0])), ValueError, "temperature"),
        "temperature shape": (lambda: dx.verify_logits(tokens, draft, target, 0.5, temperature=torch.ones(3)),
                              ValueError, "temperature"),
        "integer logits": (lambda: dx.verify_logits(tokens, draft.long(), target.long(), 0.5), TypeError,
                           "draft_logits"),
        "stats tokens out of range": (lambda: dx.token_stats(draft, target[:, :2], tokens + 9, from_logits=True), ValueError, "tokens"),
        "stats position mismatch": (lambda: dx.token_stats(draft, target, tokens), ValueError, "target"),
        "mix weight": (lambda: dx.mix(draft.softmax(-1), target.softmax(-1), 2.0), ValueError, "weight"),
        "mix negative probs": (lambda: dx.mix(draft, target, 0.5), ValueError, "negative"),
    }


@pytest.mark.parametrize("case", list(bad_logit_cases()))
def test_bad_logit_inputs(case):
    call, error, pattern = bad_logit_cases()[case]
    with pytest.raises(error, match=pattern):
        call()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [4099, 70_001])
def test_cpu_builds_agree_bit_for_bit(dtype, vocab, monkeypatch):
    """The baseline, AVX2 and AVX-512 builds of the CPU kernels perform the same operations in the same order (a
    build the CPU lacks falls back to the widest it has). V = 4099 leaves a tail after the last group of lanes; one
    request of V = 70001 goes by vocabulary chunks."""
    batch = 5 if vocab < 10_000 else 1
    tokens, draft, target = random_logits(batch, 3, vocab, seed=12, dtype=dtype)
    weight = torch.rand(batch, 3, generator=torch.Generator().manual_seed(1))
    rows = torch.arange(batch * 3).reshape(batch, 3).flip(1).contiguous()

    def run_all():
        return (dx.verify_logits(tokens, draft, target, weight, temperature=0.8, seed=2),
                dx.verify(tokens, draft.float().softmax(-1).to(dtype), target.float().softmax(-1).to(dtype), weight,
                          seed=2),
                dx.token_stats(draft, target[:, :3], tokens, from_logits=True),
                dx.mix(draft, target, weight, from_logits=True),
                dx.distribution_features(draft, target[:, :3], temperature=0.8),
                dx.mixture_divergence(draft, target[:, :3], temperature=0.8),
                dx.distribution_features(draft.reshape(-1, vocab), target[:, :3].float(), temperature=0.8,
                                         target_temperature=1.3, draft_rows=rows),
                dx.ops.gate_statistics(tokens, target.reshape(-1, vocab), draft, temperature=0.8,
                                       target_rows=rows + rows // 3),
                dx.ops.gate_statistics(tokens, target[:, :3], temperature=0.8))

    results = {}
    for capability in cpu_builds_here(monkeypatch):
        use_cpu_build(monkeypatch, capability)
        results[capability] = run_all()
    for capability in list(results)[1:]:
        for base_result, result in zip(results["baseline"], results[capability]):
            base_fields = base_result if isinstance(base_result, tuple) else (base_result,)
            fields = result if isinstance(result, tuple) else (result,)
            for base_field, field in zip(base_fields, fields):
                assert torch.equal(base_field, field), capability


def extreme_logit_rows(vocab=4099):
    """Two rows of logits whose shifted values (logit - row max) cover [-120, 0]: densely around exp's underflow
    threshold (about -87.34, below which the kernels flush to 0) and the float32 subnormal range, with -inf entries."""
    generator = torch.Generator().manual_seed(5)
    spread = torch.linspace(-120.0, 0.0, vocab)
    near_underflow = -87.33654 + torch.linspace(-0.05, 0.05, 257)
    rows = []
    for offset in (0.0, 31.5):
        row = spread[torch.randperm(vocab, generator=generator)].clone()
        row[:257] = near_underflow
        row[300:310] = float("-inf")
        row[400] = 0.0  # the row's max
        rows.append(row + offset)
    return torch.stack(rows).unsqueeze(0)  # [1, 2, V]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_cpu_builds_agree_on_every_exp(temperature, monkeypatch):
    """mix from logits writes every softmax probability, so it shows each exp the vector loops take: every build gives
    the same bits over the whole range of shifted logits, and each value is within 1e-6 of float64's softmax of the same
    scaled logits (exactly 0 where both shifted logits lie below the underflow threshold)."""
    logits = extreme_logit_rows()
    draft, target = logits[:, :1], logits[:, 1:]
    weight = torch.full((1, 1), 0.375)
    results = {}
    for capability in cpu_builds_here(monkeypatch):
        use_cpu_build(monkeypatch, capability)
        results[capability] = dx.mix(draft, target, weight, from_logits=True, temperature=temperature)
    for capability in list(results)[1:]:
        assert torch.equal(results["baseline"], results[capability]), capability
    scaled = logits * torch.tensor(1.0 / temperature, dtype=torch.float32)  # times float32 1/T, as the kernels do
    expected_probs = scaled.double().softmax(-1)
    expected = 0.375 * expected_probs[:, 1:2] + 0.625 * expected_probs[:, :1]
    shifted = scaled - scaled.amax(-1, keepdim=True)
    flushed = (shifted[:, :1] < -87.33654) & (shifted[:, 1:2] < -87.33654)
    mixture = results["baseline"].double()
    assert torch.all(mixture[flushed] == 0.0)
    kept = ~flushed & (expected > 1e-30)
    # At temperature 1 the shifted logits are exact; otherwise s - max rounds in float32 (up to 4e-6 at |s| ~ 100).
    tolerance = 1e-6 if temperature == 1.0 else 1e-5
    assert torch.allclose(mixture[kept], expected[kept], rtol=tolerance, atol=0.0)
    assert kept.sum() > 1000 and flushed.sum() > 300


@pytest.mark.parametrize("batch,vocab", [(6, 4099), (1, 70_001)])
def test_verify_logits_equals_verify_on_the_kernels_own_probabilities(batch, vocab):
    """At temperature 1, verify_logits gives bit for bit what verify gives on the probabilities the logits kernels
    themselves compute (mix with w = 1 writes p exactly): the residual and bonus passes' shortcuts for rows whose
    normaliser vouches for them change no value. Masked (-inf) stretches included; by rows and by vocabulary chunks."""
    generator = torch.Generator().manual_seed(vocab)
    num_positions = 3
    tokens, draft, target = random_logits(batch, num_positions, vocab, seed=vocab)
    draft[:, 1, : vocab // 3] = float("-inf")
    target[:, 2, vocab // 2:] = float("-inf")
    tokens[:, 1] = torch.randint(vocab // 3, vocab, (batch,), generator=generator)
    weight = torch.rand(batch, num_positions, generator=generator)
    draft_probs = dx.mix(draft, draft, 1.0, from_logits=True)
    target_probs = dx.mix(target, target, 1.0, from_logits=True)
    for trial in range(8):
        uniforms = torch.rand(batch, num_positions + 1, generator=generator, dtype=torch.float64)
        uniforms[:, : trial % 4] = 0.0  # from no forced acceptance to every draft accepted (the bonus row)
        from_logits = dx.verify_logits(tokens, draft, target, weight, uniforms=uniforms)
        from_probs = dx.verify(tokens, draft_probs, target_probs, weight, uniforms=uniforms)
        for logit_field, prob_field in zip(from_logits, from_probs):
            assert torch.equal(logit_field, prob_field)
