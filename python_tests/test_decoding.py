"""The speculative decoding loop on tiny random Llama pairs (no downloads).

The target is a random one-layer Llama with a sharpened LM head; the draft is the same model with noise added to every
weight, so the two agree often but not always (total variation about 0.4) and every verifier path runs.
"""

import copy
import itertools
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
scipy_stats = pytest.importorskip("scipy.stats")

from diversed_ext.decoding import GenerationOutput, SpeculativeDecoder, summarize  # noqa: E402

SMALL_VOCAB = 4  # joint distributions of 3 tokens stay small enough (64 cells) for a chi-square test
WIDE_VOCAB = 32
PROMPT = [1, 3, 0, 2]
P_VALUE_FLOOR = 1e-4  # fixed seeds make each test deterministic; this only has to pass for a correct sampler


def tiny_llama(seed, vocab, sharpness=20.0, layers=1):
    """A random Llama with peaked next-token distributions (the LM head scaled up)."""
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model


def noisy_copy(model, seed, scale=0.5):
    """The model with Gaussian noise of ``scale`` times each weight's spread added: a related but different draft."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            if parameter.numel() > 1:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.std())
    return draft


@pytest.fixture(scope="module")
def small_pair():
    target = tiny_llama(0, SMALL_VOCAB)
    return target, noisy_copy(target, 1)


@pytest.fixture(scope="module")
def wide_pair():
    target = tiny_llama(2, WIDE_VOCAB, sharpness=30.0, layers=2)
    return target, noisy_copy(target, 3)


class RecordingHead(torch.nn.Module):
    """Stand-in for the DIVERSED head: returns a constant weight and keeps every input it saw."""

    def __init__(self, value):
        super().__init__()
        self.value = value
        self.calls = []

    def forward(self, draft_hidden, target_hidden):
        self.calls.append((draft_hidden.clone(), target_hidden.clone()))
        return torch.full(draft_hidden.shape[:2], self.value)


class LinearHead(torch.nn.Module):
    """A tiny learned-style head: sigmoid of a linear map of both hidden states."""

    def __init__(self, draft_size, target_size):
        super().__init__()
        torch.manual_seed(5)
        self.linear = torch.nn.Linear(draft_size + target_size, 1)

    def forward(self, draft_hidden, target_hidden):
        return torch.sigmoid(self.linear(torch.cat([draft_hidden, target_hidden], dim=-1))).squeeze(-1)


# ---- helpers ---------------------------------------------------------------------------------------------------------


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


def exact_speculative_joint(target, draft, prompt, length, vocab, weight, temperature, num_draft):
    """Exact law of what the loop emits, round by round.

    Within a round of k = min(num_draft, remaining - 1) drafts, position i emits x and goes on with probability
    min(q, nu)(x) (accepted draft) or emits x and ends the round with probability max(0, nu - q)(x) (correction); these
    add up to nu(x). A round that keeps all k drafts ends with the bonus token, drawn from p, not nu. So for w < 1 the
    output is not a product of nu's: the tokens that happen to be bonus tokens follow the target."""
    joint = {}

    def walk(prefix, probability, index, drafts):
        if len(prefix) == length:
            joint[prefix] = joint.get(prefix, 0.0) + probability
            return
        if index == 0:
            drafts = min(num_draft, length - len(prefix) - 1)
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


def chi_square_p_value(samples, expected_probs):
    """Pearson chi-square of sample counts against probabilities; cells expecting < 5 are pooled into one."""
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
    return scipy_stats.chisquare(observed, [value * scale for value in expected]).pvalue


def sample_continuations(decoder, prompt, length, count):
    return [tuple(decoder.generate(prompt, max_new_tokens=length, seed=seed).sequences[0].tolist())
            for seed in range(count)]


