"""Figures pooled over prompts of different sizes: the calibration gap g pooled over tokens (0 for exact sampling when
EOS ends outputs at lengths that depend on them, where the mean of per-prompt g is not), the pooled acceptance's
standard error, both by the ratio estimator over prompts, and the counts `evaluate` records for them."""

import math

import pytest
import torch

pytest.importorskip("transformers")

from diversed_ext.research import calibration, harness, report  # noqa: E402
from diversed_ext.research.result_sets import load_results, save_results  # noqa: E402
from diversed_ext.research.tasks import TASKS  # noqa: E402
from diversed_ext.research.teacher_forcing import target_scores  # noqa: E402
from helpers import gsm8k_examples  # noqa: E402

EOS = 0


class EarlyStopTarget(torch.nn.Module):
    """A 3-token target: the first new token is EOS with probability 0.9 and token 1 otherwise; every later one is
    token 2 (almost surely). So an exact sample is [EOS] (0.9) or [1, 2, ..., 2] of 10 tokens (0.1): its length
    depends on its first token."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(1))  # target_scores reads the device off a parameter

    def forward(self, input_ids, use_cache=False):
        logits = torch.full((1, input_ids.shape[1], 3), -60.0)
        logits[0, :, 2] = 0.0
        logits[0, 0] = torch.tensor([math.log(0.9), math.log(0.1), -60.0])
        return type("Output", (), {"logits": logits})()


def scored_row(completions):
    """An ar row scored by the target above, one prompt per completion (prompt: one token)."""
    target = EarlyStopTarget()
    fidelities, entropies = zip(*(target_scores(target, [5], completion) for completion in completions))
    return report.MethodResult("ar", math.nan, math.nan, 1.0, 0.0, sum(fidelities) / len(fidelities), 1.0,
                               sum(map(len, completions)), 1.0, fidelities, (0.0,) * len(completions),
                               entropy_per_prompt=entropies,
                               tokens_per_prompt=tuple(len(completion) for completion in completions))


def test_g_pooled_over_tokens_is_zero_for_exact_sampling_with_an_early_eos():
    # Nine prompts stop at EOS at once, one runs 10 tokens: the exact law's proportions. Pooled over the 19 tokens, the
    # log p + H terms cancel (9 log 0.9 + log 0.1 = -10 H); the mean of the per-prompt means gives the long output's
    # terms a tenth of the short ones' weight: 0.9 (log 0.9 + H) + 0.1 (log 0.1 + H) / 10 = +0.178.
    row = scored_row([[EOS]] * 9 + [[1] + [2] * 9])
    entropy = -(0.9 * math.log(0.9) + 0.1 * math.log(0.1))
    per_prompt_mean = 0.9 * (math.log(0.9) + entropy) + 0.1 * (math.log(0.1) + entropy) / 10
    assert per_prompt_mean == pytest.approx(0.178, abs=1e-3)
    assert sum(row.calibration_gap_per_prompt) / 10 == pytest.approx(per_prompt_mean, abs=1e-6)
    assert row.calibration_gap == pytest.approx(0.0, abs=1e-6)
    assert "sharper" not in report.gap_cell(row) and calibration.missing_entropy_note([row]) == ""


def test_g_and_its_standard_error_are_the_ratio_estimators():
    # Prompt lengths 1, 9 and 2 with per-prompt g +1, -1/9 and 0: sums +1, -1, 0 over 12 tokens, so g = 0 (the mean of
    # the per-prompt g is +0.296), s.e. sqrt((1 + 1 + 0) / (3 * 2)) / (12 / 3).
    row = report.MethodResult("sd", 1.0, 0.5, 1.0, 0.0, -1.0, 1.0, 12, 1.0, (-1.0, -2.0 - 1 / 9, -0.5), (0.0,) * 3,
                              entropy_per_prompt=(2.0, 2.0, 0.5), tokens_per_prompt=(1, 9, 2))
    assert row.calibration_gap == pytest.approx(0.0, abs=1e-12)
    assert row.calibration_gap_se == pytest.approx(math.sqrt(2 / 6) / 4)
    assert report.ratio_estimate([1.0, 2.0], [1.0, 1.0]) == (1.5, pytest.approx(report.standard_error([1.0, 2.0])))
    # A prompt that generated nothing is a sample of (0 tokens, sum 0); one without an entropy is left out.
    empty = report.MethodResult("sd", 1.0, 0.5, 1.0, 0.0, -1.0, 1.0, 12, 1.0, (-1.0, math.nan, -2.0, -1.0),
                                (0.0,) * 4, entropy_per_prompt=(1.5, math.nan, math.nan, 1.0),
                                tokens_per_prompt=(2, 0, 3, 4))
    assert empty.calibration_gap == pytest.approx((0.5 * 2 + 0.0 * 4) / 6)
    half = 1 / 6  # r
    assert empty.calibration_gap_se == pytest.approx(
        math.sqrt(((1.0 - 2 * half) ** 2 + 0.0 + (0.0 - 4 * half) ** 2) / 6) / 2)


def test_rows_without_token_counts_fall_back_to_the_mean_over_prompts_and_are_named():
    row = report.MethodResult("sd", 1.0, 0.5, 1.0, 0.0, -1.0, 1.0, 12, 1.0, (-1.0, -2.0), (0.0,) * 2, (0.5, 0.5),
                              drafted=8, accepted=4, entropy_per_prompt=(1.2, 2.4))
    assert row.calibration_gap == pytest.approx(0.3) and row.calibration_gap_se == pytest.approx(0.1)
    note = calibration.missing_entropy_note([row])
    assert "without their prompts' token counts" in note and note.endswith(": sd.")
    # Counts that do not pair up with the prompts (a row joined from parts, one saved without them) are dropped.
    joined = report.MethodResult("sd", 1.0, 0.5, 1.0, 0.0, -1.0, 1.0, 12, 1.0, (-1.0, -2.0), (0.0,) * 2, (0.5, 0.5),
                                 entropy_per_prompt=(1.2, 2.4), tokens_per_prompt=(3,), drafted_per_prompt=(4, 4, 4))
    assert joined.tokens_per_prompt == () and joined.drafted_per_prompt == ()
    assert joined.calibration_gap == pytest.approx(0.3)


def test_the_pooled_acceptance_gets_the_ratio_estimators_standard_error():
    # Drafted 2, 18 and 10, accepted 2, 0 and 5: the pooled acceptance is 7/30; the per-prompt rates 1, 0 and 0.5
    # have a mean of 0.5, and their s.e. (0.289) is not the pooled figure's.
    rates, drafted = (1.0, 0.0, 0.5), (2, 18, 10)
    row = report.MethodResult("sd", 1.0, 7 / 30, 1.0, 0.0, -1.0, 1.0, 40, 1.0, (-1.0,) * 3, (0.0,) * 3, rates,
                              drafted=30, accepted=7, drafted_per_prompt=drafted)
    r = 7 / 30
    expected = math.sqrt(((2 - 2 * r) ** 2 + (0 - 18 * r) ** 2 + (5 - 10 * r) ** 2) / 6) / 10
    assert row.acceptance_se == pytest.approx(expected)
    assert row.acceptance_se != pytest.approx(report.standard_error(list(rates)), rel=0.05)
    # A prompt that drafted nothing (NaN rate) still counts as a prompt: n = 4, mean drafted 7.5.
    idle = report.MethodResult("sd", 1.0, r, 1.0, 0.0, -1.0, 1.0, 40, 1.0, (-1.0,) * 4, (0.0,) * 4,
                               rates + (math.nan,), drafted=30, accepted=7, drafted_per_prompt=drafted + (0,))
    assert idle.acceptance_se == pytest.approx(
        math.sqrt(((2 - 2 * r) ** 2 + (0 - 18 * r) ** 2 + (5 - 10 * r) ** 2) / 12) / 7.5)
    ar = report.MethodResult("ar", math.nan, math.nan, 1.0, 0.0, -1.0, 1.0, 40, 1.0, (-1.0,) * 2, (0.0,) * 2,
                             (math.nan,) * 2, drafted_per_prompt=(0, 0))
    assert math.isnan(ar.acceptance_se)


def test_evaluate_records_the_counts_and_a_results_file_keeps_them(experiment_pair, tmp_path):
    target, draft, tokenizer = experiment_pair
    rows = harness.evaluate(TASKS["gsm8k"], gsm8k_examples(4), target, draft, tokenizer,
                            harness.method_specs(["ar", "sd"], []), max_draft=3, max_new_tokens=6, batch_size=2,
                            progress=False)
    for row in rows:
        assert len(row.tokens_per_prompt) == 4 and sum(row.tokens_per_prompt) == row.new_tokens
        assert len(row.drafted_per_prompt) == 4 and sum(row.drafted_per_prompt) == row.drafted
        sums = [gap * count for gap, count in zip(row.calibration_gap_per_prompt, row.tokens_per_prompt)]
        assert row.calibration_gap == pytest.approx(sum(sums) / sum(row.tokens_per_prompt))
    ar, sd = rows
    assert math.isnan(ar.acceptance_se) and sd.drafted > 0
    accepted = [rate * count for rate, count in zip(sd.acceptance_per_prompt, sd.drafted_per_prompt)]
    assert sd.acceptance_se == pytest.approx(report.ratio_estimate(accepted, sd.drafted_per_prompt)[1])
    assert sum(accepted) == pytest.approx(sd.accepted)
    save_results(str(tmp_path / "results.json"), {"count": 4}, rows)
    loaded = load_results(str(tmp_path / "results.json")).rows
    assert [row.tokens_per_prompt for row in loaded] == [row.tokens_per_prompt for row in rows]
    assert loaded[1].drafted_per_prompt == sd.drafted_per_prompt and loaded[1].calibration_gap == sd.calibration_gap
