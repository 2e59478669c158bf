"""Reports of experiments: per-method results, standard errors, paired differences and tables (the plots:
:mod:`.plots`).

Prompts are the independent samples: every method runs on the same prompts with the same seeds, so comparisons are
paired over prompts, and standard errors are taken over prompts (drafts within one generation are correlated).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from ..decoding import DecodingSummary
from .calibration import gap_terms, marked


@dataclass
class MethodResult:
    """One method's totals over the evaluation prompts."""

    label: str
    weight: float  # static w, 1 for sd, the head's mean w for diversed, NaN for ar
    acceptance: float
    tokens_per_pass: float
    quality: float  # mean task reward
    fidelity: float  # mean over generations of the mean target log-prob per token
    tokens_per_second: float
    new_tokens: int
    seconds: float
    fidelity_per_prompt: tuple = ()  # prompt by prompt (NaN where nothing was generated), for paired comparisons
    quality_per_prompt: tuple = ()
    acceptance_per_prompt: tuple = ()  # NaN where nothing was drafted
    weight_usage: Optional[object] = None  # a head's per-token weights (research.head_usage.WeightUsage)
    drafts_per_round: float = math.nan  # mean tokens drafted per target pass
    batch_work: tuple = ()  # (new tokens, decoding seconds) of each batch of prompts, batches in order
    draft_length: str = ""  # the draft-length policy's name ("" for ar)
    target_passes: int = 0  # the exact counts behind the rates above, for joining runs (research.result_sets)
    drafted: int = 0
    accepted: int = 0
    # mean target entropy H(p) at the positions each prompt's output visited (research.calibration); () where none
    # was recorded: rows saved before it existed
    entropy_per_prompt: tuple = ()
    # mean per-position KL(out || target) and TV(out, target) of each prompt's visited positions
    # (research.divergence; FLy's TV by research.fly_divergence, its KL NaN); () where none was recorded
    kl_per_prompt: tuple = ()
    tv_per_prompt: tuple = ()
    # the tokens each prompt generated (its fidelity and entropy are means over them) and drafted: the weights of the
    # pooled g and of the acceptance's standard error; () where none was recorded
    tokens_per_prompt: tuple = ()
    drafted_per_prompt: tuple = ()

    def __post_init__(self):
        # Counts that do not pair up with the prompts (a row joined from parts, some saved without them) are dropped:
        # weighting one prompt by another's length would be worse than not weighting at all.
        for name, values in (("tokens_per_prompt", self.fidelity_per_prompt),
                             ("drafted_per_prompt", self.acceptance_per_prompt)):
            if len(getattr(self, name)) != len(values):
                setattr(self, name, ())

    @property
    def fidelity_se(self) -> float:
        """Standard error of the mean fidelity over prompts."""
        return standard_error([value for value in self.fidelity_per_prompt if not math.isnan(value)])

    @property
    def acceptance_se(self) -> float:
        """Standard error of the acceptance, accepted over drafted pooled over prompts (:func:`ratio_estimate`); where
        the prompts' drafted tokens were not recorded, that of the mean of the per-prompt rates."""
        if not self.drafted_per_prompt or any(map(math.isnan, self.drafted_per_prompt)):
            return standard_error(_finite(self.acceptance_per_prompt))
        accepted = [0.0 if drafted == 0 else rate * drafted
                    for rate, drafted in zip(self.acceptance_per_prompt, self.drafted_per_prompt)]
        return ratio_estimate(accepted, self.drafted_per_prompt)[1]

    @property
    def quality_se(self) -> float:
        """Standard error of the mean task quality over prompts."""
        return standard_error(list(self.quality_per_prompt))

    @property
    def entropy_values(self) -> tuple:
        """The target entropy prompt by prompt, aligned with ``fidelity_per_prompt``: NaN at every prompt where none
        was recorded."""
        return tuple(self.entropy_per_prompt) or (math.nan,) * len(self.fidelity_per_prompt)

    @property
    def entropy(self) -> float:
        """Mean over prompts of the target entropy at the positions visited (over the prompts that have one)."""
        return _mean(_finite(self.entropy_values))

    @property
    def entropy_se(self) -> float:
        """Standard error of :attr:`entropy` over prompts."""
        return standard_error(_finite(self.entropy_values))

    @property
    def calibration_gap_per_prompt(self) -> tuple:
        """g = fidelity + target entropy, prompt by prompt (research.calibration): 0 in expectation for exact
        sampling, positive where the output is sharper than the target; NaN where either is missing."""
        return tuple(value + entropy for value, entropy in zip(self.fidelity_per_prompt, self.entropy_values))

    @property
    def calibration_gap(self) -> float:
        """g pooled over the tokens of every prompt that has it, sum of T_i g_i over sum of T_i (research.calibration:
        the mean of per-prompt g is biased once EOS stops outputs); the mean over prompts where no T_i were recorded."""
        return ratio_estimate(*gap_terms(self.calibration_gap_per_prompt, self.tokens_per_prompt))[0]

    @property
    def calibration_gap_se(self) -> float:
        """Standard error of :attr:`calibration_gap` over prompts (the ratio estimator's)."""
        return ratio_estimate(*gap_terms(self.calibration_gap_per_prompt, self.tokens_per_prompt))[1]

    @property
    def kl_values(self) -> tuple:
        """The per-position KL to the target prompt by prompt, NaN at every prompt where none was recorded."""
        return tuple(self.kl_per_prompt) or (math.nan,) * len(self.fidelity_per_prompt)

    @property
    def tv_values(self) -> tuple:
        """The per-position TV to the target prompt by prompt, NaN at every prompt where none was recorded."""
        return tuple(self.tv_per_prompt) or (math.nan,) * len(self.fidelity_per_prompt)

    @property
    def kl(self) -> float:
        """Mean over prompts of the per-position KL(out || target) (research.divergence)."""
        return _mean(_finite(self.kl_values))

    @property
    def kl_se(self) -> float:
        """Standard error of :attr:`kl` over prompts."""
        return standard_error(_finite(self.kl_values))

    @property
    def tv(self) -> float:
        """Mean over prompts of the per-position TV(out, target)."""
        return _mean(_finite(self.tv_values))

    @property
    def tv_se(self) -> float:
        """Standard error of :attr:`tv` over prompts."""
        return standard_error(_finite(self.tv_values))


