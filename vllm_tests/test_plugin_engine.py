"""The plugin in a real vLLM engine (engine core and worker in their own processes, vLLM's default) on the exported
default pair: the sampler in use, greedy and sampled laws against vLLM without speculation, acceptance against our
own loop on the same pair, mixed batches, per-request errors, log-probabilities."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from engines import NUM_DRAFT, PROMPTS, acceptance, chat, counts_during, per_request_acceptance, start_engine, \
    stop_engine, worker_status
from laws import LAW_ALPHA, greedy_tokens, law_samples, position_p_values

ENGINE_WEIGHT = 0.5
GATE_MARGIN = 1.0
HEAD = "default"
LOOP_TOKENS = 48


@pytest.fixture(scope="module")
def engine(pair):
    llm = start_engine(pair, diversed={"weight": ENGINE_WEIGHT, "heads": [HEAD]})
    yield llm
    stop_engine(llm)


def _sampled(llm, extra_args, *, seed0=0, prompts=PROMPTS, max_tokens=LOOP_TOKENS):
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed0 + index, extra_args=extra_args)
              for index in range(len(prompts))]
    return llm.chat([chat(prompt) for prompt in prompts], params, use_tqdm=False)


@pytest.fixture(autouse=True)
def no_head_token_verified_without_its_head(engine):
    """After every test: no drafted token of a head request was verified at the static weight for want of its
    hidden states."""
    yield
    assert [status["verified_without_head"] for status in worker_status(engine)] == [0] * len(worker_status(engine))


def test_the_plugin_verifies_in_every_worker(engine):
    statuses = worker_status(engine)
    assert statuses, "no worker answered"
    for status in statuses:
        assert status["sampler"] == "DiversedRejectionSampler"
        assert status["verifier"] == "diversed" and status["weight"] == ENGINE_WEIGHT and status["heads"] == [HEAD]


def test_greedy_at_weight_one_equals_vllm_without_speculation(engine, baseline):
    assert greedy_tokens(engine, {"diversed_weight": 1.0}) == baseline["greedy"]


def test_sampled_at_weight_one_follows_the_targets_law(engine, baseline):
    p_values = position_p_values(law_samples(engine, {"diversed_weight": 1.0}), baseline["law"])
    assert min(p_values) > LAW_ALPHA, p_values


def test_sampled_at_weight_zero_fails_the_targets_law(engine, baseline):
    """The law test's power: at w = 0 every draft is kept, so positions 2 and 3 follow the int8 draft's law, which
    the same test (as many requests, the same threshold) must tell from the target's."""
    p_values = position_p_values(law_samples(engine, {"diversed_weight": 0.0}), baseline["law"])
    assert min(p_values) < LAW_ALPHA, p_values


def test_acceptance_rises_as_the_weight_falls(engine):
    rates = {}
    for weight in (1.0, 0.5, 0.0):
        accepted, drafted = acceptance(_sampled(engine, {"diversed_weight": weight}))
        assert drafted > 50
        rates[weight] = accepted / drafted
    assert rates[1.0] < rates[0.5] < rates[0.0] == 1.0, rates  # w = 0: nu is the one-hot draft, always kept


def test_fly_keeps_more_of_the_same_drafts(engine):
    """At w = 1 with the same seeds, FLy (window 1, threshold 0) only turns rejections into acceptances."""
    exact = acceptance(_sampled(engine, {"diversed_weight": 1.0}))
    fly = acceptance(_sampled(engine, {"diversed_weight": 1.0, "diversed_fly_window": 1,
                                       "diversed_fly_threshold": 0.0}))
    assert exact[1] > 50 and fly[1] > 50
    assert fly[0] / fly[1] > exact[0] / exact[1], (exact, fly)


def test_the_gate_keeps_more_of_the_same_drafts_and_every_draft_at_a_wide_margin(engine):
    exact = acceptance(_sampled(engine, {"diversed_weight": 1.0}))
    gated = acceptance(_sampled(engine, {"diversed_weight": 1.0, "diversed_gate_margin": GATE_MARGIN}))
    wide = acceptance(_sampled(engine, {"diversed_weight": 1.0, "diversed_gate_margin": 1e6}))
    assert exact[1] > 50 and gated[1] > 50 and wide[1] > 50
    assert gated[0] / gated[1] > exact[0] / exact[1], (exact, gated)
    assert wide[0] == wide[1], wide  # every draft within 1e6 nats of a rejection's expected log-probability


