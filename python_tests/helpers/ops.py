"""What the op tests share: random draft/target problems, poisoned inputs, result checks, the dispatch log, the
CUDA skip and the lean forward's.

Tests import these with `from helpers import ...`; pytest configuration (the output poisoning default, the `device`
fixture) lives in conftest.py.
"""

import importlib.util
import os
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

CUDA_SKIP_REASON = "CUDA tests need a GPU, and none is visible on this machine"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_SKIP_REASON)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

FORWARD_SKIP_REASON = "the build was asked to leave the lean forward's native ops out (DIVERSED_FORWARD=0)"


def require_forward_ops() -> None:
    """For a test of the lean forward's native ops: skip where they were left out on purpose (setup.py's
    DIVERSED_FORWARD=0, set for the test run as for the build), fail where the build lacks them otherwise. The
    default build has them, so their absence there is a broken build, not a reason to skip."""
    from diversed_ext.forward import forward_ops_built

    if forward_ops_built():
        return
    if os.environ.get("DIVERSED_FORWARD", "1").strip() == "0":
        pytest.skip(FORWARD_SKIP_REASON)
    pytest.fail("this build of diversed_ext lacks the lean forward's native ops, which every build has unless "
                "DIVERSED_FORWARD=0 leaves them out: rebuild it, or set DIVERSED_FORWARD=0 to test a verify-only "
                "build")


def probe_ops():
    """The tests' probes of the split CUDA kernels' steps (``torch.ops.diversed_probes``): a library of their own,
    diversed_ext/_probes*.so, which the package never loads."""
    spec = importlib.util.find_spec("diversed_ext._probes")
    assert spec is not None and spec.origin, "the build has no diversed_ext/_probes library"
    torch.ops.load_library(spec.origin)
    return torch.ops.diversed_probes


# DIVERSED_CPU_CAPABILITY's values, narrowest first: the builds of the CPU kernels a test compares.
CPU_BUILDS = ("baseline", "avx2", "avx512")


def cpu_build() -> str:
    """The CPU build the kernels run now: the probe makes the kernels' own choice (csrc/cpu_base/capability.h)."""
    return probe_ops().cpu_build()


def cpu_builds_here(monkeypatch) -> list:
    """The builds this CPU runs, narrowest first (the widest it has is what runs without DIVERSED_CPU_CAPABILITY)."""
    monkeypatch.delenv("DIVERSED_CPU_CAPABILITY", raising=False)
    return list(CPU_BUILDS[:CPU_BUILDS.index(cpu_build()) + 1])


def use_cpu_build(monkeypatch, build: str) -> None:
    """Cap the kernels at ``build`` and check that they took it, so a comparison of builds never compares one build
    with itself unnoticed; skip where the CPU lacks it (the cap then falls back to the widest build the CPU has)."""
    monkeypatch.setenv("DIVERSED_CPU_CAPABILITY", build)
    taken = cpu_build()
    if taken != build:
        assert CPU_BUILDS.index(taken) < CPU_BUILDS.index(build), f"{build} asked for, {taken} runs"
        pytest.skip(f"this CPU has no {build} build")


def to_device(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def on_device(device, fn, *args, **kwargs):
    """fn with every tensor argument moved to `device`; the result (a tensor or a named tuple of tensors) is brought
    back to the CPU, so a test compares it with CPU values the same way on every device."""
    result = fn(*(to_device(a, device) for a in args), **{k: to_device(v, device) for k, v in kwargs.items()})
    if isinstance(result, torch.Tensor):
        return result.cpu()
    return type(result)(*(field.cpu() for field in result))


def random_distributions(shape, generator, sharpness=2.0, dtype=torch.float32):
    """Softmax of scaled Gaussian logits: a mix of peaked and flat rows."""
    logits = torch.randn(*shape, generator=generator) * sharpness
    return logits.softmax(-1).to(dtype)


def random_problem(batch, num_positions, vocab, *, seed=0, dtype=torch.float32, sharpness=2.0):
    """(draft_tokens, draft_probs, target_probs) with drafts sampled from the draft distributions."""
    generator = torch.Generator().manual_seed(seed)
    draft_probs = random_distributions((batch, num_positions, vocab), generator, sharpness, dtype)
    target_probs = random_distributions((batch, num_positions + 1, vocab), generator, sharpness, dtype)
    if num_positions > 0:
        flat = draft_probs.float().reshape(-1, vocab)
        draft_tokens = torch.multinomial(flat, 1, generator=generator).reshape(batch, num_positions)
    else:
        draft_tokens = torch.zeros(batch, 0, dtype=torch.int64)
    return draft_tokens, draft_probs, target_probs


def random_logits(batch, num_positions, vocab, seed=0, scale=3.0, dtype=torch.float32):
    """(draft_tokens, draft_logits, target_logits) with drafts sampled from softmax(draft_logits)."""
    generator = torch.Generator().manual_seed(seed)
    draft = torch.randn(batch, num_positions, vocab, generator=generator) * scale
    target = torch.randn(batch, num_positions + 1, vocab, generator=generator) * scale
    draft_probs = draft.softmax(-1)
    if num_positions:
        tokens = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=generator).reshape(batch, num_positions)
    else:
        tokens = torch.zeros(batch, 0, dtype=torch.int64)
    return tokens, draft.to(dtype), target.to(dtype)


