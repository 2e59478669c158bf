"""Drafts without distributions (``draft_probs`` / ``draft_logits`` = None): the tokens of EAGLE, MTP or ngram
drafters. q is then one-hot at each drafted x_i, so with nu_i = w_i p_i + (1 - w_i) q_i the verifier keeps x_i with
probability nu_i(x_i) = w_i p_i(x_i) + 1 - w_i and a rejection at m draws from p_m without x_m (p_m itself when p_m has
no mass off x_m); an id outside [0, V) has no mass at all (rejected, accept_prob 0, the correction drawn from p).

Native against the references (which materialise one-hot rows) on identical uniforms, against one-hot rows through the
usual paths, the law of the emitted tokens, batch invariance and the custom-op machinery; the edges are in
test_verify_tokens_only_edges.py. Tests that take `device` also run on CUDA (skipped where no GPU is visible).
"""

import pytest
import torch

import diversed_ext as dx
from diversed_ext.ops.reference import one_hot_drafts
from helpers import (DTYPES, P_VALUE_FLOOR, assert_same, assert_verify_close, chi_square_tokens_p_value,
                     cpu_builds_here, logits_verify_case, on_device, tokens_only_case, use_cpu_build)

CHUNKED_VOCAB = 70_001  # one request with V >= 65536 goes by vocabulary chunks; several go by rows


def one_hot_logits(tokens, vocab, dtype=torch.float32):
    """Draft logits whose softmax is exactly one-hot at each id (0 there, -inf elsewhere) at any temperature; a row of
    -inf for an id outside [0, V)."""
    return one_hot_drafts(tokens, vocab).log().to(dtype)


def assert_fields_equal(a, b):
    for name, field_a, field_b in zip(a._fields, a, b):
        assert torch.equal(field_a, field_b), (name, field_a, field_b)


# ------------------------------------------------------------------------------------ native against the references
@pytest.mark.parametrize("weight_kind", ["per token", "scalar"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 257, 4099])
@pytest.mark.parametrize("num_positions", [0, 1, 4])
def test_verify_matches_reference(num_positions, vocab, dtype, weight_kind, device):
    """Bit for bit on identical uniforms: sampled and greedy rows, ragged rows, per-token and scalar weights."""
    tokens, target, weight, kwargs = tokens_only_case(9, num_positions, vocab, seed=vocab + num_positions, dtype=dtype)
    weight = weight if weight_kind == "per token" else 0.35
    native = on_device(device, dx.verify, tokens, None, target, weight, **kwargs)
    assert_same(native, dx.verify_reference(tokens, None, target, weight, **kwargs))
    assert native.tokens.shape == (9, num_positions + 1) and native.accept_prob.shape == (9, num_positions)