def test_gated_acceptance_matches_our_loop(engine, pair):
    from diversed_ext.decoding import Gate

    ours = per_request_acceptance(_sampled(engine, {"diversed_weight": 1.0, "diversed_gate_margin": GATE_MARGIN}))
    loops, _ = _loop_rates(pair, method="sd", gate=Gate(GATE_MARGIN))
    _assert_same_mean(ours, loops, f"acceptance with the gate at margin {GATE_MARGIN}")


def _loop_rates(pair, **decoder_args):
    """Per-prompt acceptance and the weights drafted tokens got, from our own loop on the same exported pair."""
    from diversed_ext.decoding import SpeculativeDecoder
    from diversed_ext.decoding.prompts import encode_prompt, eos_ids
    from diversed_ext.models.pairs import load_pair

    models = load_pair(pair.target, pair.draft)
    decoder = SpeculativeDecoder(models.target, models.draft, max_draft=NUM_DRAFT, temperature=1.0,
                                 draft_mode="tokens", **decoder_args)
    prompts = [encode_prompt(models.tokenizer, prompt) for prompt in PROMPTS]
    output = decoder.generate(prompts, max_new_tokens=LOOP_TOKENS, eos_token_id=eos_ids(models.tokenizer,
                                                                                         models.target), seed=0)
    rates, weights = [], []
    for generation in output.generations:
        drafted = sum(stats.drafted for stats in generation.rounds)
        if drafted:
            rates.append(sum(stats.accepted for stats in generation.rounds) / drafted)
        weights += [w for stats in generation.rounds for w in stats.weights]
    return rates, weights


def _standard_error(values):
    return statistics.stdev(values) / math.sqrt(len(values))


def _assert_same_mean(ours, loops, what):
    difference = statistics.fmean(ours) - statistics.fmean(loops)
    bound = 4 * math.hypot(_standard_error(ours), _standard_error(loops)) + 0.02
    assert abs(difference) < bound, f"{what}: vLLM {statistics.fmean(ours):.3f}, loop {statistics.fmean(loops):.3f}"


@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_static_acceptance_matches_our_loop(engine, pair, weight):
    ours = per_request_acceptance(_sampled(engine, {"diversed_weight": weight}))
    loops, _ = _loop_rates(pair, method="sd" if weight == 1.0 else "static",
                           **({} if weight == 1.0 else {"weight": weight}))
    _assert_same_mean(ours, loops, f"acceptance at w = {weight}")


def test_head_weights_and_acceptance_match_our_loop(engine, pair):
    from diversed_ext.head import load_head

    outputs = []
    counts = counts_during(engine, lambda: outputs.extend(_sampled(engine, {"diversed_head": HEAD})))
    ours = per_request_acceptance(outputs)
    mean_weight = counts["weight_sum"] / counts["drafted"]
    loops, loop_weights = _loop_rates(pair, method="diversed", head=load_head(HEAD))
    _assert_same_mean(ours, loops, "acceptance with the head")
    assert 0.0 < mean_weight < 1.0 and abs(mean_weight - statistics.fmean(loop_weights)) < 0.05, \
        (mean_weight, statistics.fmean(loop_weights))


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(engine):
    from vllm import SamplingParams

    requests = [  # (prompt, params): weights, a head, greedy and sampled rows, top-p, different prompt lengths
        (PROMPTS[0], SamplingParams(temperature=1.0, seed=11, max_tokens=24, extra_args={"diversed_weight": 0.3})),
        (PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=24, extra_args={"diversed_weight": 0.0})),
        (PROMPTS[2] + " Explain each step.", SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=24,
                                                           extra_args={"diversed_weight": 0.9})),
        (PROMPTS[3], SamplingParams(temperature=1.0, seed=3, max_tokens=24)),
        (PROMPTS[4], SamplingParams(temperature=1.0, seed=8, max_tokens=24, extra_args={"diversed_head": HEAD})),
    ]
    together = engine.chat([chat(prompt) for prompt, _ in requests], [params for _, params in requests],
                           use_tqdm=False)
    for (prompt, params), output in zip(requests, together):
        alone = engine.chat([chat(prompt)], [params], use_tqdm=False)[0]
        assert list(alone.outputs[0].token_ids) == list(output.outputs[0].token_ids), params