def logits_verify_case(num_positions, vocab, dtype, batch=6):
    """A mixed verify_logits batch: random logits, uniforms, per-token weights, ragged rows, and temperatures with two
    greedy rows. Returns (tokens, draft, target, weight, kwargs) with kwargs for verify_logits."""
    tokens, draft, target = random_logits(batch, num_positions, vocab, seed=vocab + num_positions, dtype=dtype)
    generator = torch.Generator().manual_seed(3)
    uniforms = torch.rand(batch, num_positions + 1, generator=generator, dtype=torch.float64)
    weight = torch.rand(batch, num_positions, generator=generator)
    num_draft = torch.randint(0, num_positions + 1, (batch,), generator=generator)
    temperature = torch.tensor([1.0, 0.5, 2.0, 0.0, 1.3, 0.0])[:batch]  # two greedy rows
    return tokens, draft, target, weight, dict(temperature=temperature, num_draft=num_draft, uniforms=uniforms)


def poisoned_logits_inputs():
    """verify_logits inputs only check_inputs=False lets through (B = 32, K = 4, V = 37): NaN logits, a target row of
    -inf, ids outside [0, V). Returns (tokens, draft, target, generator); draw the rest of a case from the generator."""
    tokens, draft, target = random_logits(32, 4, 37, seed=3)
    generator = torch.Generator().manual_seed(0)
    for tensor in (draft, target):
        mask = torch.rand(tensor.shape, generator=generator) < 0.2
        tensor[mask] = float("nan")
    target[0] = float("-inf")
    tokens[:, 1] = torch.randint(-40, 80, (32,), generator=generator)
    return tokens, draft, target, generator


def poisoned_verify_inputs(batch, num_positions, vocab, seed=0, extreme_ids=False):
    """Verify inputs only check_inputs=False lets through: NaN, infinite and negative mass, a target row without mass,
    ids outside [0, V), weights and uniforms outside their ranges or NaN, num_draft outside [0, K]. extreme_ids also
    puts an id of -2**40 in row 5 and a num_draft of 2**40 in row 4 (batch >= 6)."""
    generator = torch.Generator().manual_seed(seed)
    draft = torch.rand(batch, num_positions, vocab, generator=generator)
    target = torch.rand(batch, num_positions + 1, vocab, generator=generator)
    poison = torch.tensor([float("nan"), float("inf"), -1.0, -float("inf"), 0.0])
    for tensor in (draft, target):
        mask = torch.rand(tensor.shape, generator=generator) < 0.3
        tensor[mask] = poison[torch.randint(0, 5, (int(mask.sum()),), generator=generator)]
    target[0] = float("nan")  # a row with no valid mass at all
    draft[1] = 0.0
    tokens = torch.randint(-50, 80, (batch, num_positions), generator=generator)
    weight = torch.rand(batch, num_positions, generator=generator) * 3 - 1
    weight[2] = float("nan")
    uniforms = torch.rand(batch, num_positions + 1, generator=generator, dtype=torch.float64) * 4 - 2
    uniforms[3] = float("nan")
    num_draft = torch.randint(-3, 9, (batch,), generator=generator)
    greedy = torch.rand(batch, generator=generator) < 0.3
    if extreme_ids:
        tokens[5, 0] = -(2**40)
        num_draft[4] = 2**40
    return tokens, draft, target, weight, uniforms, num_draft, greedy


def token_stats_edge_inputs():
    """token_stats logits [1, 2, 4] at the edges: position 0's token 2 has a probability that underflows to 0 (its
    log-probability stays finite), position 1 is all -inf (only check_inputs=False lets it through).
    Returns (draft, target, tokens)."""
    draft = torch.zeros(1, 2, 4)
    target = torch.tensor([[[0.0, -200.0, -300.0, 0.0], [float("-inf")] * 4]])
    return draft, target, torch.tensor([[2, 1]])


