"""Draft lengths by batch size on the V2 runner (under Triton's interpreter): the trained EAGLE-3 drafter drafting
as many tokens as ``drafters.DRAFT_SCHEDULE`` gives each step's batch size (3 alone, 1 for two requests together),
verified by the plugin. A request alone drafts 3 a step and the plugin verifies every draft, a head reads the
drafter's hidden states with one request and two, and w = 1 greedy equals V2 without speculation while two requests
(K = 1) become one (K = 3). Few short requests: the interpreter is slow."""

from __future__ import annotations

import pytest
from drafters import start_scheduled_engine
from engines import V2_ARGS, V2_GREEDY, sampled_at_once, stop_engine, worker_status
from laws import greedy_tokens

TOKENS = 10
HEAD = "default"


@pytest.fixture(scope="module")
def engine(pair):
    llm = start_scheduled_engine(pair, {"weight": 1.0, "heads": [HEAD]}, **V2_ARGS)
    yield llm
    stop_engine(llm)


def test_a_request_alone_drafts_three_per_step_and_the_plugin_verifies_them(engine):
    for status in worker_status(engine):
        assert status["sampler"] == "DiversedV2RejectionSampler" and status["verifier"] == "diversed", status
    drafted, steps, counts = sampled_at_once(engine, TOKENS, 1)
    assert steps[0] > 0 and 3 * (steps[0] - 1) < drafted[0] <= 3 * steps[0], (drafted, steps)
    assert counts["drafted"] == sum(drafted), counts


def test_a_head_reads_the_drafters_hidden_states_at_each_k(engine):
    for count in (1, 2):
        _, _, counts = sampled_at_once(engine, TOKENS, count, {"diversed_head": HEAD})
        assert counts["drafted"] > 0 and counts["verified_without_head"] == 0, counts
        assert 0.0 < counts["weight_sum"] / counts["drafted"] < 1.0, counts


def test_greedy_at_weight_one_equals_v2_without_speculation_as_k_changes(engine, v2_greedy):
    assert greedy_tokens(engine, {"diversed_weight": 1.0}, **V2_GREEDY) == v2_greedy
