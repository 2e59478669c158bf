"""CUDA kernels against the CPU kernels on identical inputs and uniforms; skipped where no GPU is visible.

Agreement model. Per-element math is shared (csrc/common/verify_math.h) and built without FMA on both sides, so gathered
values, accept tests, greedy argmaxes and the probability-space mixture agree bit for bit. Two quantities are sums whose
order differs between CPU chunks and a GPU block reduction: the residual/bonus total behind the final-sample threshold
u_K * total (float64), and, on the logits path, each row's softmax normaliser (float partials then float64). So
accept_prob is compared exactly for probabilities and to a few ulps for logits, and a final token may differ only where
the threshold lands on a CDF boundary (within `boundary_tol` of it), which random uniforms essentially never hit.

Only the cross-device checks live here: CUDA against the CPU, CUDA-only behaviour (no host syncs, mixed devices) and the
build check. What each device must do on its own (edge cases against the reference, robustness without checks,
opcheck, the sampled law) is in the topic files, whose tests take the `device` fixture and run on both.
"""

import os

import pytest
import torch

import diversed_ext as dx
from helpers import (DTYPES, logits_verify_case, on_device, poisoned_verify_inputs, random_logits, random_problem,
                     requires_cuda, token_stats_edge_inputs)

VOCABS = [1, 7, 31, 1000, 32001]  # 7, 31 and 32001 give rows that are not 16-byte aligned
CUDA = "cuda"


def test_cuda_build_registered():
    if os.environ.get("DIVERSED_EXPECT_CUDA_BUILD") != "1":
        pytest.skip("the CUDA build was not requested (scripts/test.sh sets DIVERSED_EXPECT_CUDA_BUILD=1 for it)")
    assert dx.cuda_kernels_registered()


# ------------------------------------------------------------------------------------------------------ helpers
def on_both(fn, *args, **kwargs):
    """fn on the CPU and on CUDA with the same inputs; the CUDA result is brought back to the CPU."""
    return fn(*args, **kwargs), on_device(CUDA, fn, *args, **kwargs)


def sampled_distribution(draft, target, weight, num_draft, num_accepted, row, from_logits, temperature):
    """The float64 distribution row `row` drew its final token from (residual, bonus or zero-residual fallback)."""
    m = int(num_accepted[row])
    drafted = min(max(int(num_draft[row]), 0), draft.shape[1])

    def mass(tensor):  # float32 masses as the kernels form them (softmax in float64 is close enough for logits)
        if not from_logits:
            return torch.nan_to_num(tensor.float(), nan=0.0, posinf=0.0, neginf=0.0).clamp(min=0)
        t = float(temperature[row])
        return (tensor.double() * (1.0 / t if t > 0 else 1.0)).softmax(-1).float()

    p = mass(target[row, m])
    if m < drafted and float(weight[row, m]) > 0:
        residual = (p - mass(draft[row, m])).clamp(min=0)
        if residual.double().sum() > 0:
            return residual.double()
    return p.double()


def assert_verify_agrees(cpu, gpu, *, draft, target, weight, num_draft, uniforms, from_logits=False,
                         temperature=None, boundary_tol=1e-9):
    assert torch.equal(cpu.num_accepted, gpu.num_accepted), (cpu.num_accepted, gpu.num_accepted)
    if from_logits:
        torch.testing.assert_close(gpu.accept_prob, cpu.accept_prob, rtol=1e-5, atol=1e-7)
    else:
        assert torch.equal(cpu.accept_prob, gpu.accept_prob)
    for row in torch.nonzero((cpu.tokens != gpu.tokens).any(1)).flatten().tolist():
        m = int(cpu.num_accepted[row])
        differing = torch.nonzero(cpu.tokens[row] != gpu.tokens[row]).flatten().tolist()
        assert differing == [m], f"row {row}: tokens differ at {differing}, not only at the final position {m}"
        low = min(int(cpu.tokens[row, m]), int(gpu.tokens[row, m]))
        distribution = sampled_distribution(draft, target, weight, num_draft, cpu.num_accepted, row, from_logits,
                                            temperature)
        cdf = distribution.cumsum(0) / distribution.sum()
        u = float(uniforms[row, -1])
        assert abs(float(cdf[low]) - u) <= boundary_tol, f"row {row}: final tokens differ away from a CDF boundary"


