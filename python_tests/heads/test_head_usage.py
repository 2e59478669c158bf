"""What a head learned: the per-token weights recorded by the loop, their histogram and the lowest-weight tokens."""

import math
import os

import pytest
import torch

from diversed_ext.decoding import Generation, RoundStats
from diversed_ext.research.head_usage import (WeightUsage, lowest_weight_table, plot_weight_histograms,
                                              weight_usage)


def generation(*rounds):
    stats = [RoundStats(drafted=len(tokens), accepted=0, emitted=1, draft_tokens=tuple(tokens),
                        weights=tuple(weights)) for tokens, weights in rounds]
    return Generation(prompt_length=1, tokens=torch.zeros(len(stats), dtype=torch.int64), rounds=stats,
                      seconds=1.0, finish_reason="length", seed=0)


def test_weight_usage_gathers_every_round_of_every_generation_in_order():
    usage = weight_usage([generation(([5, 6], [0.1, 0.9]), ([], [])), generation(([7], [0.4]))])
    assert usage.tokens == (5, 6, 7) and usage.weights == (0.1, 0.9, 0.4)
    assert usage.mean == pytest.approx(1.4 / 3)


def test_no_head_means_no_usage():
    assert weight_usage([generation(([5, 6], []))]) is None
    assert math.isnan(WeightUsage((), ()).mean)


def test_lowest_weight_tokens_are_the_most_frequent_below_the_threshold():
    # 20 weights: the lowest 10% are the two smallest (0.01, 0.02), both on token 3; token 4 is low once too but
    # above the threshold.
    tokens = [3, 3] + [4] + [9] * 17
    weights = [0.02, 0.01] + [0.05] + [0.5 + 0.01 * index for index in range(17)]
    usage = WeightUsage(tuple(weights), tuple(tokens))
    assert usage.low_weight_threshold() == pytest.approx(0.05)
    rows = usage.lowest_weight_tokens()
    assert [row[0] for row in rows] == [3, 4]
    token, low_count, drafted, mean_weight = rows[0]
    assert (low_count, drafted) == (2, 2) and mean_weight == pytest.approx(0.015)


class PipeTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return {3: " a|b", 4: "\n"}[ids[0]]


def test_lowest_weight_table_escapes_tokens_and_names_each_head():
    usage = WeightUsage((0.1, 0.2, 0.9), (3, 4, 4))
    table = lowest_weight_table({"diversed:a": usage}, PipeTokenizer())
    assert table.startswith("### diversed:a: 3 drafted tokens, mean w 0.400")
    assert "`\u2423a\\|b` (3)" in table and "`\\n` (4)" not in table.split("\n")[4]
    assert table.count("\n| ") == 2  # the header's row and one token: only w = 0.1 is in the lowest 10%


def test_weight_histogram_is_written(tmp_path):
    usages = {"diversed": WeightUsage((0.1, 0.5, 0.5, 0.9), (1, 2, 3, 4)), "other": WeightUsage((0.3,), (1,))}
    path = plot_weight_histograms(usages, str(tmp_path / "sub" / "weights.png"))
    assert os.path.getsize(path) > 1000