# ---- exactness -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_draft", [1, 3, 6])
def test_greedy_sd_equals_greedy_ar_token_for_token(wide_pair, num_draft):
    target, draft = wide_pair
    ar = SpeculativeDecoder(target, method="ar", temperature=0)
    sd = SpeculativeDecoder(target, draft, method="sd", num_draft=num_draft, temperature=0)
    prompts = [PROMPT, [5], [7, 7, 8, 30, 2, 11]]
    ar_tokens = ar.generate(prompts, max_new_tokens=24).sequences
    sd_output = sd.generate(prompts, max_new_tokens=24)
    for ar_row, sd_row in zip(ar_tokens, sd_output.sequences):
        assert sd_row.tolist() == ar_row.tolist()
    summary = sd_output.summary()
    assert 0 < summary.accepted < summary.drafted  # both paths ran: some drafts kept, some corrected
    with torch.inference_mode():
        reference = target.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False,
                                    pad_token_id=0)[0, len(PROMPT):]
    assert ar_tokens[0].tolist() == reference.tolist()


def test_sampled_sd_follows_the_target_distribution(small_pair):
    target, draft = small_pair
    decoder = SpeculativeDecoder(target, draft, method="sd", num_draft=2, temperature=1.0)
    samples = sample_continuations(decoder, PROMPT, 3, 2000)
    target_joint = exact_joint(target, draft, PROMPT, 3, SMALL_VOCAB)
    assert chi_square_p_value(samples, target_joint) > P_VALUE_FLOOR
    # The same samples must clearly reject the draft's own distribution, or the test could not fail.
    draft_joint = exact_joint(target, draft, PROMPT, 3, SMALL_VOCAB, weight=0.0)
    assert chi_square_p_value(samples, draft_joint) < 1e-6


def test_static_ensemble_follows_the_mixture(small_pair):
    target, draft = small_pair
    weight, temperature = 0.5, 0.8
    decoder = SpeculativeDecoder(target, draft, method="static", weight=weight, num_draft=3, temperature=temperature)
    samples = sample_continuations(decoder, PROMPT, 3, 2000)
    law = exact_speculative_joint(target, draft, PROMPT, 3, SMALL_VOCAB, weight, temperature, num_draft=3)
    assert abs(sum(law.values()) - 1) < 1e-6  # float32 softmax rounding
    assert chi_square_p_value(samples, law) > P_VALUE_FLOOR
    # The test can fail: the same samples reject the target alone and the draft alone.
    target_only = exact_joint(target, draft, PROMPT, 3, SMALL_VOCAB, temperature=temperature)
    assert chi_square_p_value(samples, target_only) < 1e-6
    draft_only = exact_joint(target, draft, PROMPT, 3, SMALL_VOCAB, weight=0.0, temperature=temperature)
    assert chi_square_p_value(samples, draft_only) < 1e-6


def test_exact_speculative_law_is_the_target_for_sd(small_pair):
    # With w = 1 the block-aware law collapses to the product of target distributions (standard SD is exact).
    target, draft = small_pair
    law = exact_speculative_joint(target, draft, PROMPT, 3, SMALL_VOCAB, 1.0, 1.0, num_draft=2)
    product = exact_joint(target, draft, PROMPT, 3, SMALL_VOCAB)
    for cell, probability in product.items():
        assert abs(law[cell] - probability) < 1e-6