def verify_inputs(batch, num_positions, vocab, dtype, seed):
    tokens, draft, target = random_problem(batch, num_positions, vocab, seed=seed, dtype=dtype)
    generator = torch.Generator().manual_seed(seed + 1)
    uniforms = torch.rand(batch, num_positions + 1, generator=generator, dtype=torch.float64)
    weight = torch.rand(batch, num_positions, generator=generator)
    weight[0] = 1.0
    if num_positions > 1:
        weight[1, 0] = 0.0  # a rejection with w = 0 samples p itself
    num_draft = torch.randint(0, num_positions + 1, (batch,), generator=generator)
    greedy = torch.tensor([False, True, False, False, True, False, False, True])[:batch]
    return tokens, draft, target, weight, num_draft, greedy, uniforms


# ------------------------------------------------------------------------------------------------ verify (probs)
@requires_cuda
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("num_positions", [0, 1, 4])
def test_verify_probs_matches_cpu(dtype, vocab, num_positions):
    tokens, draft, target, weight, num_draft, greedy, uniforms = verify_inputs(8, num_positions, vocab, dtype,
                                                                               seed=vocab + num_positions)
    cpu, gpu = on_both(dx.verify, tokens, draft, target, weight, num_draft=num_draft, greedy=greedy, uniforms=uniforms)
    assert_verify_agrees(cpu, gpu, draft=draft, target=target, weight=weight, num_draft=num_draft, uniforms=uniforms)


@requires_cuda
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.parametrize("dtype", DTYPES)
def test_seeded_draws_match_cpu(dtype):
    batch, num_positions, vocab = 16, 4, 1000
    tokens, draft, target = random_problem(batch, num_positions, vocab, seed=4, dtype=dtype)
    weight = torch.full((batch, num_positions), 0.5)
    num_draft = torch.full((batch,), num_positions)
    seeds = torch.arange(batch, dtype=torch.int64) * 1000003 - 7
    for seed, offset, per_row in ((0, 0, False), (2**40 + 3, 11, False), (-5, 3, False), (seeds, 2, True)):
        cpu, gpu = on_both(dx.verify, tokens, draft, target, 0.5, seed=seed, offset=offset)
        seed_tensor = seed if per_row else torch.full((batch,), seed, dtype=torch.int64)
        uniforms = dx.philox_uniforms(seed_tensor, offset, num_positions + 1, per_row)
        assert_verify_agrees(cpu, gpu, draft=draft, target=target, weight=weight, num_draft=num_draft,
                             uniforms=uniforms)


@requires_cuda
@pytest.mark.usefixtures("cuda_kernels")
def test_misaligned_rows_and_single_rows():
    # V = 4097 float / 4099 bf16: every row starts at a different offset from 16 bytes; one row per request too.
    for dtype, vocab in ((torch.float32, 4097), (torch.bfloat16, 4099), (torch.float16, 3)):
        tokens, draft, target, weight, num_draft, greedy, uniforms = verify_inputs(7, 3, vocab, dtype, seed=vocab)
        cpu, gpu = on_both(dx.verify, tokens, draft, target, weight, num_draft=num_draft, greedy=greedy,
                           uniforms=uniforms)
        assert_verify_agrees(cpu, gpu, draft=draft, target=target, weight=weight, num_draft=num_draft,
                             uniforms=uniforms)
        cpu, gpu = on_both(dx.verify, tokens[:1], draft[:1], target[:1], weight[:1], uniforms=uniforms[:1])
        assert_verify_agrees(cpu, gpu, draft=draft[:1], target=target[:1], weight=weight[:1],
                             num_draft=torch.full((1,), 3), uniforms=uniforms[:1])


# ----------------------------------------------------------------------------------------------- verify (logits)
@requires_cuda
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("num_positions", [0, 1, 4])
def test_verify_logits_matches_cpu(dtype, vocab, num_positions):
    tokens, draft, target, weight, kwargs = logits_verify_case(num_positions, vocab, dtype)
    cpu, gpu = on_both(dx.verify_logits, tokens, draft, target, weight, **kwargs)
    assert_verify_agrees(cpu, gpu, draft=draft, target=target, weight=weight, num_draft=kwargs["num_draft"],
                         uniforms=kwargs["uniforms"], from_logits=True, temperature=kwargs["temperature"],
                         boundary_tol=1e-5)


