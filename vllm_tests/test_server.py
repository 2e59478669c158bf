"""`vllm serve` with the plugin, driven by the openai client: 64 requests at 16 concurrent, each with its own weight,
bad values answered 400 while the rest complete, and the server's spec-decode counters equal to what the requests
report accepting."""

from __future__ import annotations

import pytest
from server import ask_all, running_server, spec_counters

REQUESTS = 64
CONCURRENCY = 16
WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    with running_server(pair, tmp_path_factory.mktemp("serve") / "serve.log") as url:
        yield url


def test_concurrent_requests_each_with_its_own_weight(server):
    from openai import BadRequestError

    accepted_before, drafted_before = spec_counters(server)
    good = [(index, {"diversed_weight": WEIGHTS[index % len(WEIGHTS)]}) for index in range(REQUESTS)]
    bad = [(REQUESTS + 0, {"diversed_weight": 1.5}), (REQUESTS + 1, {"diversed_weight": "high"}),
           (REQUESTS + 2, {"diversed_head": "none-loaded"})]
    results = ask_all(server, good[:32] + bad + good[32:], max_tokens=MAX_TOKENS, concurrency=CONCURRENCY)
    answers = {}
    for result in results:
        if isinstance(result, BaseException):
            assert isinstance(result, BadRequestError), repr(result)
            assert "diversed_" in str(result)
            continue
        index, response = result
        assert index not in answers, f"request {index} answered twice"
        answers[index] = response
    assert sorted(answers) == list(range(REQUESTS)), "lost or unexpected answers"
    assert sum(isinstance(result, BadRequestError) for result in results) == len(bad)
    accepted_after, drafted_after = spec_counters(server)
    per_request = {index: response.to_dict()["metrics"]["speculative_decoding"] for index, response in answers.items()}
    assert accepted_after - accepted_before == sum(m["num_accepted_draft_tokens"] for m in per_request.values())
    assert drafted_after - drafted_before == sum(m["num_draft_tokens"] for m in per_request.values())
    for index, metrics in per_request.items():
        assert answers[index].choices[0].message.content is not None
        if WEIGHTS[index % len(WEIGHTS)] == 0.0 and metrics["num_draft_tokens"]:  # nu = q: every draft kept
            assert metrics["num_accepted_draft_tokens"] == metrics["num_draft_tokens"]
    rates = {weight: [] for weight in WEIGHTS}
    for index, metrics in per_request.items():
        if metrics["num_draft_tokens"]:
            rates[WEIGHTS[index % len(WEIGHTS)]].append(metrics["draft_acceptance_rate"])
    assert sum(rates[1.0]) / len(rates[1.0]) < sum(rates[0.0]) / len(rates[0.0])
