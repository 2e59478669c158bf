"""The baselines a user has for free, and each rule's distance above them on every plane.

The families: the static ensembles (w from 0 to 1, sd the w = 1 end), FLy (sd with FLy at each window and threshold),
the temperature family (sd run at T' < T, scored at the user's T: "sd T=.."), and Medusa's typical acceptance
("typical eps=.. delta=.."). sd at the user's temperature belongs to every family: it is the exact end each one starts
from. Each family's frontier at an acceptance is the best figure it reaches at that acceptance or more, on the best
envelope of its points (running one setting on a share of the prompts and another on the rest reaches every point of
the segment between them, and every figure here is a mean over prompts; a point with more acceptance and a better
figure beats any below it: :func:`corners`). A rule's distance to it is paired prompt by prompt, interpolated between
the two corners on either side of the rule's acceptance; below the first corner's acceptance, to that corner; above
the family's highest acceptance, to that point, marked "beyond".

The planes: (acceptance, fidelity), higher is better; (acceptance, KL to the target) and (acceptance, TV), lower is
better. A distance is signed so that positive means better than the family. A rule is "above" only where it is above
every family that reaches its acceptance, each by more than two standard errors (a family that does not reach it
offers nothing at that acceptance).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

from .report import (MethodResult, _bracket, _interpolate, _is_plain_fly, _is_sd, cell, gap_cell, markdown_rows,
                     paired_difference, with_error)

# plane -> (the mean's attribute, the per-prompt values' attribute, +1 where higher is better, -1 where lower is)
PLANES = {"fidelity": ("fidelity", "fidelity_per_prompt", 1.0), "KL": ("kl", "kl_values", -1.0),
          "TV": ("tv", "tv_values", -1.0)}
CLEARLY = 2.0  # standard errors a distance must exceed for "above"


def is_temperature_row(label: str) -> bool:
    """sd run at another temperature: "sd T=.."."""
    return label.startswith("sd T=")


def is_typical_row(label: str) -> bool:
    """Medusa's typical acceptance: "typical" or "typical <settings>"."""
    return label == "typical" or label.startswith("typical ")


def is_static_row(label: str) -> bool:
    """A static ensemble ("static w=..") or sd."""
    return label.startswith("static w=") or _is_sd(label)


FAMILIES: dict[str, Callable[[str], bool]] = {
    "static": is_static_row,
    "FLy": lambda label: _is_sd(label) or _is_plain_fly(label),
    "temperature": lambda label: _is_sd(label) or is_temperature_row(label),
    "typical": lambda label: _is_sd(label) or is_typical_row(label),
}


def is_baseline(label: str) -> bool:
    """Whether a row belongs to one of the free baselines' families."""
    return any(member(label) for member in FAMILIES.values())


def envelope(rows: Sequence[MethodResult], plane: str) -> list[MethodResult]:
    """The corners of the family's frontier on ``plane`` (:func:`corners` of the plane's figure signed so that higher
    is better): upper and concave for fidelity, lower and convex for KL and TV, each from its best point on."""
    attribute, _, sign = PLANES[plane]
    return corners(rows, lambda row: sign * getattr(row, attribute))


def corners(rows: Sequence[MethodResult], value: Callable[[MethodResult], float]) -> list[MethodResult]:
    """The corners of the frontier of (acceptance, ``value``), higher better, by rising acceptance: the upper concave
    hull of the rows from its highest point on. The frontier at acceptance a is the best value reachable at acceptance
    >= a: mixing two rules over the prompts reaches every point of the segment between them, and a rule with more
    acceptance and more value is better at a than any below it, so the hull's rising part, left of its highest point,
    is dominated by that point. The frontier is flat at the first corner's value below its acceptance, linear between
    corners, and ends at the last (:func:`frontier_at`). Rows without both figures are left out."""
    points = sorted(((row.acceptance, value(row), row) for row in rows
                     if not (math.isnan(row.acceptance) or math.isnan(value(row)))), key=lambda point: point[:2])
    hull: list[tuple] = []
    for point in points:
        while hull and hull[-1][0] == point[0]:
            hull.pop()  # the same acceptance: the sort put the higher value last
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (point[1] - hull[-2][1])
                                  - (hull[-1][1] - hull[-2][1]) * (point[0] - hull[-2][0])) >= 0:
            hull.pop()  # hull[-1] lies on or under the segment from hull[-2] to this point
        hull.append(point)
    # The highest corner, the last of equal ones (more acceptance at the same value): the frontier starts there.
    peak = max(range(len(hull)), key=lambda index: (hull[index][1], index), default=0)
    return [row for _, _, row in hull[peak:]]