@requires_cuda
@pytest.mark.usefixtures("cuda_kernels")
def test_verify_logits_seeded_and_masked_rows():
    tokens, draft, target = random_logits(8, 3, 5000, seed=7, dtype=torch.float32)
    draft[:, :, 4000:] = float("-inf")
    target[:, :, 4500:] = float("-inf")
    tokens = tokens.clamp(max=3999)
    cpu, gpu = on_both(dx.verify_logits, tokens, draft, target, 0.5, temperature=0.8, seed=12, offset=4)
    uniforms = dx.philox_uniforms(torch.full((8,), 12, dtype=torch.int64), 4, 4, False)
    assert_verify_agrees(cpu, gpu, draft=draft, target=target, weight=torch.full((8, 3), 0.5),
                         num_draft=torch.full((8,), 3), uniforms=uniforms, from_logits=True,
                         temperature=torch.full((8,), 0.8), boundary_tol=1e-5)
    emitted = gpu.tokens[gpu.tokens >= 0]
    assert torch.all(emitted < 4500)


@requires_cuda
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.parametrize("from_logits", [False, True])
@pytest.mark.parametrize("batch,vocab", [(1, 262144), (3, 50001), (64, 8193)])
def test_wide_rows_match_cpu(from_logits, batch, vocab):
    # One request over a 262144-token vocabulary: the split kernels cut its rows into many chunks.
    tokens, draft, target = random_logits(batch, 4, vocab, seed=vocab, dtype=torch.float32)
    if not from_logits:
        draft, target = draft.softmax(-1), target.softmax(-1)
    generator = torch.Generator().manual_seed(batch)
    uniforms = torch.rand(batch, 5, dtype=torch.float64, generator=generator)
    weight = torch.rand(batch, 4, generator=generator)
    num_draft = torch.randint(0, 5, (batch,), generator=generator)
    temperature = torch.full((batch,), 0.9)
    temperature[0] = 0.0  # one greedy row
    options = {"temperature": temperature} if from_logits else {"greedy": temperature == 0}
    verify = dx.verify_logits if from_logits else dx.verify
    cpu, gpu = on_both(verify, tokens, draft, target, weight, num_draft=num_draft, uniforms=uniforms, **options)
    assert_verify_agrees(cpu, gpu, draft=draft, target=target, weight=weight, num_draft=num_draft, uniforms=uniforms,
                         from_logits=from_logits, temperature=temperature, boundary_tol=1e-5 if from_logits else 1e-9)


