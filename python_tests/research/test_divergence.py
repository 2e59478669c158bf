"""The closed-form per-position laws of research.divergence against a brute-force enumeration through the verifier
itself (every draft x of a tiny vocabulary, and a dense grid of the verifier's uniforms for its test and its
replacement sample), and FLy's Monte Carlo deferral estimate against its exact value on a tiny model pair."""

import itertools
import math

import pytest
import torch

from diversed_ext.decoding import Gate, Typical
from diversed_ext.decoding.gate import gated_weights
from diversed_ext.decoding.typical import typical_verify_arguments
from diversed_ext.ops.reference import verify_logits_reference
from diversed_ext.research.divergence import RuleLaw, divergences, position_law

VOCAB = 6
GRID = 4096  # uniforms per draft: each outcome's probability to within 1 / GRID


def _logit_rows(seed, count=4, scale=2.0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, VOCAB, generator=generator, dtype=torch.float64) * scale


def _enumerated_law(target_logits, draft_logits, weight=1.0, tokens_only=False, typical=None, gate=None,
                    temperature=1.0):
    """sum over every draft x of q(x) times the law of the first token the verifier emits when x is drafted at the
    position: its accept test over a grid of its first uniform, its replacement sample over a grid of its final
    uniform, all (position, x) pairs in one batch through the loop's own gate and typical-acceptance arguments."""
    positions = target_logits.shape[0]
    pairs = positions * VOCAB
    target = torch.stack([target_logits, target_logits], 1).float().repeat_interleave(VOCAB, 0)  # a position, a bonus
    draft = draft_logits.float().unsqueeze(1).repeat_interleave(VOCAB, 0)  # [P, 1, V]
    tokens = torch.arange(VOCAB).repeat(positions).unsqueeze(1)  # [P, 1]: x of each pair
    num_draft = torch.ones(pairs, dtype=torch.int64)
    weights = torch.full((pairs, 1), weight, dtype=torch.float32)
    seen = None if tokens_only else draft
    if gate is not None:
        weights = gated_weights(gate, weight, tokens, seen, target, temperature)
    if typical is not None:
        num_draft, weights = typical_verify_arguments(typical, tokens, num_draft, target, temperature)
        seen = None
    grid = (torch.arange(GRID, dtype=torch.float64) + 0.5) / GRID

    def emitted(first, final):
        def rows(tensor):
            return None if tensor is None else tensor.repeat_interleave(GRID, 0)
        result = verify_logits_reference(rows(tokens), rows(seen), rows(target), rows(weights),
                                         temperature=temperature, num_draft=rows(num_draft),
                                         uniforms=torch.stack([first.repeat(pairs), final.repeat(pairs)], dim=1))
        return result.tokens[:, 0].view(pairs, GRID), result.num_accepted.view(pairs, GRID)

    # Kept: the draft accepted (a replacement sample may be x too, under typical acceptance's r = p).
    kept = (emitted(grid, torch.full_like(grid, 0.5))[1] == 1).double().mean(1)
    replaced = torch.nn.functional.one_hot(emitted(torch.full_like(grid, 1 - 1e-12), grid)[0], VOCAB).double().mean(1)
    laws = replaced * (1 - kept).unsqueeze(1) + torch.nn.functional.one_hot(tokens[:, 0], VOCAB) * kept.unsqueeze(1)
    q = (draft_logits / temperature).softmax(-1).reshape(pairs, 1)
    return (q * laws).view(positions, VOCAB, VOCAB).sum(1)


CASES = [("exact", RuleLaw("exact"), dict()),
         ("static", RuleLaw("static", 0.4), dict(weight=0.4)),
         ("static w=0", RuleLaw("static", 0.0), dict(weight=0.0)),
         ("static, tokens only", RuleLaw("static", 0.6, tokens_only=True), dict(weight=0.6, tokens_only=True)),
         ("gate", RuleLaw("gate", 1.0, margin=2.0), dict(gate=Gate(2.0))),
         ("gate with static w", RuleLaw("gate", 0.5, margin=1.0), dict(weight=0.5, gate=Gate(1.0))),
         ("gate, tokens only", RuleLaw("gate", 1.0, margin=2.0, tokens_only=True),
          dict(gate=Gate(2.0), tokens_only=True)),
         ("typical", RuleLaw("typical", typical=Typical()), dict(typical=Typical())),
         ("typical, loose", RuleLaw("typical", typical=Typical(0.3, 0.6)), dict(typical=Typical(0.3, 0.6)))]


