"""Calibration beside fidelity: whether a rule's output is as uncertain as the target it should follow.

Fidelity, the mean target log-probability per generated token, rewards sharpening: a sampler that runs colder picks
the target's likelier tokens and scores higher without being closer to what the user asked for. So every report
gives, beside it, two figures at the positions the output visited, both under the target at the user's temperature:

    target entropy   H = mean over positions of H(p_t), how uncertain the target is in the contexts the output reached
    calibration gap  g = fidelity + H = mean of log p_t(y_t) + mean of H(p_t)

For y_t drawn from p_t, E[log p_t(y_t)] = -H(p_t), so g is 0 in expectation for exact sampling at any length (a sum
of zero-mean terms); it is positive when the output is sharper than the target (the likelier tokens, over-chosen),
negative when it picks tokens the target finds unlikely. Each prompt gives one g (its fidelity plus its entropy),
and the reports give the mean over prompts with its standard error, paired like every other figure. A rule whose g
is above :data:`SHARPER_THRESHOLD` is marked "sharper than the target" wherever it is reported: its fidelity is
bought by running colder, not by following the target more closely.
"""

from __future__ import annotations

import math
from typing import Sequence

SHARPER_THRESHOLD = 0.1  # nats per token of g above which a rule is marked sharper than the target
SHARPER_MARK = "sharper than the target"

LEGEND = ("fidelity: mean target log-probability per generated token; target entropy: mean entropy of the target "
          "at the positions the output visited; g = fidelity + target entropy, 0 in expectation for exact sampling, "
          f"above +{SHARPER_THRESHOLD:g} marked \"{SHARPER_MARK}\" (fidelity gained by running colder, not by "
          "following the target). All under the target at the sampling temperature, +- 1 s.e. over prompts.")


def is_sharper(gap: float) -> bool:
    """Whether a calibration gap marks its rule as sharper than the target (NaN: never)."""
    return not math.isnan(gap) and gap > SHARPER_THRESHOLD


def marked(text: str, gap: float) -> str:
    """``text`` (a rule's label or its g cell) followed by the mark where ``gap`` makes it sharper than the target."""
    return f"{text} ({SHARPER_MARK})" if is_sharper(gap) else text


def missing_entropy_note(rows: Sequence) -> str:
    """A note naming the rows some of whose prompts have a fidelity but no target entropy (parts saved before the
    entropy was recorded, joined with NaN there), and over how many prompts their entropy and g are taken; "" where
    every prompt has both."""
    partial = []
    for row in rows:
        scored = [not math.isnan(value) for value in row.fidelity_per_prompt]
        missing = [has and math.isnan(entropy) for has, entropy in zip(scored, row.entropy_values)]
        if any(missing):
            partial.append(f"{row.label} ({sum(scored) - sum(missing)} of {sum(scored)})")
    if not partial:
        return ""
    return ("Note: some results were saved without the target entropy (written before it was recorded); their "
            "prompts count as NaN there, so the target entropy and g of these rules cover only the prompts that have "
            "it: " + ", ".join(partial) + ".")