def tokens_only_case(batch, num_positions, vocab, seed, dtype=torch.float32):
    """(tokens, target_probs, weight, kwargs) of a mixed tokens-only batch: drafted ids half at the target's argmax
    (kept by greedy rows, often by sampled ones), half elsewhere; per-token weights, ragged rows, every third row
    greedy, explicit uniforms."""
    tokens, _, target = random_problem(batch, num_positions, vocab, seed=seed, dtype=dtype)
    generator = torch.Generator().manual_seed(seed + 1)
    at_argmax = torch.rand(batch, num_positions, generator=generator) < 0.5
    tokens = torch.where(at_argmax, target[:, :num_positions].float().argmax(-1), tokens)
    weight = torch.rand(batch, num_positions, generator=generator)
    kwargs = dict(num_draft=torch.randint(0, num_positions + 1, (batch,), generator=generator),
                  greedy=torch.arange(batch) % 3 == 1,
                  uniforms=torch.rand(batch, num_positions + 1, generator=generator, dtype=torch.float64))
    return tokens, target, weight, kwargs


# How a target forbids tokens, as a server's constraints reach the verifier: probabilities of exactly 0 (bad words,
# allowed_token_ids), the float32 softmax of a -100 logit bias (tiny, often subnormal), logits of -inf, logits biased
# by -100.
FORBIDDEN_FORMS = ["probs_zero", "probs_bias", "logits_inf", "logits_bias"]


def forbidden_case(batch, num_positions, vocab, form, *, seed=0, dtype=torch.float32):
    """A verify call whose target forbids about a third of each row, and about half of the drafted tokens (drafts come
    from the unconstrained draft, as a draft model that never saw the constraint proposes them); one token per target
    row stays allowed. ``form``: one of FORBIDDEN_FORMS. Returns (tokens, draft, target, forbidden, kwargs): draft
    and target probabilities or logits of ``dtype``, ``forbidden`` bool [B, K+1, V], and kwargs with ragged
    num_draft, uniforms, and greedy flags (every third row) or temperatures in [0.5, 1.5] (0 on every third row)."""
    generator = torch.Generator().manual_seed(seed)
    draft = torch.randn(batch, num_positions, vocab, generator=generator) * 2
    target = torch.randn(batch, num_positions + 1, vocab, generator=generator) * 2
    forbidden = torch.rand(batch, num_positions + 1, vocab, generator=generator) < 0.3
    if num_positions:
        tokens = torch.multinomial(draft.softmax(-1).reshape(-1, vocab), 1, generator=generator)
        tokens = tokens.reshape(batch, num_positions)
        hit = torch.rand(batch, num_positions, generator=generator) < 0.5
        drafted = forbidden[:, :num_positions].gather(2, tokens.unsqueeze(-1)).squeeze(-1)
        forbidden[:, :num_positions].scatter_(2, tokens.unsqueeze(-1), (drafted | hit).unsqueeze(-1))
    else:
        tokens = torch.zeros(batch, 0, dtype=torch.int64)
    keep = torch.randint(0, vocab, (batch, num_positions + 1, 1), generator=generator)
    forbidden.scatter_(2, keep, False)
    if form == "probs_zero":
        target = target.softmax(-1).masked_fill(forbidden, 0.0)
        target = target / target.sum(-1, keepdim=True)
    elif form == "probs_bias":
        target = (target - 100.0 * forbidden).softmax(-1)
    elif form == "logits_inf":
        target = target.masked_fill(forbidden, float("-inf"))
    else:
        target = target - 100.0 * forbidden
    kwargs = dict(num_draft=torch.randint(0, num_positions + 1, (batch,), generator=generator),
                  uniforms=torch.rand(batch, num_positions + 1, generator=generator, dtype=torch.float64))
    if form.startswith("probs"):
        draft = draft.softmax(-1)
        kwargs["greedy"] = torch.arange(batch) % 3 == 1
    else:
        kwargs["temperature"] = torch.where(torch.arange(batch) % 3 == 1, 0.0,
                                            torch.rand(batch, generator=generator) + 0.5)
    return tokens, draft.to(dtype), target.to(dtype), forbidden, kwargs