@pytest.mark.parametrize("name, law, options", CASES, ids=[case[0] for case in CASES])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_each_closed_form_law_equals_the_verifier_enumerated(name, law, options, temperature):
    target_logits, draft_logits = _logit_rows(1), _logit_rows(2)
    closed = position_law(law, target_logits, draft_logits, temperature)
    enumerated = _enumerated_law(target_logits, draft_logits, temperature=temperature, **options)
    torch.testing.assert_close(closed.sum(-1), torch.ones(closed.shape[0], dtype=torch.float64))
    torch.testing.assert_close(closed, enumerated, atol=3.0 / GRID, rtol=0)
    kl, tv = divergences(closed, target_logits, temperature)
    kl_enumerated, tv_enumerated = divergences(enumerated, target_logits, temperature)
    torch.testing.assert_close(kl, kl_enumerated, atol=2e-3, rtol=0)
    torch.testing.assert_close(tv, tv_enumerated, atol=3.0 * VOCAB / GRID, rtol=0)
    if name == "exact":
        assert float(kl.max()) == pytest.approx(0.0, abs=1e-12)
    else:
        assert float(kl.max()) > 1e-3  # every lossy rule moves some of these random positions off the target


def test_the_static_law_is_the_mixture_and_a_heads_weight_is_read_per_position():
    target_logits, draft_logits = _logit_rows(3), _logit_rows(4)
    p, q = target_logits.softmax(-1), draft_logits.softmax(-1)
    weights = torch.tensor([0.0, 0.3, 0.8, 1.0], dtype=torch.float64)
    law = position_law(RuleLaw("static", None, head=object()), target_logits, draft_logits, weight=weights)
    torch.testing.assert_close(law, weights[:, None] * p + (1 - weights[:, None]) * q)
    kl, tv = divergences(law, target_logits)
    assert float(kl[-1]) == pytest.approx(0.0, abs=1e-12) and float(tv[-1]) == pytest.approx(0.0, abs=1e-12)
    torch.testing.assert_close(tv, (1 - weights) * 0.5 * (p - q).abs().sum(-1))
    with pytest.raises(ValueError, match="weight"):
        position_law(RuleLaw("static", None, head=object()), target_logits, draft_logits)


def test_a_draft_the_target_forbids_goes_to_the_residual():
    target_logits = torch.tensor([[0.0, 0.0, 0.0, -200.0, 1.0, -1.0]], dtype=torch.float64)  # id 3: p < 2^-64
    draft_logits = torch.tensor([[0.0, -1.0, 0.0, 2.0, -1.0, 0.0]], dtype=torch.float64)
    closed = position_law(RuleLaw("static", 0.25), target_logits, draft_logits)
    assert float(closed[0, 3]) == 0.0  # never emitted, though nu(3) = 0.75 q(3)
    torch.testing.assert_close(closed, _enumerated_law(target_logits, draft_logits, weight=0.25), atol=3.0 / GRID,
                               rtol=0)


def _acceptance(target_logits, draft_logits, weights):
    """sum_x q(x) a(x) at each position, a(x) the verifier's own accept_prob for a draft x at weight w (per
    position, or [P, V] per drafted token)."""
    positions = target_logits.shape[0]
    weights = torch.as_tensor(weights, dtype=torch.float32).expand(positions, VOCAB).reshape(-1, 1)
    result = verify_logits_reference(torch.arange(VOCAB).repeat(positions).unsqueeze(1),
                                     draft_logits.float().repeat_interleave(VOCAB, 0).unsqueeze(1),
                                     torch.stack([target_logits] * 2, 1).float().repeat_interleave(VOCAB, 0),
                                     weights, seed=0)
    return (draft_logits.softmax(-1) * result.accept_prob.double().view(positions, VOCAB)).sum(-1)