@pytest.mark.parametrize("extra_args, field", [
    ({"diversed_weight": 1.5}, "diversed_weight"), ({"diversed_weight": float("nan")}, "diversed_weight"),
    ({"diversed_weight": "0.5"}, "diversed_weight"), ({"diversed_weight": True}, "diversed_weight"),
    ({"diversed_head": "no-such-head"}, "diversed_head"), ({"diversed_wieght": 0.5}, "diversed_wieght"),
    ({"diversed_weight": 0.5, "diversed_head": HEAD}, "diversed_weight"),
    ({"diversed_gate_margin": float("inf")}, "diversed_gate_margin"),
    ({"diversed_fly_window": NUM_DRAFT}, "diversed_fly_window"),  # the window must be below K
])
def test_a_bad_request_value_is_that_requests_error(engine, extra_args, field):
    from vllm import SamplingParams

    with pytest.raises(ValueError, match=field):
        engine.generate("Hello", SamplingParams(max_tokens=2, extra_args=extra_args), use_tqdm=False)
    served = engine.generate("Hello", SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert len(served[0].outputs[0].token_ids) == 4


@pytest.fixture(scope="module")
def target_logits_of(pair):
    """(prompt ids, emitted ids) -> float32 [len(emitted), V]: the target's raw logits at each emitted token's
    position, teacher-forced in transformers (what vLLM's target computed there, up to float32 rounding)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32)

    def logits(prompt: list, emitted: list) -> torch.Tensor:
        with torch.no_grad():
            return target(torch.tensor([prompt + emitted[:-1]])).logits[0, len(prompt) - 1:]
    return logits


def test_logprobs_of_emitted_tokens(engine, target_logits_of):
    """An emitted token's log-probability is the target's (vLLM's raw_logprobs mode, the default), not nu's: the
    target's own log-softmax at that position."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, seed=2, max_tokens=16, logprobs=1, extra_args={"diversed_weight": 0.5})
    request = engine.chat([chat(PROMPTS[5])], [params], use_tqdm=False)[0]
    output = request.outputs[0]
    assert len(output.logprobs) == len(output.token_ids)
    assert all(token in entry for token, entry in zip(output.token_ids, output.logprobs))
    reported = torch.tensor([entry[token].logprob for token, entry in zip(output.token_ids, output.logprobs)])
    logits = target_logits_of(list(request.prompt_token_ids), list(output.token_ids))
    expected = logits.log_softmax(-1).gather(1, torch.tensor(output.token_ids)[:, None]).squeeze(1)
    assert torch.allclose(reported, expected, atol=2e-3), (reported, expected)


def test_top_k_holds_at_w_0(engine, target_logits_of):
    """top_k = 3 at w = 0 (nu is the draft's law wherever the target allows the token): every emitted token is among
    the target's 3 largest logits at its position (a logit within 1e-3 of the third counts, for float32 rounding
    between vLLM and transformers), and drafts were kept, so the rule was tested on kept drafts too."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, top_k=3, seed=40 + index, max_tokens=32,
                             extra_args={"diversed_weight": 0.0}) for index in range(4)]
    requests = engine.chat([chat(prompt) for prompt in PROMPTS[:4]], params, use_tqdm=False)
    outside, accepted = 0, 0
    for request in requests:
        output = request.outputs[0]
        logits = target_logits_of(list(request.prompt_token_ids), list(output.token_ids))
        third = logits.topk(3, dim=-1).values[:, -1]
        emitted = logits.gather(1, torch.tensor(output.token_ids)[:, None]).squeeze(1)
        outside += int((emitted < third - 1e-3).sum())
        accepted += output.spec_decode_metrics.to_dict()["num_accepted_draft_tokens"]
    assert outside == 0 and accepted > 0, (outside, accepted)


@pytest.mark.parametrize("extra_args", [{"diversed_weight": 0.3}, {"diversed_head": HEAD}])
def test_parallel_samples_each_draw_their_own_and_a_seed_repeats_them(engine, extra_args):
    """n > 1: vLLM forks the request into children; each is verified with the request's weight or head, draws its own
    tokens, and the same seed gives the same children again."""
    from vllm import SamplingParams

    def children():
        params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=24, extra_args=extra_args)
        return [list(child.token_ids) for child in engine.chat([chat(PROMPTS[0])], params, use_tqdm=False)[0].outputs]

    first = children()
    assert len(first) == 3 and all(len(tokens) == 24 for tokens in first)
    assert len({tuple(tokens) for tokens in first}) == 3
    assert children() == first
