"""Hard constraints and structured outputs kept at w = 0 on the V2 runner (under Triton's interpreter), scheduled
asynchronously as vLLM schedules V2 on a GPU: one engine, one batch of requests restricted by ``allowed_token_ids``,
``bad_words``, ``min_tokens``, a JSON schema, a regex and a choice, beside unconstrained ones (static weights, a head,
the gate, greedy). V2's own sampling parameters and the grammar's bitmask process every target row, and a draft the
grammar rejects arrives marked -1; a drafted token they rule out is never kept, whatever the weight, so no request
breaks its constraint, and the unconstrained requests of the batch keep their gain from w < 1. (The V1 tests compare
the two schedulings token for token.)"""

from __future__ import annotations

import pytest
from async_engine import run_async_batch
from constraints import CONSTRAINED, check_gain_kept, check_kind_kept, summary
from engines import V2_ARGS

PROMPTS_PER_KIND = 4
TOKENS = 32  # 4 x 32 = 128 tokens of each kind: the interpreter takes tens of milliseconds a token
BATCH_SECONDS = 1500  # the batch's process: about 3 minutes on a quiet 2-core machine, several times that when busy
# The first test starts the batch, so each test gets the batch's limit (the suite's default, 900 s, would cut it short).
pytestmark = pytest.mark.timeout(BATCH_SECONDS + 60)


@pytest.fixture(scope="module")
def outcome(pair, tmp_path_factory):
    result = run_async_batch(pair, PROMPTS_PER_KIND, TOKENS, tmp_path_factory.mktemp("async"), timeout=BATCH_SECONDS,
                             **V2_ARGS)
    print(summary(result[0].tallies))  # for -s runs
    return result


def test_the_engine_schedules_asynchronously_with_every_head_request_verified_by_its_head(outcome):
    _, status = outcome
    assert [worker["async_scheduling"] for worker in status] == [True], status
    assert [worker["runner"] for worker in status] == ["v2"], status
    assert all(worker["verified_without_head"] == 0 for worker in status), status


@pytest.mark.parametrize("kind", CONSTRAINED)
def test_no_request_breaks_its_constraint(outcome, kind):
    check_kind_kept(outcome[0].tallies, kind, PROMPTS_PER_KIND * TOKENS // 2, least_drafted=20)


def test_unconstrained_requests_of_the_batch_keep_their_gain(outcome):
    check_gain_kept(outcome[0].tallies, least_drafted=20)