def exact_acceptance_counts(target, draft, prompt, length, vocab, weight, num_draft):
    """Exact expected (accepted, drafted) of one generation of ``length`` tokens, walking every round's branches:
    a round plans k = min(num_draft, remaining - 1) drafts (all counted as drafted); position i keeps its draft with
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
            drafts = min(num_draft, length - len(prefix) - 1)
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
    length, num_draft, runs = 5, 3, 1000
    exact_accepted, exact_drafted = exact_acceptance_counts(target, draft, PROMPT, length, SMALL_VOCAB, weight,
                                                            num_draft)
    decoder = SpeculativeDecoder(target, draft, method=method, weight=None if method == "sd" else weight,
                                 num_draft=num_draft)
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
    assert chi_square_p_value(samples, exact_joint(target, None, PROMPT, 2, SMALL_VOCAB)) > P_VALUE_FLOOR


def test_static_weight_zero_accepts_every_draft(wide_pair):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="static", weight=0.0, num_draft=4, temperature=1.0)
    output = decoder.generate([PROMPT, [9, 4]], max_new_tokens=30, seed=11)
    for rounds in output.rounds:
        assert all(stats.accepted == stats.drafted for stats in rounds)
        assert all(stats.emitted == stats.drafted + 1 for stats in rounds)
        assert [stats.drafted for stats in rounds] == [4] * 6  # 5 tokens a round, K capped to leave room for the last


def test_same_seed_same_output_and_different_seed_differs(wide_pair):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="static", weight=0.7, num_draft=3)
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
    decoder = SpeculativeDecoder(target, draft, method="sd", num_draft=3)
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


# ---- caches ----------------------------------------------------------------------------------------------------------


@torch.inference_mode()
def _logits_from_cache(runner, cache, tokens, cached):
    """The next-token logits after feeding the uncached tokens to a copy of the cache, with the decoder's runner (the
    model's own forward, or the fast Llama path)."""
    logits, _, _ = runner(tokens[cached:], copy.deepcopy(cache), 1, False)
    return logits[-1]


@pytest.mark.parametrize("fast_forward", [False, True], ids=["hf-forward", "fast-forward"])
@pytest.mark.parametrize("method,weight", [("sd", None), ("static", 0.5)])
def test_cropped_caches_give_the_logits_of_a_fresh_forward(wide_pair, method, weight, fast_forward):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method=method, weight=weight, num_draft=4, temperature=1.0,
                                 fast_forward=fast_forward)
    state = decoder.start(PROMPT, max_new_tokens=40, seed=1)
    rejections = 0
    while not state.finished:
        stats = decoder.step(state)
        rejections += stats.accepted < stats.drafted
        if state.finished:
            break
        assert state.target_cached == len(state.tokens) - 1
        assert state.target_cache.get_seq_length() == state.target_cached
        assert len(state.tokens) - 2 <= state.draft_cached <= len(state.tokens) - 1
        assert state.draft_cache.get_seq_length() == state.draft_cached
        with torch.inference_mode():
            fresh_target = target(torch.tensor([state.tokens])).logits[0, -1]
            fresh_draft = draft(torch.tensor([state.tokens])).logits[0, -1]
        cached_target = _logits_from_cache(decoder._target_runner, state.target_cache, state.tokens,
                                           state.target_cached)
        cached_draft = _logits_from_cache(decoder._draft_runner, state.draft_cache, state.tokens, state.draft_cached)
        torch.testing.assert_close(cached_target, fresh_target, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cached_draft, fresh_draft, rtol=1e-4, atol=1e-4)
    assert rejections > 0  # the crop after a rejection ran


class ForwardCounter:
    """Counts the token positions a model reads, through a forward pre-hook."""

    def __init__(self, model):
        self.tokens_read = []
        self.handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        input_ids = args[0] if args else kwargs["input_ids"]
        self.tokens_read.append(input_ids.shape[1])

    def remove(self):
        self.handle.remove()


class RunnerCounter:
    """Counts the token positions a decoder's runner feeds its model (the fast Llama path runs no module hooks)."""

    def __init__(self, decoder, attribute):
        self.tokens_read = []
        self.decoder, self.attribute = decoder, attribute
        self.runner = getattr(decoder, attribute)
        setattr(decoder, attribute, self)

    def __call__(self, feed, cache, num_logits, want_hidden):
        self.tokens_read.append(len(feed))
        return self.runner(feed, cache, num_logits, want_hidden)

    def remove(self):
        setattr(self.decoder, self.attribute, self.runner)


