"""An EAGLE-3 head (built in the test with random weights, see ``vllm_tests/drafters.py``) drafting in a real engine
on V2's model runner, under Triton's interpreter. V2 proposes with EAGLE, EAGLE-3 and MTP alike through its
target-dependent speculator (``TargetDependentARSpeculator.propose``: a draft prefill over the target's hidden states,
then one draft step a position), which calls ``sample_draft`` once per drafted position, the hook the plugin's head
capture wraps. The engine drafts probabilistically over EAGLE-3's reduced vocabulary (V2's draft logits table, -inf
outside it): verified by diversed_ext, w = 0 keeps every draft, w = 0.5 keeps more than w = 1, w = 1 greedy equals V2
without speculation, and a head weighs every drafted token from the EAGLE-3 hidden state that drafted it (no head
draft goes uncaptured). One engine: the interpreter is slow (EAGLE with greedy drafts runs the same speculator; its
V1 engine is in ``test_drafters.py``)."""

from __future__ import annotations

import pytest
from drafters import REPEATING_PROMPTS, build_eagle3, start_drafter_engine
from engines import V2_ARGS, V2_GREEDY, chat, counts_during, stop_engine, worker_status
from laws import greedy_tokens

HEAD = "default"
PROMPTS = REPEATING_PROMPTS[:2]
TOKENS = 8  # 12 drafts at w = 0 (a step keeps K = 3, adds one), about 40 at w = 1 (random drafts: a token a step)


@pytest.fixture(scope="module")
def eagle_v2(pair, tmp_path_factory):
    folder = build_eagle3(pair, tmp_path_factory.mktemp("eagle3-v2"))
    llm = start_drafter_engine(pair, {"method": "eagle3", "model": str(folder), "draft_sample_method": "probabilistic"},
                               {"weight": 1.0, "heads": [HEAD]}, **V2_ARGS)
    yield llm
    stop_engine(llm)


def _delta(llm, extra_args) -> dict:
    """What the plugin counted while the engine sampled PROMPTS at temperature 1 with these extra_args."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, max_tokens=TOKENS, seed=index, extra_args=extra_args)
              for index in range(len(PROMPTS))]
    return counts_during(llm, lambda: llm.chat([chat(prompt) for prompt in PROMPTS], params, use_tqdm=False))


def _assert_verified_by_diversed(llm) -> None:
    statuses = worker_status(llm)
    assert statuses
    for status in statuses:
        assert status["sampler"] == "DiversedV2RejectionSampler" and status["runner"] == "v2", status
        assert status["verifier"] == "diversed" and status["verified_without_head"] == 0, status


def test_v2_eagle_weights_zero_half_and_one(eagle_v2, v2_greedy):
    _assert_verified_by_diversed(eagle_v2)
    none, half, exact = (_delta(eagle_v2, {"diversed_weight": weight}) for weight in (0.0, 0.5, 1.0))
    print("V2 acceptance at w = 0, 0.5, 1:", none, half, exact)
    assert min(none["drafted"], half["drafted"], exact["drafted"]) > 10, (none, half, exact)
    assert none["accepted"] == none["drafted"] and none["weight_sum"] == 0.0, none
    assert half["accepted"] / half["drafted"] > exact["accepted"] / exact["drafted"], (half, exact)
    assert greedy_tokens(eagle_v2, {"diversed_weight": 1.0}, **V2_GREEDY) == v2_greedy


def test_v2_eagle_a_head_reads_the_drafters_hidden_states(eagle_v2):
    delta = _delta(eagle_v2, {"diversed_head": HEAD})
    assert delta["drafted"] > 10 and delta["verified_without_head"] == 0, delta
    mean_weight = delta["weight_sum"] / delta["drafted"]
    assert 0.0 < mean_weight < 1.0, mean_weight
    _assert_verified_by_diversed(eagle_v2)