def _finite(values: Sequence[float]) -> list[float]:
    return [value for value in values if not math.isnan(value)]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean of ``values`` (NaN for fewer than two)."""
    if len(values) < 2:
        return math.nan
    mean = _mean(values)
    return math.sqrt(sum((value - mean) ** 2 for value in values) / (len(values) - 1) / len(values))


def ratio_estimate(numerators: Sequence[float], denominators: Sequence[float]) -> tuple[float, float]:
    """(r, s.e.): the pooled ratio r = sum a_i / sum d_i over n prompts (a_i, d_i: prompt i's total and count) and its
    standard error by the delta method over prompts, sqrt(sum (a_i - r d_i)^2 / (n (n - 1))) / mean(d). With every
    d_i = 1 these are the mean and :func:`standard_error`. r is NaN where sum d = 0, the s.e. also for n < 2."""
    total = sum(denominators)
    if not total:
        return math.nan, math.nan
    ratio, count = sum(numerators) / total, len(numerators)
    if count < 2:
        return ratio, math.nan
    spread = sum((a - ratio * d) ** 2 for a, d in zip(numerators, denominators)) / (count * (count - 1))
    return ratio, math.sqrt(spread) / (total / count)


@dataclass
class PairedDifference:
    """Mean over prompts of (method - baseline), with its standard error (same prompts and seeds: paired)."""

    baseline: str
    fidelity: float
    fidelity_se: float
    quality: float
    quality_se: float


def paired_difference(values: Sequence[float], baseline: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of ``values - baseline`` element by element (same prompts and seeds), skipping pairs
    where either side is NaN."""
    differences = [a - b for a, b in zip(values, baseline) if not (math.isnan(a) or math.isnan(b))]
    return _mean(differences), standard_error(differences)


def _static_rows(results: Sequence[MethodResult], key) -> list[MethodResult]:
    """The static ensembles among ``results`` (sd is static w = 1), sorted by ``key``."""
    return sorted((row for row in results if row.label.startswith("static w=") or row.label == "sd"), key=key)


def compare_to_baselines(results: Sequence[MethodResult], label: str = "diversed") -> list[PairedDifference]:
    """Fidelity and quality of ``label`` against sd (static w = 1) and against the static frontier at the same
    acceptance: the static ensembles on either side of its acceptance, interpolated linearly prompt by prompt."""
    rows = {row.label: row for row in results}
    if label not in rows or not rows[label].fidelity_per_prompt:
        return []
    method = rows[label]
    static = _static_rows(results, key=lambda row: row.acceptance)
    comparisons = []
    sd = next((row for row in static if row.weight == 1.0), None)
    if sd is not None:
        comparisons.append(_difference(method, f"{sd.label} (w = 1)", sd.fidelity_per_prompt, sd.quality_per_prompt))
    bracket = _bracket(static, method.acceptance)
    if bracket is not None:
        low, high, t = bracket
        weight = (1 - t) * low.weight + t * high.weight
        name = f"static frontier at acceptance {method.acceptance:.3f} (w = {weight:.2f})"
        comparisons.append(_interpolated_difference(method, name, low, high, t))
    return comparisons


def _bracket(rows: Sequence[MethodResult], acceptance: float):
    """(low, high, t): the first two consecutive ``rows`` (by rising acceptance) whose acceptances bracket
    ``acceptance``, at t of the way from low to high; None where no pair does."""
    for low, high in zip(rows, rows[1:]):
        if low.acceptance <= acceptance <= high.acceptance and high.acceptance > low.acceptance:
            return low, high, (acceptance - low.acceptance) / (high.acceptance - low.acceptance)
    return None


def _interpolated_difference(method: MethodResult, name: str, low: MethodResult, high: MethodResult,
                             t: float) -> PairedDifference:
    """``method`` against the line from ``low`` to ``high`` at t, interpolated prompt by prompt."""
    return _difference(method, name, _interpolate(low.fidelity_per_prompt, high.fidelity_per_prompt, t),
                       _interpolate(low.quality_per_prompt, high.quality_per_prompt, t))


def compare_to_fly_frontier(results: Sequence[MethodResult], label: str) -> list[PairedDifference]:
    """Fidelity and quality of ``label`` against FLy's frontier at its acceptance (:func:`.baselines.envelope` of
    FLy's points, sd with FLy at any window and threshold, and sd's, FLy that never defers), interpolated prompt by
    prompt between the two corners on either side, or the first corner's own values below its acceptance. Above the
    acceptance FLy reaches at all, the distance is to its highest-acceptance point (FLy has nothing closer to offer);
    none where no FLy point ran."""
    from .baselines import envelope, frontier_at  # baselines builds on this module

    rows = {row.label: row for row in results}
    if label not in rows or not rows[label].fidelity_per_prompt:
        return []
    method = rows[label]
    fly = [row for row in results if _is_plain_fly(row.label) and not math.isnan(row.acceptance + row.fidelity)]
    if not fly:
        return []  # sd alone is no frontier
    corners = envelope(fly + [row for row in results if _is_sd(row.label)], "fidelity")
    found = frontier_at(corners, method.acceptance)
    if found is None:
        return []
    low, high, t, reached = found
    between = f"{low.label} .. {high.label}" if high is not low else f"{low.label}, at {low.acceptance:.3f}"
    name = (f"FLy's frontier at acceptance {method.acceptance:.3f} ({between})" if reached else
            f"FLy's highest acceptance, {low.acceptance:.3f} ({low.label}), below this rule's {method.acceptance:.3f}")
    return [_interpolated_difference(method, name, low, high, t)]


def _is_sd(label: str) -> bool:
    """Standard speculative decoding: "sd", or the static sweep's w = 1."""
    return label in ("sd", "static w=1")


def _is_plain_fly(label: str) -> bool:
    """sd with FLy: "fly", or "fly <settings>" of a sweep."""
    return label == "fly" or label.startswith("fly ")


def _interpolate(low: Sequence[float], high: Sequence[float], t: float) -> tuple:
    if t == 0:
        return tuple(low)  # low itself, also where 0 times an infinite value of high would make NaN
    return tuple((1 - t) * a + t * b for a, b in zip(low, high))


def _difference(method: MethodResult, name: str, fidelity_values, quality_values) -> PairedDifference:
    fidelity_mean, fidelity_se = paired_difference(method.fidelity_per_prompt, fidelity_values)
    quality_mean, quality_se = paired_difference(method.quality_per_prompt, quality_values)
    return PairedDifference(name, fidelity_mean, fidelity_se, quality_mean, quality_se)


def frontier_table(results: Sequence[MethodResult], labels: Sequence[str]) -> str:
    """For each of ``labels``: acceptance, fidelity, the calibration gap g (marked where sharper than the target), the
    fidelity's paired distance above the static line and above FLy's frontier at its acceptance ("-" where that line
    does not reach its acceptance), and the task score with its paired change against sd and its distance above the
    same two lines (taken at the points that line's fidelity picks); +- 1 s.e. over prompts."""
    rows = {row.label: row for row in results}
    lines = []
    for label in labels:
        row = rows[label]
        against_static = compare_to_baselines(results, label)
        above_static = [item for item in against_static if item.baseline.startswith("static f")]
        against_sd = [item for item in against_static if item.baseline.endswith("(w = 1)")]
        above_fly = compare_to_fly_frontier(results, label)
        lines.append([label, with_error(row.acceptance, row.acceptance_se), with_error(row.fidelity, row.fidelity_se),
                      gap_cell(row), *(_paired_cell(found, "fidelity") for found in (above_static, above_fly)),
                      with_error(row.quality, row.quality_se),
                      *(_paired_cell(found, "quality") for found in (against_sd, above_static, above_fly))])
    return markdown_rows(["rule", "acceptance", "fidelity", "g", "above the static line", "above FLy's frontier",
                          "task score", "task: against sd", "task: above the static line",
                          "task: above FLy's frontier"], lines)


def _paired_cell(found: Sequence[PairedDifference], metric: str) -> str:
    """The first paired difference's ``metric`` ("fidelity" or "quality") +- its s.e., or "-" when there is none."""
    if not found:
        return "-"
    return f"{getattr(found[0], metric):+.3f} +- {cell(getattr(found[0], metric + '_se'))}"


def comparison_lines(comparisons: Sequence[PairedDifference], label: str = "diversed") -> str:
    """One line per baseline: paired differences with standard errors."""
    return "\n".join(f"{label} - {item.baseline}: fidelity {item.fidelity:+.3f} +- {item.fidelity_se:.3f}, "
                     f"quality {item.quality:+.3f} +- {item.quality_se:.3f} (paired over prompts, +- 1 s.e.)"
                     for item in comparisons)


def source_comparison_lines(results: Sequence[MethodResult]) -> str:
    """Rows labelled "<method> / <source>" (:func:`~diversed_ext.research.harness.draft_source_specs`): each source
    of a method against that method's first source, one line each, paired over prompts."""
    first_of: dict[str, MethodResult] = {}
    lines = []
    for row in results:
        method = row.label.rsplit(" / ", 1)[0]
        baseline = first_of.setdefault(method, row)
        if baseline is not row:
            difference = _difference(row, baseline.label, baseline.fidelity_per_prompt, baseline.quality_per_prompt)
            lines.append(comparison_lines([difference], row.label))
    return "\n".join(lines)


def cell(value, spec: str = ".3f") -> str:
    """A table cell: ``value`` formatted with ``spec``, or "-" for a missing or NaN value."""
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def with_error(value: float, error: float, spec: str = ".3f") -> str:
    """``value +- error``, or just ``value`` where the error is undefined (fewer than two samples)."""
    return cell(value, spec) + ("" if error is None or math.isnan(error) else f" +- {error:{spec}}")


def markdown_rows(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table: the first column left-aligned, the others right-aligned (numbers)."""
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def gap_cell(row: MethodResult) -> str:
    """The row's calibration gap g +- 1 s.e., marked where it is sharper than the target."""
    gap, error = row.calibration_gap, row.calibration_gap_se
    return marked(cell(gap, "+.3f") + ("" if math.isnan(error) else f" +- {error:.3f}"), gap)


def markdown_table(results: Sequence[MethodResult], metric: str = "quality") -> str:
    """The results as a markdown table (``metric`` names the task-quality column): fidelity (the mean target
    log-probability per token), the target entropy at the positions visited and g beside it
    (:mod:`~diversed_ext.research.calibration`), and the per-position KL and TV to the target
    (:mod:`~diversed_ext.research.divergence`)."""
    header = ["method", "w (mean)", "acceptance", "drafts/round", "tokens/pass", metric, "fidelity (mean log p)",
              "target entropy", "g", "KL to target", "TV to target", "tokens/s"]
    return markdown_rows(header, [[row.label, cell(row.weight, ".2f"), cell(row.acceptance),
                                   cell(row.drafts_per_round, ".2f"), cell(row.tokens_per_pass, ".2f"),
                                   with_error(row.quality, row.quality_se), with_error(row.fidelity, row.fidelity_se),
                                   with_error(row.entropy, row.entropy_se), gap_cell(row),
                                   with_error(row.kl, row.kl_se, ".4f"), with_error(row.tv, row.tv_se),
                                   cell(row.tokens_per_second, ".1f")]
                                  for row in results])


def learned_rows(results: Sequence[MethodResult]) -> list[MethodResult]:
    """The rows decided by a head (labelled "diversed" or "diversed:<name>")."""
    return [row for row in results if row.label.split(":")[0] == "diversed"]


def fly_rows(results: Sequence[MethodResult]) -> list[MethodResult]:
    """The rows verified with FLy: "fly" and "fly <settings>" (sd with FLy) and "<method>+fly" (a head's, or a static
    ensemble's)."""
    return [row for row in results if _is_plain_fly(row.label) or "+fly" in row.label]


def gate_rows(results: Sequence[MethodResult]) -> list[MethodResult]:
    """The rows verified with the log-probability gate: "gate ..." (sd with it) and "<method>+gate ..."."""
    return [row for row in results if row.label.split(" ")[0] == "gate" or "+gate" in row.label]


def format_table(rows: Sequence[tuple[str, DecodingSummary]], baseline: str = "ar") -> str:
    """A plain-text table of summaries: acceptance, tokens per target pass, tokens/s and speed against ``baseline``."""
    reference = dict(rows).get(baseline)
    header = f"{'method':<16}{'acceptance':>11}{'tokens/pass':>13}{'tokens/s':>10}{'vs ' + baseline:>9}"
    lines = [header, "-" * len(header)]
    for name, summary in rows:
        acceptance = "-" if math.isnan(summary.acceptance_rate) else f"{summary.acceptance_rate:.3f}"
        speed = summary.tokens_per_second / reference.tokens_per_second if reference else math.nan
        lines.append(f"{name:<16}{acceptance:>11}{summary.tokens_per_pass:>13.2f}{summary.tokens_per_second:>10.1f}"
                     f"{speed:>8.2f}x")
    return "\n".join(lines)
