"""Engines with and without the plugin's entry: vLLM is left as it is without one (its CPU sampler bug included,
which is also the law test's proof of power), the target as its own draft is always accepted, and a bad engine
entry is one clear error at start-up."""

from __future__ import annotations

import pytest
from engines import PROMPTS, acceptance, chat, start_engine, stop_engine, worker_status
from laws import LAW_ALPHA, law_samples, position_p_values


def test_without_the_entry_vllm_keeps_its_own_sampler_and_its_cpu_bug(pair, baseline):
    llm = start_engine(pair)  # speculative decoding, no additional_config["diversed"]
    try:
        statuses = worker_status(llm)
        samples = law_samples(llm)
    finally:
        stop_engine(llm)
    assert [status["sampler"] for status in statuses] == ["RejectionSampler"] * len(statuses)
    assert all(status["verifier"] is None for status in statuses)
    # vLLM 0.32.0's CPU path divides the target's logits by uninitialised temperatures: the same test that the
    # plugin passes (as many requests, the same threshold) rejects it.
    p_values = position_p_values(samples, baseline["law"])
    assert min(p_values) < LAW_ALPHA, p_values


def test_the_target_as_its_own_draft_is_always_accepted(pair):
    from vllm import SamplingParams

    llm = start_engine(pair, speculative="target", probabilistic=True, diversed={"weight": 1.0})
    try:
        params = [SamplingParams(temperature=1.0, seed=index, max_tokens=32) for index in range(len(PROMPTS))]
        accepted, drafted = acceptance(llm.chat([chat(prompt) for prompt in PROMPTS], params, use_tqdm=False))
        status = worker_status(llm)[0]
    finally:
        stop_engine(llm)
    assert drafted > 100 and status["drafted"] >= drafted
    # q = p up to the float rounding of two forward passes with different batch shapes
    assert accepted >= 0.99 * drafted, (accepted, drafted)


@pytest.mark.parametrize("entry, speculative, message", [
    ({"weight": 1.5}, "draft", r"\['weight'\] must be a number in \[0, 1\]"),
    ({"wieght": 0.5}, "draft", "unknown keys"),
    ({"weight": 0.5, "head": "default"}, "draft", "not both"),
    ({"head": "no-such-head"}, "draft", "head 'no-such-head': no head.json"),
    ({"verifier": "vllm", "weight": 0.5}, "draft", "takes no weight"),
    ({"weight": 0.5}, None, "needs speculative decoding"),
])
def test_a_bad_engine_entry_is_a_clear_startup_error(pair, entry, speculative, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        start_engine(pair, speculative=speculative, diversed=entry)