def test_no_rule_beats_the_mixtures_line_on_acceptance_and_tv():
    """TV(out, p) >= acceptance - (1 - TV(p, q)) at each position for any rule that keeps a draft x ~ q or emits
    something else (couple the draft with the output: TV(q, out) <= 1 - acceptance), with equality for the mixture at
    every w, static or per position, and for the gate, whose kept drafts leave the same residual. Seeing tokens only
    costs TV at equal acceptance."""
    target_logits, draft_logits = _logit_rows(7, count=6), _logit_rows(8, count=6)
    line = 1 - 0.5 * (target_logits.softmax(-1) - draft_logits.softmax(-1)).abs().sum(-1)

    def above_line(law, weights, position_weights=None):
        _, tv = divergences(position_law(law, target_logits, draft_logits, weight=position_weights), target_logits)
        return tv - (_acceptance(target_logits, draft_logits, weights) - line)

    per_position = torch.tensor([0.0, 0.2, 0.45, 0.7, 0.9, 1.0], dtype=torch.float64)
    for weight in [0.0, 0.3, 0.75, 1.0]:
        torch.testing.assert_close(above_line(RuleLaw("static", weight), weight), torch.zeros_like(line),
                                   atol=1e-6, rtol=0)
    torch.testing.assert_close(above_line(RuleLaw("static", None, head=object()), per_position.view(-1, 1),
                                          per_position), torch.zeros_like(line), atol=1e-6, rtol=0)
    tokens = torch.arange(VOCAB).repeat(target_logits.shape[0]).unsqueeze(1)
    draft_rows = draft_logits.float().repeat_interleave(VOCAB, 0).unsqueeze(1)
    target_rows = torch.stack([target_logits] * 2, 1).float().repeat_interleave(VOCAB, 0)
    for weight in [1.0, 0.5]:
        gate = Gate(2.0)
        gated = gated_weights(gate, weight, tokens, draft_rows, target_rows, 1.0).view(-1, VOCAB)
        assert bool((gated == 0).any()) and bool((gated == weight).any())  # the gate keeps some drafts, not all
        torch.testing.assert_close(above_line(RuleLaw("gate", weight, margin=gate.margin), gated),
                                   torch.zeros_like(line), atol=1e-6, rtol=0)
    tokens_only = position_law(RuleLaw("static", 0.5, tokens_only=True), target_logits, draft_logits)
    one_hot_accept = (draft_logits.softmax(-1) * (0.5 * target_logits.softmax(-1) + 0.5)).sum(-1)
    gap = divergences(tokens_only, target_logits)[1] - (one_hot_accept - line)
    assert float(gap.min()) > -1e-9 and float(gap.max()) > 0.01


def test_the_temperature_family_has_kl_between_two_temperatures():
    target_logits = _logit_rows(5)
    colder = position_law(RuleLaw("exact"), target_logits, _logit_rows(6), 0.7)
    kl, _ = divergences(colder, target_logits, 1.0)
    p_cold, p = (target_logits / 0.7).softmax(-1), target_logits.softmax(-1)
    torch.testing.assert_close(kl, (p_cold * (p_cold.log() - p.log())).sum(-1))
    assert float(kl.min()) > 0


def test_bad_laws_are_refused_naming_the_setting():
    with pytest.raises(ValueError, match="kind"):
        RuleLaw("fly")
    with pytest.raises(ValueError, match="margin"):
        RuleLaw("gate")
    with pytest.raises(ValueError, match="typical"):
        RuleLaw("typical")


# ---- FLy: the Monte Carlo deferral estimate against its exact value ---------------------------------------------

def _exact_deferral(target, draft, context, fly, weight, temperature):
    """d at the position after ``context``: every draft x and every continuation of W drafts enumerated, each
    following draft's exact-test pass probability multiplied in."""
    from diversed_ext.ops._fly import fly_entropy
    from diversed_ext.research.divergence import _exact_keep

    def probs(model, sequences):
        logits = model(input_ids=torch.tensor(sequences)).logits[:, -1].double()
        return (logits / temperature).softmax(-1)

    vocab = target.config.vocab_size
    p, q = probs(target, [context])[0], probs(draft, [context])[0]
    if float(fly_entropy(p.detach().float().unsqueeze(0), fly.top_k)[0]) < fly.threshold:
        return 0.0
    keep = _exact_keep(p.unsqueeze(0), q.unsqueeze(0), torch.tensor([[weight]], dtype=torch.float64), False)[0]
    total = 0.0
    for x in range(vocab):
        branches = [[x, *tail] for tail in itertools.product(range(vocab), repeat=fly.window)]
        pass_all = torch.ones(len(branches), dtype=torch.float64)
        reach = torch.ones(len(branches), dtype=torch.float64)
        for j in range(fly.window):
            prefixes = [context + branch[:j + 1] for branch in branches]
            p_j, q_j = probs(target, prefixes), probs(draft, prefixes)
            tokens = torch.tensor([branch[j + 1] for branch in branches])
            a_j = _exact_keep(p_j, q_j, torch.full((len(branches), 1), weight, dtype=torch.float64), False)
            pass_all *= a_j.gather(1, tokens[:, None])[:, 0]
            reach *= q_j.gather(1, tokens[:, None])[:, 0]
        total += float(q[x] * (1 - keep[x]) * (reach * pass_all).sum())
    return total


