"""Draft lengths by batch size (speculative_config's ``num_speculative_tokens_per_batch_size``) with the plugin
verifying, in a real V1 engine drafting with the trained EAGLE-3 drafter (``drafters.DRAFT_SCHEDULE``: a request alone
drafts K = 3, two or three requests together draft 1 each, four or more nothing). A request alone drafts 3 a step,
eight together a fraction of what they draft alone, and the plugin verifies every draft; w = 1 greedy still equals
vLLM without speculation while a batch shrinks and its K grows; a head request still reads the drafter's hidden
states at each K."""

from __future__ import annotations

import pytest
from drafters import start_scheduled_engine
from engines import PROMPTS, sampled_at_once, stop_engine, worker_status
from laws import greedy_tokens

TOKENS = 24
HEAD = "default"  # in an eagle3 engine, the head trained on EAGLE-3 states


@pytest.fixture(scope="module")
def engine(pair):
    llm = start_scheduled_engine(pair, {"weight": 1.0, "heads": [HEAD]})
    yield llm
    stop_engine(llm)


def test_the_plugin_verifies_with_a_schedule(engine):
    for status in worker_status(engine):
        assert status["sampler"] == "DiversedRejectionSampler" and status["verifier"] == "diversed", status


def test_a_request_alone_drafts_three_per_step(engine):
    drafted, steps, counts = sampled_at_once(engine, TOKENS, 1)
    print("alone: drafted", drafted, "in", steps, "steps;", counts)
    assert steps[0] > 0 and 3 * (steps[0] - 1) < drafted[0] <= 3 * steps[0], (drafted, steps)
    assert counts["drafted"] == sum(drafted), counts


def test_eight_requests_together_draft_a_fraction_of_what_they_draft_alone(engine):
    """Together they draft nothing but in the steps before the engine has admitted four of them (it may start on the
    first while the others arrive) and after all but three have finished (they run in step, a token each, until
    then): a fraction of what each drafts alone."""
    count = len(PROMPTS)
    alone = sum(sampled_at_once(engine, TOKENS, 1, prompt=index)[0][0] for index in range(count))
    drafted, _, counts = sampled_at_once(engine, TOKENS, count)
    print(count, "alone drafted", alone, "; together", drafted, counts)
    assert sum(drafted) < alone / 4, (drafted, alone)
    assert counts["drafted"] == sum(drafted), counts


def test_greedy_at_weight_one_equals_vllm_without_speculation_as_k_changes(engine, baseline):
    """Two greedy requests together (K = 1), then the longer one alone (K = 3): the tokens of no speculation."""
    assert greedy_tokens(engine, {"diversed_weight": 1.0}, prompts=2) == baseline["greedy"][:2]


def test_a_head_reads_the_drafters_hidden_states_at_each_k(engine):
    for count in (1, 2):
        _, _, counts = sampled_at_once(engine, TOKENS, count, {"diversed_head": HEAD})
        mean_weight = counts["weight_sum"] / counts["drafted"]
        print(count, "at once, default head:", counts, "mean w", mean_weight)
        assert counts["drafted"] > 0 and counts["verified_without_head"] == 0, counts
        assert 0.0 < mean_weight < 1.0, mean_weight
