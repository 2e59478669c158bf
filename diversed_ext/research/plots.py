"""The plots of experiments: the pareto figure of ``diversed pareto`` and ``report``, and the training curve."""

from __future__ import annotations

import itertools
import math
import os
from typing import Optional, Sequence

from .calibration import SHARPER_MARK, SHARPER_THRESHOLD, is_sharper, marked
from .baselines import envelope, is_temperature_row, is_typical_row
from .report import MethodResult, _is_plain_fly, _is_sd, _static_rows, fly_rows, gate_rows, learned_rows


def new_figure(columns: int, figsize: tuple):
    """A figure with ``columns`` axes side by side, drawn off-screen (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, columns, figsize=figsize)


def save_figure(figure, path: str) -> str:
    """Lay out ``figure``, write it as a PNG at ``path`` (creating its folder) and free it; returns ``path``."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")  # "tight": a legend beside the axes is kept
    plt.close(figure)
    return path


_PARETO_PANELS = (  # (x, y, x label): the frontier first
    ("acceptance", "fidelity", "acceptance rate"), ("acceptance", "kl", "acceptance rate"),
    ("acceptance", "tv", "acceptance rate"), ("acceptance", "calibration_gap", "acceptance rate"),
    ("acceptance", "entropy", "acceptance rate"), ("acceptance", "quality", "acceptance rate"),
    ("weight", "acceptance", "w on the target (a head's mean w)"), ("tokens_per_second", "fidelity", "tokens/s"))
_ERRORS = {"acceptance": "acceptance_se", "fidelity": "fidelity_se", "quality": "quality_se",
           "calibration_gap": "calibration_gap_se", "entropy": "entropy_se", "kl": "kl_se", "tv": "tv_se"}
_Y_LABELS = {"fidelity": "fidelity: mean target log p per token", "calibration_gap": "g = fidelity + target entropy",
             "entropy": "target entropy at the positions visited",
             "kl": "KL(output || target) per position", "tv": "TV(output, target) per position"}
_ENVELOPE_PLANES = {"fidelity": "fidelity", "kl": "KL", "tv": "TV"}
_HEAD_MARKERS = "*Dsv^P"


def _value_and_error(row: MethodResult, name: str) -> tuple[float, float]:
    error = getattr(row, _ERRORS[name]) if name in _ERRORS else math.nan
    return getattr(row, name), (0.0 if math.isnan(error) else error)