def frontier_at(hull: Sequence[MethodResult], acceptance: float):
    """(low, high, t, reached): the frontier with corners ``hull`` (:func:`corners`) at ``acceptance`` is (1 - t) low
    + t high, prompt by prompt: the first corner itself (t = 0) at or below its acceptance, the two corners on either
    side further on. Above the last corner's acceptance the family has nothing closer to offer than that corner:
    it, with ``reached`` False. None without corners (or at NaN)."""
    if not hull or math.isnan(acceptance):
        return None
    if acceptance > hull[-1].acceptance:
        return hull[-1], hull[-1], 0.0, False
    if acceptance <= hull[0].acceptance:
        return hull[0], hull[0], 0.0, True
    return (*_bracket(hull, acceptance), True)


def distance(results: Sequence[MethodResult], label: str, family: str,
             plane: str) -> Optional[tuple[float, float, bool]]:
    """(mean, s.e., reached) of ``label``'s paired distance above ``family``'s frontier on ``plane`` at its
    acceptance (positive: better than the family; :func:`frontier_at`); ``reached`` is False where the rule's
    acceptance is above all the family's, the distance then taken to the family's highest-acceptance point. None
    where the family did not run or lacks the figure."""
    rows = {row.label: row for row in results}
    method = rows[label]
    _, values, sign = PLANES[plane]
    members = [row for row in results if FAMILIES[family](row.label) and row.label != label
               and not math.isnan(getattr(row, PLANES[plane][0]))]
    if all(_is_sd(row.label) for row in members):
        return None  # the family did not run, or has no such figure: sd alone is no frontier
    hull = envelope(members, plane)
    found = frontier_at(hull, method.acceptance)
    if found is None:
        return None
    low, high, t, reached = found
    line = _interpolate(getattr(low, values), getattr(high, values), t)
    mean, error = paired_difference([sign * value for value in getattr(method, values)],
                                    [sign * value for value in line])
    return None if math.isnan(mean) else (mean, error, reached)


def above_all(results: Sequence[MethodResult], label: str, plane: str) -> Optional[bool]:
    """Whether ``label`` is clearly above every family's frontier that reaches its acceptance on ``plane`` (None
    where none does). A family whose acceptances all lie below the rule's does not count: it has nothing to offer
    at that acceptance, so it cannot be better there."""
    found = [distance(results, label, family, plane) for family in FAMILIES]
    found = [item[:2] for item in found if item is not None and item[2]]
    if not found:
        return None
    return all(mean > CLEARLY * (0.0 if math.isnan(error) else error) and mean > 0 for mean, error in found)


def _distance_cell(item: Optional[tuple[float, float, bool]], spec: str) -> str:
    """The distance +- its s.e.; marked "(beyond)" where the family does not reach the rule's acceptance."""
    if item is None:
        return "-"
    return f"{item[0]:{spec}} +- {cell(item[1], spec.lstrip('+'))}" + ("" if item[2] else " (beyond)")


def baseline_table(results: Sequence[MethodResult], labels: Sequence[str], plane: str = "fidelity") -> str:
    """For each of ``labels``: acceptance, fidelity, g, KL and TV to the target, the paired distance above each free
    baseline's frontier on ``plane`` ("-" where that family does not reach its acceptance or has no figure), and
    whether it is above all of them (by more than 2 s.e. each)."""
    spec = "+.3f" if plane == "fidelity" else "+.4f"
    lines = []
    for label in labels:
        row = next(row for row in results if row.label == label)
        verdict = above_all(results, label, plane)
        lines.append([label, with_error(row.acceptance, row.acceptance_se), with_error(row.fidelity, row.fidelity_se),
                      gap_cell(row), with_error(row.kl, row.kl_se, ".4f"), with_error(row.tv, row.tv_se),
                      *(_distance_cell(distance(results, label, family, plane), spec) for family in FAMILIES),
                      "-" if verdict is None else ("yes" if verdict else "no")])
    header = ["rule", "acceptance", "fidelity", "g", "KL", "TV",
              *(f"{plane} above {family}" for family in FAMILIES), "above all"]
    return markdown_rows(header, lines)


LEGEND = ("Baselines a user has for free: static ensembles, FLy, the temperature family (sd at T' < T, scored at T) "
          "and Medusa's typical acceptance, sd at T in each. KL and TV: the rule's per-position output law against "
          "the target at the positions visited (FLy: TV by an unbiased Monte Carlo estimate of its deferrals, no KL). "
          "A distance is paired over prompts against the family's frontier at the rule's acceptance, positive where "
          "the rule is better (more fidelity, less KL or TV); \"(beyond)\": the family does not reach the rule's "
          "acceptance, the distance is to its highest-acceptance point; \"above all\": better than every family "
          "reaching its acceptance by more than 2 s.e.")


def placed_rows(results: Sequence[MethodResult]) -> list[str]:
    """The labels the baseline tables place: every row that is not itself a free baseline (heads, the gate, FLy
    with a head or a static ensemble), and the temperature and typical rows themselves (against the others)."""
    return [row.label for row in results
            if not is_baseline(row.label) or is_temperature_row(row.label) or is_typical_row(row.label)]