@pytest.mark.parametrize("weight_kind", ["per token", "scalar"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 257, 4099])
@pytest.mark.parametrize("num_positions", [0, 1, 4])
def test_verify_logits_matches_reference(num_positions, vocab, dtype, weight_kind, device):
    """Temperatures 1, 0.5, 2 and 1.3 with two greedy rows (temperature 0), ragged rows: the same tokens and counts as
    the reference; accept_prob = w p(x) + 1 - w within the kernels' exp (the reference uses torch's softmax)."""
    tokens, _, target, weight, kwargs = logits_verify_case(num_positions, vocab, dtype)
    weight = weight if weight_kind == "per token" else 0.35
    native = on_device(device, dx.verify_logits, tokens, None, target, weight, **kwargs)
    assert_verify_close(native, dx.verify_logits_reference(tokens, None, target, weight, **kwargs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
def test_both_layouts_and_every_cpu_build(batch, dtype, monkeypatch):
    """V = 70001: one request goes by vocabulary chunks, three by rows. Each build gives the reference's results
    (bit for bit from probabilities; tokens and counts from logits) and every build gives the same bits."""
    num_positions = 3
    tokens, target, weight, kwargs = tokens_only_case(batch, num_positions, CHUNKED_VOCAB, seed=batch, dtype=dtype)
    logits = target.float().log().to(dtype)
    temperature = torch.tensor([0.8, 0.0, 1.0])[:batch]
    logit_kwargs = dict(temperature=temperature, num_draft=kwargs["num_draft"], uniforms=kwargs["uniforms"])
    reference = dx.verify_reference(tokens, None, target, weight, **kwargs)
    logits_reference = dx.verify_logits_reference(tokens, None, logits, weight, **logit_kwargs)
    results = {}
    for build in cpu_builds_here(monkeypatch):
        use_cpu_build(monkeypatch, build)
        results[build] = (dx.verify(tokens, None, target, weight, **kwargs),
                          dx.verify_logits(tokens, None, logits, weight, **logit_kwargs),
                          dx.verify(tokens, None, target, 1.0, greedy=True))
        assert_same(results[build][0], reference)
        assert_verify_close(results[build][1], logits_reference)
    for build in list(results)[1:]:
        for base, other in zip(results["baseline"], results[build]):
            assert_fields_equal(base, other)


# ----------------------------------------------------------------------------- against one-hot rows, materialised
def seeding_cases(batch):
    """Seeds, offsets, weights and flags to compare tokens-only calls with materialised ones on."""
    per_token = torch.rand(batch, 3, generator=torch.Generator().manual_seed(5))
    return [dict(weight=0.6, seed=7),
            dict(weight=1.0, seed=2**40 + 3, offset=5),
            dict(weight=torch.linspace(0, 1, batch), seed=torch.arange(batch) * 1000003, offset=2),
            dict(weight=per_token, seed=torch.arange(batch) - 3, offset=11, num_draft=torch.arange(batch) % 4),
            dict(weight=0.0, seed=-5, num_draft=torch.arange(batch) % 4)]


def with_bad_ids(tokens, vocab):
    """tokens with ids outside [0, V) at position 1 of rows 0, 3 and 6 (only check_inputs=False lets them through)."""
    tokens = tokens.clone()
    tokens[::3, 1] = torch.tensor([-1, vocab, 2**40])
    return tokens


@pytest.mark.parametrize("dtype", DTYPES)
def test_verify_equals_one_hot_draft_probs(dtype, device):
    """Every field equals what verify gives on materialised one-hot draft rows, whatever the seeding and w; with
    check_inputs=False an id outside [0, V) equals a row of zeros."""
    batch, vocab = 8, 300
    tokens, target, _, _ = tokens_only_case(batch, 3, vocab, seed=6, dtype=dtype)
    greedy = torch.arange(batch) % 4 == 3
    for case in seeding_cases(batch):
        weight = case.pop("weight")
        for check_inputs, ids in ((True, tokens), (False, with_bad_ids(tokens, vocab))):
            one_hot = one_hot_drafts(ids, vocab).to(dtype)
            tokens_only = on_device(device, dx.verify, ids, None, target, weight, greedy=greedy,
                                    check_inputs=check_inputs, **case)
            assert_fields_equal(tokens_only, on_device(device, dx.verify, ids, one_hot, target, weight,
                                                       greedy=greedy, check_inputs=check_inputs, **case))


@pytest.mark.parametrize("dtype", DTYPES)
def test_verify_logits_equals_one_hot_draft_logits(dtype, device):
    """verify_logits can take one-hot drafts as logits (0 at x, -inf elsewhere: a softmax of exactly one-hot at any
    temperature): every field equals what the tokens-only call gives, greedy rows and temperatures included."""
    batch, vocab = 8, 300
    tokens, target, _, _ = tokens_only_case(batch, 3, vocab, seed=7)
    logits = (target.log() * 0.7).to(dtype)
    temperature = torch.tensor([1.0, 0.0, 0.5, 2.0, 1.3, 0.0, 0.9, 1.0])
    for case in seeding_cases(batch):
        weight = case.pop("weight")
        for check_inputs, ids in ((True, tokens), (False, with_bad_ids(tokens, vocab))):
            arguments = dict(temperature=temperature, check_inputs=check_inputs, **case)
            tokens_only = on_device(device, dx.verify_logits, ids, None, logits, weight, **arguments)
            one_hot = one_hot_logits(ids, vocab, dtype)
            assert_fields_equal(tokens_only, on_device(device, dx.verify_logits, ids, one_hot, logits, weight,
                                                       **arguments))


@pytest.mark.parametrize("batch,vocab", [(6, 4099), (1, CHUNKED_VOCAB)])
def test_verify_logits_equals_verify_on_the_kernels_own_probabilities(batch, vocab):
    """On the CPU, tokens-only verify_logits equals tokens-only verify on the probabilities the logits kernels compute
    (mix with w = 1 writes p exactly), at temperatures other than 1 and with greedy rows; by rows and by chunks."""
    tokens, target, weight, kwargs = tokens_only_case(batch, 3, vocab, seed=vocab)
    logits = target.log()
    logits[:, 2, vocab // 2:] = float("-inf")
    tokens[:, 2] = tokens[:, 2] % (vocab // 2)
    temperature = torch.tensor([0.7, 0.0, 1.0, 1.6, 0.0, 1.0])[:batch]
    probs = dx.mix(logits, logits, 1.0, from_logits=True, temperature=temperature)
    for seed in (0, torch.arange(batch) + 40):
        from_logits = dx.verify_logits(tokens, None, logits, weight, temperature=temperature, seed=seed, offset=3,
                                       num_draft=kwargs["num_draft"])
        from_probs = dx.verify(tokens, None, probs, weight, greedy=temperature == 0, seed=seed, offset=3,
                               num_draft=kwargs["num_draft"])
        assert_fields_equal(from_logits, from_probs)


# ------------------------------------------------------------------------------------------- the emitted tokens' law
NUM_ROWS = 200_000


def sampling_problem(vocab, num_positions, seed):
    """Target logits [K+1, V] shared by every row, drafted ids x_i = (V // 2 + i) % V, and ragged num_draft in
    [1, K] (position 0 always drafted). Returns (logits, tokens [R, K], num_draft [R])."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_positions + 1, vocab, generator=generator) * 1.5
    tokens = ((vocab // 2 + torch.arange(num_positions)) % vocab).expand(NUM_ROWS, num_positions).contiguous()
    num_draft = torch.randint(1, num_positions + 1, (NUM_ROWS,), generator=generator)
    return logits, tokens, num_draft


@pytest.mark.parametrize("op", ["verify", "verify_logits"])
@pytest.mark.parametrize("weight", [0.0, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("vocab", [2, 7, 33])
@pytest.mark.parametrize("num_positions", [1, 3])
def test_emitted_tokens_follow_nu(num_positions, vocab, weight, op, device):
    """200k rows with the same target rows and drafts, each with its own Philox stream (a shared seed, different row
    keys): the token emitted at position 0 (x_0 kept or the correction) follows nu_0 = w p_0 + (1 - w) onehot(x_0),
    position 0 keeps x_0 at the rate w p_0(x_0) + 1 - w, and with K = 3 (ragged rows) the token at position 1 of the
    rows that reached it drafted follows nu_1."""
    logits, tokens, num_draft = sampling_problem(vocab, num_positions, seed=vocab * 10 + num_positions)
    target = logits.softmax(-1)
    rows = logits if op == "verify_logits" else target
    rows = rows.expand(NUM_ROWS, num_positions + 1, vocab).contiguous()
    verifier = dx.verify_logits if op == "verify_logits" else dx.verify
    result = on_device(device, verifier, tokens, None, rows, weight, num_draft=num_draft, seed=vocab + 17,
                       check_inputs=False)  # the inputs are valid; the checks would only add time
    p = logits.double().softmax(-1)
    x = tokens[0]
    nu = weight * p[:num_positions] + (1 - weight) * torch.nn.functional.one_hot(x, vocab).double()

    kept = (result.num_accepted >= 1).double().mean().item()
    expected = nu[0, x[0]].item()
    standard_error = (expected * (1 - expected) / NUM_ROWS) ** 0.5
    assert abs(kept - expected) < 5 * standard_error + 1e-6, (kept, expected)
    reached = [torch.ones(NUM_ROWS, dtype=torch.bool)]
    if num_positions > 1:
        reached.append((result.num_accepted >= 1) & (num_draft >= 2))
    for position, rows_reaching in enumerate(reached):
        emitted = result.tokens[rows_reaching, position]
        if weight == 0.0:  # nu = onehot(x): nothing else may come out
            assert torch.all(emitted == x[position])
        else:
            assert chi_square_tokens_p_value(emitted, nu[position]) > P_VALUE_FLOOR, position
    if weight == 0.5 and vocab > 2:  # power: the same samples fail against the target alone
        assert chi_square_tokens_p_value(result.tokens[:, 0], p[0]) < 1e-10


# ------------------------------------------------------------------------------------------------------------- edges
def test_a_row_alone_equals_the_row_in_a_batch(device):
    """With per-request seeds a request's result depends only on its own inputs and seed: alone (one request, by
    vocabulary chunks on the CPU) and inside a batch of unrelated requests (by rows), from probabilities and logits."""
    batch, num_positions, vocab = 5, 3, CHUNKED_VOCAB
    tokens, target, weight, kwargs = tokens_only_case(batch, num_positions, vocab, seed=13)
    logits = target.log()
    seeds = torch.tensor([3, 1 << 40, -9, 77, 5])
    temperature = torch.tensor([0.6, 0.0, 1.0, 1.7, 1.0])
    num_draft, greedy = kwargs["num_draft"], kwargs["greedy"]
    batched = (on_device(device, dx.verify, tokens, None, target, weight, num_draft=num_draft, greedy=greedy,
                         seed=seeds, offset=4),
               on_device(device, dx.verify_logits, tokens, None, logits, weight, num_draft=num_draft,
                         temperature=temperature, seed=seeds, offset=4))
    for row in range(batch):
        one = slice(row, row + 1)
        alone = (on_device(device, dx.verify, tokens[one], None, target[one], weight[one], num_draft=num_draft[one],
                           greedy=greedy[one], seed=seeds[one], offset=4),
                 on_device(device, dx.verify_logits, tokens[one], None, logits[one], weight[one],
                           num_draft=num_draft[one], temperature=temperature[one], seed=seeds[one], offset=4))
        for whole, single in zip(batched, alone):
            for field_whole, field_single in zip(whole, single):
                assert torch.equal(field_whole[one], field_single), row


# ------------------------------------------------------------------------------------------- custom-op machinery
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_without_draft(dtype, device):
    """torch.library.opcheck of the verify ops with the draft argument None: schema, fake kernel and kernel agree."""
    batch, num_positions, vocab = 4, 3, 20
    tokens, target, weight, kwargs = tokens_only_case(batch, num_positions, vocab, seed=14, dtype=dtype)
    tokens, target, weight = tokens.to(device), target.to(device), weight.to(device)
    logits = target.float().log().to(dtype)
    num_draft, greedy = kwargs["num_draft"].to(device), kwargs["greedy"].to(device)
    uniforms = kwargs["uniforms"].to(device)
    seeds = torch.arange(batch, dtype=torch.int64, device=device)
    temperature = torch.tensor([1.0, 0.0, 0.5, 2.0], device=device)
    for explicit in (None, uniforms):
        torch.library.opcheck(torch.ops.diversed.verify_probs.default,
                              (tokens, None, target, weight, num_draft, greedy, explicit, seeds, 5, True))
        torch.library.opcheck(torch.ops.diversed.verify_logits.default,
                              (tokens, None, logits, weight, num_draft, temperature, explicit, seeds, 0,
                               explicit is None))
    torch.library.opcheck(torch.ops.diversed.verify_probs.default,
                          (tokens, None, target, None, None, None, None, None, 3, False, 0.25, 11))


def test_torch_compile_fullgraph_traces_tokens_only_calls():
    tokens, target, _, kwargs = tokens_only_case(4, 3, 30, seed=16)
    logits, uniforms = target.log(), kwargs["uniforms"]

    def step(tokens, target, logits, uniforms):
        return (dx.verify(tokens, None, target, 0.7, uniforms=uniforms, check_inputs=False),
                dx.verify_logits(tokens, None, logits, 0.5, seed=0, check_inputs=False))

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for expected, got in zip(step(tokens, target, logits, uniforms), compiled(tokens, target, logits, uniforms)):
        assert_fields_equal(expected, got)
