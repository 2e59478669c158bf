"""What a head learned, read off the runs it decided: every per-token weight w it handed the verifier, and which draft
tokens it trusted least.

A head's mean w says little: a head that gives w = 0.5 everywhere and one that gives 0 to punctuation and 1 to
numbers have the same mean. The decoding loop records, for each round, the tokens the draft proposed and the w the
head chose for each (:class:`diversed_ext.decoding.RoundStats`); this module gathers them over generations, draws
their histogram and lists the tokens that most often fell among the lowest weights.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

from .plots import new_figure, save_figure
from .report import markdown_rows

LOW_WEIGHT_QUANTILE = 0.1  # "lowest w" means at or below this quantile of all the weights a head chose
HISTOGRAM_BINS = 40


@dataclass
class WeightUsage:
    """Every weight a head chose, with the draft token it was applied to (same order, same length)."""

    weights: tuple
    tokens: tuple

    @property
    def mean(self) -> float:
        """Mean w over every drafted position (NaN when the head never ran)."""
        return sum(self.weights) / len(self.weights) if self.weights else math.nan

    def low_weight_threshold(self, quantile: float = LOW_WEIGHT_QUANTILE) -> float:
        """The ``quantile`` of the weights (the lower of the two order statistics around it)."""
        if not self.weights:
            return math.nan
        ordered = sorted(self.weights)
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]

    def lowest_weight_tokens(self, top: int = 15, quantile: float = LOW_WEIGHT_QUANTILE) -> list[tuple]:
        """The ``top`` tokens seen most often at or below the low-weight threshold:
        ``(token, times among the lowest, times drafted, mean w of that token)``, most frequent first."""
        threshold = self.low_weight_threshold(quantile)
        low = Counter(token for token, weight in zip(self.tokens, self.weights) if weight <= threshold)
        drafted = Counter(self.tokens)
        totals: dict = defaultdict(float)
        for token, weight in zip(self.tokens, self.weights):
            totals[token] += weight
        ranked = sorted(low.items(), key=lambda item: (-item[1], totals[item[0]] / drafted[item[0]], item[0]))
        return [(token, count, drafted[token], totals[token] / drafted[token]) for token, count in ranked[:top]]


def weight_usage(generations: Iterable) -> Optional[WeightUsage]:
    """The weights recorded in the rounds of ``generations`` (:class:`diversed_ext.decoding.Generation`), or None
    when no head ran in any of them."""
    weights, tokens = [], []
    for generation in generations:
        for stats in generation.rounds:
            if stats.weights:
                weights.extend(stats.weights)
                tokens.extend(stats.draft_tokens[:len(stats.weights)])
    return WeightUsage(tuple(weights), tuple(tokens)) if weights else None


def lowest_weight_table(usages: Mapping[str, WeightUsage], tokenizer, top: int = 15) -> str:
    """A markdown section per head: the tokens most often among its lowest weights (see
    :meth:`WeightUsage.lowest_weight_tokens`), decoded with ``tokenizer``."""
    sections = []
    for label, usage in usages.items():
        threshold = usage.low_weight_threshold()
        rows = [[_token_text(tokenizer, token), str(count), str(drafted), f"{mean_weight:.3f}"]
                for token, count, drafted, mean_weight in usage.lowest_weight_tokens(top)]
        sections.append(f"### {label}: {len(usage.weights)} drafted tokens, mean w {usage.mean:.3f}; lowest "
                        f"{LOW_WEIGHT_QUANTILE:.0%}: w <= {threshold:.3f}\n\n"
                        + markdown_rows(["token", "times among the lowest w", "times drafted", "mean w"], rows))
    return "\n\n".join(sections)


def _token_text(tokenizer, token: int) -> str:
    """The token as a table cell: decoded, with whitespace and pipes made visible."""
    text = tokenizer.decode([token], skip_special_tokens=False) if tokenizer is not None else str(token)
    text = text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "\\n").replace(" ", "\u2423")
    return f"`{text}` ({token})" if text else f"({token})"


def plot_weight_histograms(usages: Mapping[str, WeightUsage], path: str) -> str:
    """One histogram of per-token w per head, on a shared [0, 1] axis, saved as a PNG at ``path``."""
    figure, axis = new_figure(1, (7, 3.8))
    bins = [index / HISTOGRAM_BINS for index in range(HISTOGRAM_BINS + 1)]
    for label, usage in usages.items():
        axis.hist(usage.weights, bins=bins, histtype="step", linewidth=1.5,
                  label=f"{label} (mean {usage.mean:.2f}, {len(usage.weights)} tokens)")
    axis.set_xlabel("w on the target, per drafted token")
    axis.set_ylabel("drafted tokens")
    axis.set_xlim(0, 1)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    return save_figure(figure, path)
