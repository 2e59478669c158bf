"""Calibration beside fidelity: whether a rule's output is as uncertain as the target it should follow.

Fidelity, the mean target log-probability per generated token, rewards sharpening: a sampler that runs colder picks
the target's likelier tokens and scores higher without being closer to what the user asked for. So every report
gives, beside it, two figures at the positions the output visited, both under the target at the user's temperature:

    target entropy   H = mean over positions of H(p_t), how uncertain the target is in the contexts the output reached
    calibration gap  g = sum over prompts and positions of (log p_t(y_t) + H(p_t)), over the number of positions

For y_t drawn from p_t, E[log p_t(y_t) + H(p_t)] = 0 given everything before t, so the sum over a prompt's positions
is 0 in expectation for exact sampling, also when EOS ends the output at a length that depends on its tokens (the
length is a stopping time, bounded by the token budget). Its mean per position is not: an output that stops early
divides its terms by a small count (a toy target that ends at once on a likely EOS gave +0.18 nats for exact
sampling). So g pools the tokens of all prompts, a ratio of two sums over prompts, with its standard error by the
delta method over prompts (:func:`~.report.ratio_estimate`); it is the per-prompt fidelity plus entropy weighted by
each prompt's length, so not exactly the sum of the fidelity and entropy columns, which are means over prompts.
Rows saved without their prompts' token counts fall back to the plain mean over prompts, and the reports name them.
g is positive when the output is sharper than the target (the likelier tokens, over-chosen), negative when it picks
tokens the target finds unlikely. A rule whose g is above :data:`SHARPER_THRESHOLD` is marked "sharper than the
target" wherever it is reported: its fidelity is bought by running colder, not by following the target more closely.
"""

from __future__ import annotations

import math
from typing import Sequence

SHARPER_THRESHOLD = 0.1  # nats per token of g above which a rule is marked sharper than the target
SHARPER_MARK = "sharper than the target"

LEGEND = ("fidelity: mean target log-probability per generated token; target entropy: mean entropy of the target "
          "at the positions the output visited; g = fidelity + target entropy pooled over all generated tokens (each "
          "prompt weighted by its length), 0 in expectation for exact sampling, "
          f"above +{SHARPER_THRESHOLD:g} marked \"{SHARPER_MARK}\" (fidelity gained by running colder, not by "
          "following the target). All under the target at the sampling temperature, +- 1 s.e. over prompts.")


def is_sharper(gap: float) -> bool:
    """Whether a calibration gap marks its rule as sharper than the target (NaN: never)."""
    return not math.isnan(gap) and gap > SHARPER_THRESHOLD


def marked(text: str, gap: float) -> str:
    """``text`` (a rule's label or its g cell) followed by the mark where ``gap`` makes it sharper than the target."""
    return f"{text} ({SHARPER_MARK})" if is_sharper(gap) else text


def gap_terms(gaps: Sequence[float], counts: Sequence[float]) -> tuple[list, list]:
    """(numerators, denominators) of g's ratio over prompts from each prompt's g and token count: (T_i g_i, T_i),
    the sum of its log p + H and its length; a prompt that generated nothing is (0, 0), one without a g (its entropy
    not recorded) is left out. Where some prompt with a g lacks its count (``counts`` empty, or NaN there): (g_i, 1),
    the plain mean over prompts."""
    if not is_pooled(gaps, counts):
        finite = [gap for gap in gaps if not math.isnan(gap)]
        return finite, [1.0] * len(finite)
    pairs = [(0.0, 0.0) if count == 0 else (gap * count, float(count))
             for gap, count in zip(gaps, counts) if count == 0 or not math.isnan(gap)]
    return [pair[0] for pair in pairs], [pair[1] for pair in pairs]


def is_pooled(gaps: Sequence[float], counts: Sequence[float]) -> bool:
    """Whether g can pool tokens: every prompt with a g has its token count."""
    return len(counts) == len(gaps) and all(not math.isnan(count) for gap, count in zip(gaps, counts)
                                            if not math.isnan(gap))


def missing_entropy_note(rows: Sequence) -> str:
    """A note naming the rows some of whose prompts have a fidelity but no target entropy (parts saved before the
    entropy was recorded, joined with NaN there), and over how many prompts their entropy and g are taken; and the
    rows whose g or acceptance s.e. could not weight prompts by their token counts (saved before those were
    recorded, or joined from such parts). "" where every prompt has all of them."""
    partial, unweighted = [], []
    for row in rows:
        scored = [not math.isnan(value) for value in row.fidelity_per_prompt]
        missing = [has and math.isnan(entropy) for has, entropy in zip(scored, row.entropy_values)]
        if any(missing):
            partial.append(f"{row.label} ({sum(scored) - sum(missing)} of {sum(scored)})")
        gaps = row.calibration_gap_per_prompt
        if ((not is_pooled(gaps, row.tokens_per_prompt) and any(not math.isnan(gap) for gap in gaps))
                or (row.drafted and not row.drafted_per_prompt)):
            unweighted.append(row.label)
    notes = []
    if partial:
        notes.append("Note: some results were saved without the target entropy (written before it was recorded); "
                     "their prompts count as NaN there, so the target entropy and g of these rules cover only the "
                     "prompts that have it: " + ", ".join(partial) + ".")
    if unweighted:
        notes.append("Note: some results were saved without their prompts' token counts; their g is the plain mean "
                     "over prompts (biased where EOS ends outputs at lengths that depend on them, not pooled over "
                     "tokens) and their acceptance's s.e. that of the mean of per-prompt rates: "
                     + ", ".join(unweighted) + ".")
    return "\n\n".join(notes)
