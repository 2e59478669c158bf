"""The statistics the tests share: two chi-square tests and the exact output laws of the decoding loop.

The two chi-square tests answer different questions, so both stay: chi_square_tokens_p_value tests single token ids
(a tensor) against a probability vector and refuses any token of probability 0; chi_square_cells_p_value tests whole
continuations (hashable samples) against a {cell: probability} law and pools the cells too rare for the test.
scipy is imported when a test is run, so a test file keeps its own pytest.importorskip("scipy.stats").
"""

import torch

P_VALUE_FLOOR = 1e-4  # fixed seeds make each test deterministic; this only guards against a marginal seed
SMALL_VOCAB = 4  # joint distributions of 3 tokens stay small enough (64 cells) for a chi-square test


def chi_square_tokens_p_value(samples, expected_probs):
    """Pearson chi-square of the token ids `samples` (an int64 tensor) against the probability vector
    `expected_probs`; a sampled token of probability 0 fails at once."""
    from scipy.stats import chisquare

    counts = torch.bincount(samples, minlength=expected_probs.numel()).double()
    keep = expected_probs > 0
    assert counts[~keep].sum() == 0, "a token with zero probability was emitted"
    kept_probs = expected_probs[keep].double()
    expected = kept_probs / kept_probs.sum() * counts[keep].sum()
    return chisquare(counts[keep].numpy(), expected.numpy()).pvalue


def chi_square_cells_p_value(samples, expected_probs):
    """Pearson chi-square of sample counts against probabilities; cells expecting < 5 are pooled into one."""
    from scipy.stats import chisquare

    counts = {}
    for sample in samples:
        counts[sample] = counts.get(sample, 0) + 1
    total = len(samples)
    observed, expected, pooled_observed, pooled_expected = [], [], 0, 0.0
    for cell, prob in expected_probs.items():
        if prob * total >= 5:
            observed.append(counts.get(cell, 0))
            expected.append(prob * total)
        else:
            pooled_observed += counts.get(cell, 0)
            pooled_expected += prob * total
    if pooled_expected > 0:
        observed.append(pooled_observed)
        expected.append(pooled_expected)
    scale = sum(observed) / sum(expected)  # float rounding of the probabilities
    return chisquare(observed, [value * scale for value in expected]).pvalue


@torch.inference_mode()
def next_token_probs(model, sequences, temperature=1.0):
    """softmax(logits / T) of the last position of every sequence (all the same length): [N, V]."""
    logits = model(torch.tensor(sequences)).logits[:, -1].float()
    return (logits / temperature).softmax(-1)


def exact_joint(target, draft, prompt, length, vocab, weight=1.0, temperature=1.0):
    """Probability of every continuation of ``length`` tokens under nu = w p + (1 - w) q, position by position."""
    joint = {(): 1.0}
    for _ in range(length):
        prefixes = list(joint)
        contexts = [prompt + list(prefix) for prefix in prefixes]
        nu = weight * next_token_probs(target, contexts, temperature)
        if weight < 1:
            nu = nu + (1 - weight) * next_token_probs(draft, contexts, temperature)
        joint = {prefix + (token,): joint[prefix] * float(nu[row, token])
                 for row, prefix in enumerate(prefixes) for token in range(vocab)}
    return joint


def exact_speculative_joint(target, draft, prompt, length, vocab, weight, temperature, max_draft):
    """Exact law of what the loop emits, round by round.

    Within a round of k = min(max_draft, remaining - 1) drafts, position i emits x and goes on with probability
    min(q, nu)(x) (accepted draft) or emits x and ends the round with probability max(0, nu - q)(x) (correction); these
    add up to nu(x). A round that keeps all k drafts ends with the bonus token, drawn from p, not nu. So for w < 1 the
    output is not a product of nu's: the tokens that happen to be bonus tokens follow the target."""
    joint = {}

    def walk(prefix, probability, index, drafts):
        if len(prefix) == length:
            joint[prefix] = joint.get(prefix, 0.0) + probability
            return
        if index == 0:
            drafts = min(max_draft, length - len(prefix) - 1)
        context = [prompt + list(prefix)]
        p = next_token_probs(target, context, temperature)[0].double()
        if index == drafts:  # the bonus token
            for token in range(vocab):
                walk(prefix + (token,), probability * float(p[token]), 0, 0)
            return
        q = next_token_probs(draft, context, temperature)[0].double()
        nu = weight * p + (1 - weight) * q
        keep, correct = torch.minimum(q, nu), (nu - q).clamp(min=0)
        for token in range(vocab):
            walk(prefix + (token,), probability * float(keep[token]), index + 1, drafts)
            walk(prefix + (token,), probability * float(correct[token]), 0, 0)

    walk((), 1.0, 0, 0)
    return joint