@pytest.mark.parametrize("fast_forward", [False, True], ids=["hf-forward", "fast-forward"])
def test_the_prefix_is_never_recomputed(wide_pair, fast_forward):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="sd", num_draft=3, fast_forward=fast_forward)
    if fast_forward:
        target_counter = RunnerCounter(decoder, "_target_runner")
        draft_counter = RunnerCounter(decoder, "_draft_runner")
    else:
        target_counter, draft_counter = ForwardCounter(target), ForwardCounter(draft)
    try:
        output = decoder.generate(PROMPT, max_new_tokens=30, seed=2)
    finally:
        target_counter.remove()
        draft_counter.remove()
    rounds = output.rounds[0]
    drafted = [stats.drafted for stats in rounds]
    # Round 0 reads the prompt and its drafts; every later round reads the one pending token and its drafts.
    assert target_counter.tokens_read == [len(PROMPT) + drafted[0]] + [1 + k for k in drafted[1:]]
    # The draft's first pass of a round reads what it has not seen: the prompt, the pending token, or (after a fully
    # accepted block, whose last draft it never read) two tokens; every later pass reads the previous draft.
    expected_reads = []
    for index, stats in enumerate(rounds):
        if stats.drafted == 0:
            continue
        previous = rounds[index - 1] if index else None
        first = len(PROMPT) if previous is None else 2 if previous.accepted == previous.drafted > 0 else 1
        expected_reads += [first] + [1] * (stats.drafted - 1)
    assert draft_counter.tokens_read == expected_reads
    assert any(stats.accepted < stats.drafted for stats in rounds)
    assert any(stats.accepted == stats.drafted for stats in rounds)


# ---- stopping --------------------------------------------------------------------------------------------------------


def test_max_new_tokens_edges(wide_pair):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="static", weight=0.3, num_draft=5)
    empty = decoder.generate(PROMPT, max_new_tokens=0, seed=0).generations[0]
    assert empty.tokens.numel() == 0 and empty.rounds == [] and empty.finish_reason == "length"
    one = decoder.generate(PROMPT, max_new_tokens=1, seed=0).generations[0]
    assert len(one.tokens) == 1 and len(one.rounds) == 1 and one.rounds[0].drafted == 0
    for length, seed in itertools.product([2, 5, 6, 7, 13], range(4)):
        generation = decoder.generate(PROMPT, max_new_tokens=length, seed=seed).generations[0]
        assert len(generation.tokens) == length and generation.finish_reason == "length"
        assert all(stats.drafted <= length - 1 for stats in generation.rounds)


def test_greedy_stops_right_after_eos(wide_pair):
    target, draft = wide_pair
    ar = SpeculativeDecoder(target, method="ar", temperature=0)
    full = ar.generate(PROMPT, max_new_tokens=30).sequences[0].tolist()
    # An EOS whose first occurrence is a few tokens in: the output must stop right there, with the EOS kept.
    position = next(index for index, token in enumerate(full) if index >= 2 and token not in full[:index])
    eos = full[position]
    for method, weight in [("ar", None), ("sd", None), ("static", 1.0)]:
        decoder = SpeculativeDecoder(target, draft if method != "ar" else None, method=method, weight=weight,
                                     num_draft=4, temperature=0)
        generation = decoder.generate(PROMPT, max_new_tokens=30, eos_token_id=eos).generations[0]
        assert generation.tokens.tolist() == full[:position + 1]
        assert generation.finish_reason == "eos"


@pytest.mark.parametrize("weight", [0.0, 0.6, 1.0])
def test_sampled_output_never_runs_past_eos(wide_pair, weight):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="static", weight=weight, num_draft=4)
    eos_ids = [5, 9]
    reasons = set()
    for seed in range(12):
        generation = decoder.generate(PROMPT, max_new_tokens=25, eos_token_id=eos_ids, seed=seed).generations[0]
        tokens = generation.tokens.tolist()
        reasons.add(generation.finish_reason)
        assert not set(tokens[:-1]) & set(eos_ids)
        if generation.finish_reason == "eos":
            assert tokens[-1] in eos_ids
        else:
            assert len(tokens) == 25
        assert sum(stats.emitted for stats in generation.rounds) == len(tokens)
        # A drafted EOS ends the draft: nothing past it is ever proposed.
        assert all(stats.drafted <= 4 for stats in generation.rounds)
    assert "eos" in reasons


