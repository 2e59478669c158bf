"""Hard constraints and structured outputs kept at w = 0 on the V1 runner, scheduled both ways vLLM schedules:
synchronously (vLLM's CPU default) and asynchronously (its GPU default, forced on here), with the default pair's draft
model and with the trained EAGLE-3 drafter (greedy drafts; the head trained on its states). One batch of requests
restricted by ``allowed_token_ids``, ``bad_words``, ``min_tokens``, a JSON schema, a regex and a choice, beside
unconstrained ones (static weights, a head, the gate, greedy), runs in one engine of each. A drafted token that the
processed target rules out is never kept, whatever the weight, and under asynchronous scheduling a draft the grammar
rejects arrives marked -1 and is rejected, so no request breaks its constraint either way; the unconstrained requests
keep their gain from w < 1, and every request whose drafts the two schedulings hand over alike emits the same tokens
under both (so a head reads the same hidden states under both). ``logit_bias`` and ``min_p`` are refused by vLLM
itself when speculative decoding is on."""

from __future__ import annotations

import pytest
from async_engine import run_async_batch
from constraints import CONSTRAINED, DRAFTERS, FREE, HARD_CONSTRAINTS, check_gain_kept, check_kind_kept, \
    refused_with_speculation, run_batch, start_batch_engine, summary
from engines import stop_engine, worker_status

PROMPTS_PER_KIND = 8
TOKENS = 48  # 8 x 48 = 384 tokens of each kind
SCHEDULINGS = ("sync", "async")


@pytest.fixture(scope="module", params=DRAFTERS)
def outcomes(request, pair, tmp_path_factory):
    """{scheduling: (the batch's outcome, the workers' status, the refusals)} with one drafter: the synchronous
    engine here, the asynchronous one in a process of its own (async_engine), one after the other."""
    drafter = request.param
    llm = start_batch_engine(pair, drafter)
    try:
        results = {"sync": (run_batch(llm, PROMPTS_PER_KIND, TOKENS), worker_status(llm),
                            refused_with_speculation(llm))}
    finally:
        stop_engine(llm)
    outcome, status = run_async_batch(pair, PROMPTS_PER_KIND, TOKENS, tmp_path_factory.mktemp("async"),
                                      timeout=900, drafter=drafter)
    results["async"] = outcome, status, None
    for scheduling, (outcome, _, _) in results.items():  # for -s runs
        print(drafter, scheduling, summary(outcome.tallies))
    return results


@pytest.mark.parametrize("scheduling", SCHEDULINGS)
def test_each_engine_schedules_as_asked(outcomes, scheduling):
    _, status, _ = outcomes[scheduling]
    assert [worker["async_scheduling"] for worker in status] == [scheduling == "async"], status
    assert all(worker["verified_without_head"] == 0 for worker in status), status


@pytest.mark.parametrize("scheduling", SCHEDULINGS)
@pytest.mark.parametrize("kind", CONSTRAINED)
def test_no_request_breaks_its_constraint(outcomes, scheduling, kind):
    check_kind_kept(outcomes[scheduling][0].tallies, kind, PROMPTS_PER_KIND * TOKENS // 2, least_drafted=50)


@pytest.mark.parametrize("scheduling", SCHEDULINGS)
def test_unconstrained_requests_of_the_batch_keep_their_gain(outcomes, scheduling):
    check_gain_kept(outcomes[scheduling][0].tallies, least_drafted=50)


def test_both_schedulings_emit_the_same_tokens(outcomes):
    """Seeded requests draw the same numbers whichever way they are scheduled, so every request whose drafts reach
    the sampler alike emits the same tokens: all but structured outputs, whose grammar-invalid drafts synchronous
    scheduling trims (the position becomes the bonus) and asynchronous scheduling marks -1 (a rejection there)."""
    sync, asynchronous = outcomes["sync"][0].emitted, outcomes["async"][0].emitted
    compared = [(kind, tokens, other) for (kind, tokens), (_, other) in zip(sync, asynchronous)
                if kind in HARD_CONSTRAINTS + FREE]
    assert len(compared) == len(HARD_CONSTRAINTS + FREE) * PROMPTS_PER_KIND
    differing = [(kind, tokens, other) for kind, tokens, other in compared if tokens != other]
    assert not differing, differing[:3]


def test_vllm_refuses_logit_bias_and_min_p_with_speculation(outcomes):
    refusals = outcomes["sync"][2]
    assert len(refusals) == 2 and all("not yet supported with speculative decoding" in error
                                      for error in refusals), refusals