@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_the_fly_deferral_estimate_is_unbiased(weight):
    pytest.importorskip("transformers")
    from diversed_ext.decoding import Fly
    from diversed_ext.research.fly_divergence import deferral_estimates
    from helpers import decoding_llama, noisy_copy

    vocab = 8
    target = decoding_llama(11, vocab, sharpness=4.0)
    draft = noisy_copy(target, 12, scale=1.0)
    fly = Fly(window=2 if weight == 1.0 else 1, threshold=0.0)
    context = [1, 5, 2]
    with torch.no_grad():
        exact = _exact_deferral(target, draft, context, fly, weight, 1.0)
    assert exact > 0.02  # a case where FLy defers often enough to test
    with torch.no_grad():
        logits = [model(input_ids=torch.tensor([context])).logits[:, -1] for model in (target, draft)]
        generator = torch.Generator().manual_seed(0)
        samples = torch.stack([deferral_estimates(target, draft, context + [0], *logits, fly, weight=weight,
                                                  generator=generator) for _ in range(1500)])
    error = float(samples.std()) / math.sqrt(samples.numel())
    assert abs(float(samples.mean()) - exact) < 4 * error
    high_bar = Fly(window=2, threshold=50.0)  # no entropy reaches it: nothing defers
    assert float(deferral_estimates(target, draft, context + [0], *logits, high_bar, weight=weight)[0]) == 0.0


def _reference_deferrals(target, draft, context, count, fly, weight, generator):
    """deferral_estimates at the last ``count`` positions of ``context`` with every distribution read by a full
    forward over its own context (no cache), drawing from ``generator`` in the estimate's order: each position's
    draft, then each rolled-out branch's W drafts, the last position's branch first."""
    from diversed_ext.ops._fly import fly_entropy
    from diversed_ext.research.divergence import _exact_keep

    def probs(model, sequence):
        return model(input_ids=torch.tensor([sequence])).logits[0, -1].double().softmax(-1)

    def keep(p, q, token):
        return float(_exact_keep(p[None], q[None], torch.tensor([[weight]], dtype=torch.float64), False)[0, token])

    start = len(context) - count
    p = torch.stack([probs(target, context[:start + t]) for t in range(count)])
    q = torch.stack([probs(draft, context[:start + t]) for t in range(count)])
    drafted = torch.multinomial(q.float(), 1, generator=generator)[:, 0].tolist()
    entropy = fly_entropy(p.float(), fly.top_k)
    estimate = [(1 - keep(p[t], q[t], drafted[t])) if entropy[t] >= fly.threshold else 0.0 for t in range(count)]
    for t in reversed(range(count)):
        branch = context[:start + t] + [drafted[t]]
        for _ in range(fly.window if estimate[t] > 0 else 0):
            q_next, p_next = probs(draft, branch), probs(target, branch)
            token = int(torch.multinomial(q_next.float()[None], 1, generator=generator)[0, 0])
            estimate[t] *= keep(p_next, q_next, token)
            branch.append(token)
    return torch.tensor(estimate, dtype=torch.float64)


@pytest.mark.parametrize("runner", ["lean", "transformers"])
@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_fly_branches_read_their_prefix_from_the_cache_as_a_full_forward_would(runner, weight):
    """Every branch of a long completion starts from the caches of the context pass, cropped last position first:
    a crop that kept a stale position, or dropped one a later branch reads, changes a branch's p or q and so its
    pass probabilities. Checked against full forwards on identical draws, over two samples (the second fills its
    own caches), with the lean Llama forward's static caches and with transformers' caches."""
    pytest.importorskip("transformers")
    from diversed_ext.decoding import Fly
    from diversed_ext.decoding.runners import HFRunner
    from diversed_ext.forward import LlamaRunner
    from diversed_ext.research.fly_divergence import fly_divergences, fly_runners
    from helpers import decoding_llama, noisy_copy, require_forward_ops

    if runner == "lean":
        require_forward_ops()
    target = decoding_llama(21, 8, sharpness=4.0, layers=2)
    draft = noisy_copy(target, 22, scale=1.0)
    runners = (fly_runners(target, draft) if runner == "lean"
               else tuple(HFRunner(model, torch.device("cpu")) for model in (target, draft)))
    assert all(isinstance(each, LlamaRunner if runner == "lean" else HFRunner) for each in runners)
    prompt, completion = [3, 1, 4, 1, 5], [2, 6, 5, 3, 5, 0, 7]
    fly = Fly(window=2, threshold=0.0)
    for seed in range(3):
        deferral, tv = fly_divergences(target, draft, [prompt], [completion], fly, weight=weight, samples=2,
                                       seed=seed, runners=runners)[0]
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            expected = sum(_reference_deferrals(target, draft, prompt + completion, len(completion), fly, weight,
                                                generator) for _ in range(2)) / 2
        assert expected.max() > 0.05  # branches were rolled out and mostly passed: the check has teeth
        assert deferral == pytest.approx(float(expected.mean()), abs=1e-6)
        assert tv >= deferral