# ---- the head --------------------------------------------------------------------------------------------------------


def test_head_sees_the_last_hidden_states_of_both_models(wide_pair):
    target, draft = wide_pair
    head = RecordingHead(0.0)  # w = 0 keeps every draft, so the drafts are the output tokens
    decoder = SpeculativeDecoder(target, draft, method="diversed", head=head, num_draft=3)
    output = decoder.generate(PROMPT, max_new_tokens=14, seed=0)
    tokens = PROMPT + output.sequences[0].tolist()
    with torch.inference_mode():
        target_hidden = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
        draft_hidden = draft(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
    context = len(PROMPT)
    rounds = output.rounds[0]
    assert len(head.calls) == sum(stats.drafted > 0 for stats in rounds)
    for stats, (seen_draft, seen_target) in zip(rounds, head.calls):
        k = stats.drafted
        assert seen_draft.shape == (1, k, draft.config.hidden_size)
        assert seen_target.shape == (1, k, target.config.hidden_size)
        # Draft i is predicted at position context - 1 + i, the position whose hidden state the head must get.
        positions = slice(context - 1, context - 1 + k)
        torch.testing.assert_close(seen_target[0], target_hidden[positions], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(seen_draft[0], draft_hidden[positions], rtol=1e-4, atol=1e-4)
        context += stats.emitted


def test_head_weight_one_reproduces_sd_and_zero_accepts_all(wide_pair):
    target, draft = wide_pair
    sd = SpeculativeDecoder(target, draft, method="sd", num_draft=3).generate(PROMPT, max_new_tokens=30, seed=9)
    ones = SpeculativeDecoder(target, draft, method="diversed", head=RecordingHead(1.0), num_draft=3)
    assert ones.generate(PROMPT, max_new_tokens=30, seed=9).sequences[0].tolist() == sd.sequences[0].tolist()
    zeros = SpeculativeDecoder(target, draft, method="diversed", head=RecordingHead(0.0), num_draft=3)
    rounds = zeros.generate(PROMPT, max_new_tokens=30, seed=9).rounds[0]
    assert all(stats.accepted == stats.drafted for stats in rounds)
    assert all(stats.head_seconds >= 0 for stats in rounds)


def test_learned_style_head_runs_end_to_end(wide_pair):
    target, draft = wide_pair
    head = LinearHead(draft.config.hidden_size, target.config.hidden_size)
    decoder = SpeculativeDecoder(target, draft, method="diversed", head=head, num_draft=3)
    output = decoder.generate([PROMPT, [2, 2]], max_new_tokens=20, seed=1)
    assert [len(tokens) for tokens in output.sequences] == [20, 20]


def test_head_returning_the_wrong_shape_is_rejected(wide_pair):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="diversed", head=lambda d, t: torch.ones(1, 1, 7),
                                 num_draft=3)
    with pytest.raises(ValueError, match="head must return one weight per drafted token"):
        decoder.generate(PROMPT, max_new_tokens=10, seed=0)


# ---- statistics ------------------------------------------------------------------------------------------------------


def test_round_statistics_add_up(wide_pair):
    target, draft = wide_pair
    output = SpeculativeDecoder(target, draft, method="static", weight=0.5, num_draft=3).generate(
        [PROMPT, [3]], max_new_tokens=25, seed=4)
    summary = output.summary()
    rounds = [stats for generation_rounds in output.rounds for stats in generation_rounds]
    assert summary.new_tokens == sum(stats.emitted for stats in rounds) == 50
    assert summary.target_passes == len(rounds)
    assert 0 < summary.acceptance_rate <= 1
    assert summary.tokens_per_pass == pytest.approx(50 / len(rounds))
    for stats in rounds:
        assert stats.accepted <= stats.drafted <= 3
        assert min(stats.draft_seconds, stats.target_seconds, stats.verify_seconds, stats.head_seconds) >= 0
        assert stats.round_seconds >= stats.draft_seconds + stats.target_seconds + stats.verify_seconds
        assert stats.overhead_seconds >= 0
    assert 0 <= summary.overhead_fraction < 1
    assert summarize(output.generations) == summary

    ar = SpeculativeDecoder(target, method="ar").generate(PROMPT, max_new_tokens=10, seed=0).summary()
    assert ar.target_passes == 10 and ar.tokens_per_pass == 1 and math.isnan(ar.acceptance_rate)
    assert isinstance(output, GenerationOutput)


# ---- argument errors -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,error,match", [
    ({"method": "beam"}, ValueError, "method must be one of"),
    ({"method": "static"}, ValueError, "needs weight"),
    ({"method": "static", "weight": 1.5}, ValueError, r"weight must be in \[0, 1\]"),
    ({"method": "static", "weight": -0.1}, ValueError, r"weight must be in \[0, 1\]"),
    ({"method": "static", "weight": float("nan")}, ValueError, r"weight must be in \[0, 1\]"),
    ({"method": "static", "weight": "0.5"}, TypeError, "weight must be a float"),
    ({"method": "sd", "weight": 0.5}, ValueError, "method 'sd' is the w = 1 case"),
    ({"method": "diversed"}, ValueError, "needs head"),
    ({"method": "diversed", "head": 3}, TypeError, "head must be callable"),
    ({"method": "sd", "head": RecordingHead(1.0)}, ValueError, "head applies only"),
    ({"method": "sd", "num_draft": 0}, ValueError, r"num_draft \(K\) must be >= 1"),
    ({"method": "sd", "num_draft": -2}, ValueError, r"num_draft \(K\) must be >= 1"),
    ({"method": "sd", "num_draft": 2.0}, TypeError, "num_draft must be an int"),
    ({"method": "sd", "temperature": -1.0}, ValueError, "temperature must be"),
    ({"method": "sd", "temperature": float("nan")}, ValueError, "temperature must be"),
])
def test_bad_decoder_arguments_name_the_argument(wide_pair, kwargs, error, match):
    target, draft = wide_pair
    with pytest.raises(error, match=match):
        SpeculativeDecoder(target, draft, **kwargs)