def plot_pareto(results: Sequence[MethodResult], path: str, metric: str = "quality") -> str:
    """The static frontier (a line through the sweep over w) and every head's and FLy row's point, +- one standard
    error over prompts: fidelity, the per-position KL and TV to the target (FLy's frontier on each plane it has; the
    temperature family and typical acceptance as lines from sd), the calibration gap g, the target entropy and
    quality against acceptance, acceptance
    against w, fidelity against tokens/s (where the rows have speeds). Rules sharper than the target
    (:mod:`.calibration`) are marked so in the legend and beside their static weight; the g panel draws the line
    above which they are."""
    static = _static_rows(results, key=lambda row: row.weight)
    # Rows joined from several runs have no tokens/s (speeds of different runs do not compare): no speed panel then;
    # rows saved before the entropy was recorded have no g: no g or entropy panels when none has one.
    panels = [panel for panel in _PARETO_PANELS
              if all(any(not math.isnan(getattr(row, name)) for row in results) for name in panel[:2])]
    figure, axes = new_figure(len(panels), (4.5 * len(panels), 4.2))
    for axis, (x_name, y_name, x_label) in zip(axes, panels):
        points = [(*_value_and_error(row, x_name), *_value_and_error(row, y_name)) for row in static]
        if points:
            x, x_error, y, y_error = zip(*points)
            axis.errorbar(x, y, xerr=x_error, yerr=y_error, fmt="o-", capsize=2, label="static ensembles")
        for row, (x_value, _, y_value, _) in zip(static, points):
            sharper = is_sharper(row.calibration_gap)
            axis.annotate(f"{row.weight:g}" + (" (sharper)" if sharper else ""), (x_value, y_value), fontsize=7)
        fly = [row for row in results if _is_plain_fly(row.label)]
        if fly:
            axis.scatter([getattr(row, x_name) for row in fly], [getattr(row, y_name) for row in fly], marker="x",
                         color="grey", label="FLy (each W, tau)")
        if fly and x_name == "acceptance" and y_name in _ENVELOPE_PLANES:
            frontier = envelope(fly + [row for row in results if _is_sd(row.label)], _ENVELOPE_PLANES[y_name])
            axis.plot([row.acceptance for row in frontier], [getattr(row, y_name) for row in frontier], "--",
                      color="grey", label="FLy's frontier")
        for member, style, name in ((is_temperature_row, "v-", "sd at T' (temperature family)"),
                                    (is_typical_row, "P-", "typical acceptance (Medusa)")):
            family = sorted((row for row in results if member(row.label) or _is_sd(row.label)),
                            key=lambda row: row.acceptance)
            if len(family) > 1 and x_name == "acceptance":  # sd alone is already on the static line
                axis.plot([getattr(row, x_name) for row in family], [getattr(row, y_name) for row in family], style,
                          alpha=0.7, label=name)
        placed = {row.label: row for row in learned_rows(results) + gate_rows(results) + fly_rows(results)
                  if not _is_plain_fly(row.label)}  # a head's row with the gate is one point
        for marker, row in zip(itertools.cycle(_HEAD_MARKERS), placed.values()):
            x_value, x_error = _value_and_error(row, x_name)
            y_value, y_error = _value_and_error(row, y_name)
            axis.errorbar([x_value], [y_value], xerr=[x_error], yerr=[y_error], fmt=marker, markersize=10,
                          capsize=2, label=marked(row.label, row.calibration_gap))
        if y_name == "calibration_gap":
            axis.axhline(0.0, color="black", linewidth=0.8)  # exact sampling's expectation
            axis.axhline(SHARPER_THRESHOLD, color="tab:red", linestyle=":", linewidth=1)
            axis.annotate(SHARPER_MARK, (0.02, SHARPER_THRESHOLD), xycoords=("axes fraction", "data"), fontsize=7,
                          color="tab:red", va="bottom")
        axis.set_xlabel(x_label)
        axis.set_ylabel(metric if y_name == "quality" else _Y_LABELS.get(y_name, y_name))
        axis.grid(alpha=0.3)
    # Beside the panels, not on one: with a dozen rules a legend inside covers the frontier's points.
    handles, labels = axes[0].get_legend_handles_labels()
    axes[-1].legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    axes[0].set_title("fidelity rewards sharpening: read it with g beside it", fontsize=9)
    return save_figure(figure, path)


def plot_training_curve(records: list[dict], path: str) -> Optional[str]:
    """Mean weight, expected acceptance (and KL to the target, where the run logged it), task reward and fidelity
    against the step, as a PNG."""
    if not records:
        return None
    steps = [record["step"] for record in records]
    figure, axes = new_figure(3, (13, 3.6))
    axes[0].plot(steps, [r["mean_weight"] for r in records], label="mean w (on target)")
    axes[0].plot(steps, [r["expected_acceptance"] for r in records], label="expected acceptance 1 - w TV")
    divergences = [r.get("expected_kl", math.nan) for r in records]
    if not all(math.isnan(value) for value in divergences):
        axes[0].plot(steps, divergences, label="expected KL(nu || p), nats", linestyle="--")
    axes[0].set_ylim(0, max([1.0] + [value for value in divergences if not math.isnan(value)]))
    axes[0].legend()
    axes[1].plot(steps, [r["task_reward"] for r in records], color="tab:green")
    axes[1].set_title("task reward (batch mean)")
    axes[2].plot(steps, [r["fidelity"] for r in records], color="tab:red")
    axes[2].set_title("fidelity: mean target log-prob / token")
    for axis in axes:
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    return save_figure(figure, path)