# ------------------------------------------------------------------------------------------- token_stats and mix
@requires_cuda
@pytest.mark.parametrize("from_logits", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_token_stats_matches_cpu(from_logits, dtype, vocab):
    batch, length = 3, 5
    generator = torch.Generator().manual_seed(vocab)
    draft = torch.randn(batch, length, vocab, generator=generator) * 2
    target = torch.randn(batch, length, vocab, generator=generator) * 2
    if not from_logits:
        draft, target = draft.softmax(-1), target.softmax(-1)
    draft, target = draft.to(dtype), target.to(dtype)
    tokens = torch.randint(0, vocab, (batch, length), generator=generator)
    temperature = torch.tensor([1.0, 0.7, 0.0])
    cpu, gpu = on_both(dx.token_stats, draft, target, tokens, from_logits=from_logits, temperature=temperature)
    if not from_logits:  # gathers of the same values: exact
        assert torch.equal(cpu.target_prob, gpu.target_prob) and torch.equal(cpu.draft_prob, gpu.draft_prob)
    for name, cpu_field, gpu_field in zip(cpu._fields, cpu, gpu):
        torch.testing.assert_close(gpu_field, cpu_field, rtol=1e-5, atol=1e-7, msg=name)


@requires_cuda
def test_token_stats_edges_match_cpu():
    # The values themselves are checked on each device by test_logits.py::test_token_stats_edges.
    draft, target, tokens = token_stats_edge_inputs()
    cpu, gpu = on_both(dx.token_stats, draft, target, tokens, from_logits=True, check_inputs=False)
    for cpu_field, gpu_field in zip(cpu, gpu):
        torch.testing.assert_close(gpu_field, cpu_field, rtol=1e-5, atol=1e-7)
    bad_tokens = torch.tensor([[-1, 4]])
    cpu, gpu = on_both(dx.token_stats, draft, target, bad_tokens, from_logits=True, check_inputs=False)
    assert torch.equal(cpu.target_prob, gpu.target_prob) and torch.equal(cpu.target_logprob, gpu.target_logprob)


@requires_cuda
@pytest.mark.parametrize("from_logits", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_mix_matches_cpu(from_logits, dtype, vocab):
    tokens, draft, target = random_logits(3, 4, vocab, seed=vocab, dtype=dtype)
    if not from_logits:
        draft, target = draft.float().softmax(-1).to(dtype), target.float().softmax(-1).to(dtype)
    weight = torch.rand(3, 4, generator=torch.Generator().manual_seed(2))
    cpu, gpu = on_both(dx.mix, draft, target, weight, from_logits=from_logits, temperature=0.8)
    if from_logits:
        torch.testing.assert_close(gpu, cpu, rtol=1e-5, atol=1e-9)
    else:  # elementwise, no sums: bit for bit
        assert torch.equal(cpu, gpu)


# ----------------------------------------------------------------------------------- robustness without checks
@requires_cuda
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.parametrize("dtype", DTYPES)
def test_poisoned_inputs_match_cpu(dtype):
    # That the results stay in range is checked on each device by
    # test_verify_api.py::test_poisoned_inputs_never_escape_the_vocabulary.
    batch, num_positions, vocab = 64, 4, 37
    tokens, draft, target, weight, uniforms, num_draft, greedy = poisoned_verify_inputs(batch, num_positions, vocab,
                                                                                        extreme_ids=True)
    for kwargs in ({"uniforms": uniforms}, {"seed": 3}):
        cpu, gpu = on_both(dx.verify, tokens, draft.to(dtype), target.to(dtype), weight, num_draft=num_draft,
                           greedy=greedy, check_inputs=False, **kwargs)
        assert torch.equal(cpu.num_accepted, gpu.num_accepted) and torch.equal(cpu.accept_prob, gpu.accept_prob)
        assert torch.equal(cpu.tokens, gpu.tokens)


@requires_cuda
@pytest.mark.usefixtures("cuda_kernels")
def test_no_host_sync_without_checks():
    tokens, draft, target, weight, num_draft, greedy, uniforms = verify_inputs(8, 4, 1000, torch.float32, seed=2)
    tokens, draft, target, weight, num_draft, greedy, uniforms = (
        t.to(CUDA) for t in (tokens, draft, target, weight, num_draft, greedy, uniforms))
    temperature = torch.rand(8, device=CUDA)
    seeds = torch.arange(8, device=CUDA)

    def calls():
        dx.verify(tokens, draft, target, weight, num_draft=num_draft, greedy=greedy, uniforms=uniforms,
                  check_inputs=False)
        dx.verify(tokens, draft, target, 0.5, seed=3, offset=1, check_inputs=False)
        dx.verify(tokens, draft, target, 0.5, check_inputs=False)  # seedless: drawn inside the kernel
        dx.verify(tokens, None, target, weight, seed=seeds, check_inputs=False)  # tokens-only drafts
        dx.verify_logits(tokens, draft, target, weight, temperature=temperature, num_draft=num_draft, seed=4,
                         check_inputs=False)
        dx.verify_logits(tokens, draft, target, weight, temperature=temperature, check_inputs=False)
        dx.token_stats(draft, target[:, :4].contiguous(), tokens, from_logits=True, check_inputs=False)
        dx.mix(draft, target, weight, check_inputs=False)

    calls()  # first calls may initialise lazily
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        calls()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


# -------------------------------------------------------------------------------------------------- mixed devices
@requires_cuda
def test_mixed_devices_are_rejected_by_the_op():
    tokens, draft, target = random_problem(2, 2, 10, seed=1)
    args = [tokens.to(CUDA), draft.to(CUDA), target.to(CUDA), torch.full((2, 2), 0.5), torch.full((2,), 2, device=CUDA),
            torch.zeros(2, dtype=torch.bool, device=CUDA), None, torch.zeros(2, dtype=torch.int64, device=CUDA), 0,
            False]  # weight left on the CPU
    with pytest.raises(RuntimeError, match="device"):
        torch.ops.diversed.verify_probs(*args)