def test_speculative_methods_need_a_draft(wide_pair):
    target, _ = wide_pair
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeDecoder(target, None, method="sd")
    SpeculativeDecoder(target, None, method="ar")  # the target alone needs none


@pytest.mark.parametrize("prompt,kwargs,error,match", [
    ([], {}, TypeError, "input_ids must be"),
    (torch.tensor([], dtype=torch.int64), {}, ValueError, "at least one token"),
    ([1, 99], {}, ValueError, r"token ids must be in \[0, 32\)"),
    ([1, -1], {}, ValueError, r"token ids must be in \[0, 32\)"),
    (torch.zeros(1, 2, 3, dtype=torch.int64), {}, ValueError, "1-D"),
    (torch.zeros(3), {}, TypeError, "integer token ids"),
    ([1, 2], {"max_new_tokens": -1}, ValueError, "max_new_tokens must be"),
    ([1, 2], {"eos_token_id": "x"}, TypeError, "eos_token_id must be"),
    ([1, 2], {"seed": 1.5}, TypeError, "seed must be an int"),
])
def test_bad_generate_arguments_name_the_argument(wide_pair, prompt, kwargs, error, match):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="sd")
    with pytest.raises(error, match=match):
        decoder.generate(prompt, **{"max_new_tokens": 3, **kwargs})


def test_step_after_the_end_is_an_error(wide_pair):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="sd")
    state = decoder.start(PROMPT, max_new_tokens=2, seed=0)
    while not state.finished:
        decoder.step(state)
    with pytest.raises(RuntimeError, match="has finished"):
        decoder.step(state)
