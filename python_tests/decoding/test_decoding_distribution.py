"""The decoding loop's output law and acceptance statistics against their exact values, seeds, and prompts
(tiny random Llama pairs from helpers/models.py). The tests that take ``device`` also run the loop on CUDA where a GPU
is visible."""

import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("scipy.stats")

from diversed_ext.decoding import SpeculativeDecoder  # noqa: E402
from helpers import (P_VALUE_FLOOR, PROMPT, SMALL_VOCAB, chi_square_cells_p_value, exact_joint,  # noqa: E402
                     exact_speculative_joint, models_on_device, next_token_probs)

# ---- helpers ---------------------------------------------------------------------------------------------------------


def sample_continuations(decoder, prompt, length, count):
    return [tuple(decoder.generate(prompt, max_new_tokens=length, seed=seed).sequences[0].tolist())
            for seed in range(count)]


# ---- exactness -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_draft", [1, 3, 6])
def test_greedy_sd_equals_greedy_ar_token_for_token(wide_pair, max_draft, device):
    target, draft = models_on_device(wide_pair, device)
    ar = SpeculativeDecoder(target, method="ar", temperature=0)
    sd = SpeculativeDecoder(target, draft, method="sd", max_draft=max_draft, temperature=0)
    prompts = [PROMPT, [5], [7, 7, 8, 30, 2, 11]]
    ar_tokens = ar.generate(prompts, max_new_tokens=24).sequences
    sd_output = sd.generate(prompts, max_new_tokens=24)
    for ar_row, sd_row in zip(ar_tokens, sd_output.sequences):
        assert sd_row.tolist() == ar_row.tolist()
    summary = sd_output.summary()
    assert 0 < summary.accepted < summary.drafted  # both paths ran: some drafts kept, some corrected
    with torch.inference_mode():
        reference = target.generate(torch.tensor([PROMPT], device=device), max_new_tokens=24, do_sample=False,
                                    pad_token_id=0)[0, len(PROMPT):]
    assert ar_tokens[0].tolist() == reference.tolist()


def test_sampled_sd_follows_the_target_distribution(small_pair, device):
    target, draft = small_pair  # the exact laws are computed on the CPU, wherever the decoder runs
    decoder = SpeculativeDecoder(*models_on_device(small_pair, device), method="sd", max_draft=2, temperature=1.0)
    samples = sample_continuations(decoder, PROMPT, 3, 2000)
    target_joint = exact_joint(target, draft, PROMPT, 3, SMALL_VOCAB)
    assert chi_square_cells_p_value(samples, target_joint) > P_VALUE_FLOOR
    # The same samples must clearly reject the draft's own distribution, or the test could not fail.
    draft_joint = exact_joint(target, draft, PROMPT, 3, SMALL_VOCAB, weight=0.0)
    assert chi_square_cells_p_value(samples, draft_joint) < 1e-6


def test_static_ensemble_follows_the_mixture(small_pair):
    target, draft = small_pair
    weight, temperature = 0.5, 0.8
    decoder = SpeculativeDecoder(target, draft, method="static", weight=weight, max_draft=3, temperature=temperature)
    samples = sample_continuations(decoder, PROMPT, 3, 2000)
    law = exact_speculative_joint(target, draft, PROMPT, 3, SMALL_VOCAB, weight, temperature, max_draft=3)
    assert abs(sum(law.values()) - 1) < 1e-6  # float32 softmax rounding
    assert chi_square_cells_p_value(samples, law) > P_VALUE_FLOOR
    # The test can fail: the same samples reject the target alone and the draft alone.
    target_only = exact_joint(target, draft, PROMPT, 3, SMALL_VOCAB, temperature=temperature)
    assert chi_square_cells_p_value(samples, target_only) < 1e-6
    draft_only = exact_joint(target, draft, PROMPT, 3, SMALL_VOCAB, weight=0.0, temperature=temperature)
    assert chi_square_cells_p_value(samples, draft_only) < 1e-6


def test_exact_speculative_law_is_the_target_for_sd(small_pair):
    # With w = 1 the block-aware law collapses to the product of target distributions (standard SD is exact).
    target, draft = small_pair
    law = exact_speculative_joint(target, draft, PROMPT, 3, SMALL_VOCAB, 1.0, 1.0, max_draft=2)
    product = exact_joint(target, draft, PROMPT, 3, SMALL_VOCAB)
    for cell, probability in product.items():
        assert abs(law[cell] - probability) < 1e-6