def assert_keeps_constraints(result, draft_tokens, forbidden):
    """What the target forbids holds whatever the weight: a forbidden draft has accept_prob 0, and no emitted token is
    forbidden by the target row it was emitted at (accepted drafts, corrections and the bonus alike). ``forbidden``
    bool [B, K+1, V] as the padded target's rows; results and tensors on the CPU."""
    batch, num_positions = draft_tokens.shape
    if num_positions:
        drafted = forbidden[:, :num_positions].gather(2, draft_tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        assert torch.all(result.accept_prob[drafted] == 0)
    emitted = torch.arange(num_positions + 1).unsqueeze(0) <= result.num_accepted.long().unsqueeze(1)
    at = forbidden.gather(2, result.tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    assert not torch.any(at & emitted), "an emitted token is one its target row forbids"


def assert_same(native, reference):
    """Two verify results bit for bit: tokens, accepted counts and acceptance probabilities."""
    assert torch.equal(native.tokens, reference.tokens), (native.tokens, reference.tokens)
    assert torch.equal(native.num_accepted, reference.num_accepted)
    assert torch.equal(native.accept_prob, reference.accept_prob)


def assert_verify_close(native, reference):
    """A verify result against the reference's: the same tokens and counts, accept_prob to float rounding (on the
    logits path the reference divides by the temperature where the kernels multiply by its inverse)."""
    assert torch.equal(native.tokens, reference.tokens)
    assert torch.equal(native.num_accepted, reference.num_accepted)
    torch.testing.assert_close(native.accept_prob, reference.accept_prob, rtol=2e-5, atol=1e-6)


def assert_verify_result_in_range(result, num_positions, vocab):
    """Whatever the inputs: emitted ids in [0, V), -1 padding after them, counts and probabilities in range."""
    emitted = torch.arange(num_positions + 1, device=result.tokens.device) <= result.num_accepted.unsqueeze(1).long()
    assert torch.all((result.tokens[emitted] >= 0) & (result.tokens[emitted] < vocab))
    assert torch.all(result.tokens[~emitted] == -1)
    assert torch.all((result.num_accepted >= 0) & (result.num_accepted <= num_positions))
    assert torch.all((result.accept_prob >= 0) & (result.accept_prob <= 1))


# diversed::int8_linear computes what torch's dynamically quantised linear layer computes with reduce_range off: the
# input quantised with torch's own parameters and quantiser to uint8's whole range, exact integer sums, the float
# rescaling. torch's layer itself runs with reduce_range on, and fbgemm's AVX2 kernels sum the whole range's products
# in int16 (saturating), so the oracle below takes torch's quantisation of the input and sums exactly. torch 2.14
# quantises some inputs one step differently, so tests against it run on the pinned 2.13 only; the tests against the
# exact integer arithmetic and between builds run everywhere.
LAYER_ARITHMETIC_TORCH = "2.13."
requires_pinned_quantised_layer = pytest.mark.skipif(
    not torch.__version__.startswith(LAYER_ARITHMETIC_TORCH),
    reason=f"compares with torch's own input quantisation, which int8_linear reproduces for torch "
           f"{LAYER_ARITHMETIC_TORCH}x; this is torch {torch.__version__}")


def torch_full_range_product(x, weight, scale, bias=None):
    """``x`` [..., K] (quantised as one tensor by torch: ``torch._choose_qparams_per_tensor`` without reduce_range,
    ``torch.quantize_per_tensor``) times int8 ``weight`` [N, K] with a scale per output feature, summed exactly and
    rescaled in float64: torch's dynamic int8 linear layer over uint8's whole range, without fbgemm's int16 sums."""
    x_scale, zero_point = torch._choose_qparams_per_tensor(x.contiguous(), False)
    with warnings.catch_warnings():  # torch announces the deprecation of its quantised tensors on every call
        warnings.simplefilter("ignore")
        quantised = torch.quantize_per_tensor(x, x_scale, zero_point, torch.quint8).int_repr().to(torch.int64)
    sums = (quantised - zero_point) @ weight.to(torch.int64).t()
    out = sums.double() * (x_scale * torch.as_tensor(scale, dtype=torch.float64))
    return out if bias is None else out + bias.detach().double()


class DispatchLog(TorchDispatchMode):
    """Names of the ops dispatched while active (only the outermost ones: nothing inside a kernel)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def dispatched(call):
    """The ops `call` dispatches (DispatchLog's names), in order."""
    with DispatchLog() as log:
        call()
    return log.ops


def ruled_out_logits(batch, positions, vocab, dtype, seed, scale=3.0):
    """Draft and target logits [B, T, V] (of `dtype`) with a quarter of every row's entries ruled out (-inf) but each
    row's first, and per-row temperatures [B] with a greedy row (B <= 4): the distribution features' and the gate's
    cases."""
    generator = torch.Generator().manual_seed(seed)
    draft = torch.randn(batch, positions, vocab, generator=generator) * scale
    target = torch.randn(batch, positions, vocab, generator=generator) * scale
    for logits in (draft, target):
        ruled_out = torch.rand(logits.shape, generator=generator) < 0.25
        ruled_out[..., 0] = False
        logits[ruled_out] = float("-inf")
    temperature = torch.tensor([1.0, 0.0, 0.6, 1.7])[:batch]
    return draft.to(dtype), target.to(dtype), temperature