def exact_acceptance_counts(target, draft, prompt, length, vocab, weight, max_draft):
    """Exact expected (accepted, drafted) of one generation of ``length`` tokens, walking every round's branches:
    a round plans k = min(max_draft, remaining - 1) drafts (all counted as drafted); position i keeps its draft with
    mass min(q, nu) and corrects with mass max(0, nu - q); a round that keeps all k ends with a bonus from p."""
    cache = {}

    def probabilities(prefix):
        if prefix not in cache:
            context = [prompt + list(prefix)]
            cache[prefix] = (next_token_probs(target, context)[0].double(), next_token_probs(draft, context)[0].double())
        return cache[prefix]

    def expected(prefix, index, drafts):
        if len(prefix) == length:
            return 0.0, 0.0
        if index == 0:
            drafts = min(max_draft, length - len(prefix) - 1)
        p, q = probabilities(prefix)
        if index == drafts:  # bonus token, or a plain target step when no draft fits
            pairs = [expected(prefix + (token,), 0, 0) for token in range(vocab)]
            return (sum(float(p[t]) * pairs[t][0] for t in range(vocab)),
                    sum(float(p[t]) * pairs[t][1] for t in range(vocab)))
        nu = weight * p + (1 - weight) * q
        keep, correct = torch.minimum(q, nu), (nu - q).clamp(min=0)
        accepted, drafted = 0.0, float(drafts) if index == 0 else 0.0
        for token in range(vocab):
            if keep[token] > 0:
                more_accepted, more_drafted = expected(prefix + (token,), index + 1, drafts)
                accepted += float(keep[token]) * (1 + more_accepted)
                drafted += float(keep[token]) * more_drafted
            if correct[token] > 0:
                more_accepted, more_drafted = expected(prefix + (token,), 0, 0)
                accepted += float(correct[token]) * more_accepted
                drafted += float(correct[token]) * more_drafted
        return accepted, drafted

    return expected((), 0, 0)


@pytest.mark.parametrize("method,weight", [("sd", 1.0), ("static", 0.5)])
def test_acceptance_counts_match_their_exact_expectation(small_pair, method, weight):
    """The loop's acceptance statistics, not just its output law: mean accepted and drafted drafts per generation
    against their exact expectations. (A loop that drafted from a stale context would still emit the right law for
    sd, but accept less.)"""
    target, draft = small_pair
    length, max_draft, runs = 5, 3, 1000
    exact_accepted, exact_drafted = exact_acceptance_counts(target, draft, PROMPT, length, SMALL_VOCAB, weight,
                                                            max_draft)
    decoder = SpeculativeDecoder(target, draft, method=method, weight=None if method == "sd" else weight,
                                 max_draft=max_draft)
    summaries = [decoder.generate(PROMPT, max_new_tokens=length, seed=seed).summary() for seed in range(runs)]
    for values, exact in (([s.accepted for s in summaries], exact_accepted),
                          ([s.drafted for s in summaries], exact_drafted)):
        mean = sum(values) / runs
        spread = math.sqrt(sum((value - mean) ** 2 for value in values) / (runs - 1))
        assert abs(mean - exact) < 4 * spread / math.sqrt(runs) + 1e-9, (mean, exact)


def test_ar_sampling_follows_the_target(small_pair):
    target, _ = small_pair
    decoder = SpeculativeDecoder(target, method="ar", temperature=1.0)
    samples = sample_continuations(decoder, PROMPT, 2, 1500)
    assert chi_square_cells_p_value(samples, exact_joint(target, None, PROMPT, 2, SMALL_VOCAB)) > P_VALUE_FLOOR


def test_static_weight_zero_accepts_every_draft(wide_pair):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="static", weight=0.0, max_draft=4, temperature=1.0)
    output = decoder.generate([PROMPT, [9, 4]], max_new_tokens=30, seed=11)
    for rounds in output.rounds:
        assert all(stats.accepted == stats.drafted for stats in rounds)
        assert all(stats.emitted == stats.drafted + 1 for stats in rounds)
        assert [stats.drafted for stats in rounds] == [4] * 6  # 5 tokens a round, K capped to leave room for the last


def test_same_seed_same_output_and_different_seed_differs(wide_pair):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="static", weight=0.7, max_draft=3)
    first = decoder.generate(PROMPT, max_new_tokens=40, seed=3).sequences[0]
    again = decoder.generate(PROMPT, max_new_tokens=40, seed=3).sequences[0]
    other = decoder.generate(PROMPT, max_new_tokens=40, seed=4).sequences[0]
    assert first.tolist() == again.tolist()
    assert first.tolist() != other.tolist()
    torch.manual_seed(8)
    unseeded = decoder.generate(PROMPT, max_new_tokens=40).sequences[0]
    torch.manual_seed(8)
    assert decoder.generate(PROMPT, max_new_tokens=40).sequences[0].tolist() == unseeded.tolist()


def test_several_prompts_run_one_after_another_with_seed_plus_index(wide_pair):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="sd", max_draft=3)
    prompts = [PROMPT, [4], torch.tensor([6, 1, 1])]
    output = decoder.generate(prompts, max_new_tokens=12, seed=20)
    assert len(output.generations) == 3
    for index, prompt in enumerate(prompts):
        alone = decoder.generate(prompt, max_new_tokens=12, seed=20 + index).sequences[0]
        assert output.sequences[index].tolist() == alone.tolist()
    padded = output.padded()
    assert padded.shape == (3, 12) and padded.dtype == torch.int64
    assert [generation.prompt_length for generation in output.generations] == [4, 1, 3]
    batch = decoder.generate(torch.tensor([[1, 2], [3, 4]]), max_new_tokens=5, seed=0)
    assert len(batch.sequences) == 2
