"""Draft-length policies side by side: for each method, the best fixed K of a sweep and every policy's speed against
it, paired batch by batch (the same prompts and seeds decoded under each policy).

Labels follow :func:`diversed_ext.research.harness.with_draft_lengths`: "<method> / K=<k>" for the fixed sweep,
"<method> / <policy>" for the others.
"""

from __future__ import annotations

import math
from typing import Sequence

from .report import MethodResult, cell, markdown_rows, with_error

SEPARATOR = " / "  # between a method's label and its draft length's


def draft_length_label(method_label: str, draft_length: str) -> str:
    """"sd / gain", "static w=0.5 / K=3": the label of a method's row under one draft length."""
    return f"{method_label}{SEPARATOR}{draft_length}"


def method_of(result: MethodResult) -> str:
    """The method part of a result's label ("static w=0.5" of "static w=0.5 / gain")."""
    return result.label.rsplit(SEPARATOR, 1)[0]


def policy_of(result: MethodResult) -> str:
    """The draft-length part of a result's label ("K=3", "gain"); the policy's name when the label has none."""
    parts = result.label.rsplit(SEPARATOR, 1)
    return parts[1] if len(parts) == 2 else result.draft_length


def best_fixed(results: Sequence[MethodResult]) -> dict[str, MethodResult]:
    """method -> its fixed-K result with the most tokens/s (methods with no fixed-K result are left out)."""
    best: dict[str, MethodResult] = {}
    for result in results:
        if result.draft_length != "fixed":
            continue
        method = method_of(result)
        if method not in best or result.tokens_per_second > best[method].tokens_per_second:
            best[method] = result
    return best


def paired_speedup(result: MethodResult, baseline: MethodResult) -> tuple[float, float]:
    """Throughput over the baseline's on the same batches (all tokens over all decoding seconds, each side), and
    its jackknife standard error over batches: leaving out one batch at a time, so a batch whose text happened to
    run fast under one policy moves the ratio by its share of the work, not by its own ratio."""
    pairs = list(zip(result.batch_work, baseline.batch_work))
    if not pairs:
        return math.nan, math.nan

    def ratio(kept) -> float:
        mine_tokens = sum(mine[0] for mine, _ in kept)
        mine_seconds = sum(mine[1] for mine, _ in kept)
        their_tokens = sum(theirs[0] for _, theirs in kept)
        their_seconds = sum(theirs[1] for _, theirs in kept)
        if min(mine_seconds, their_seconds, their_tokens) <= 0:
            return math.nan
        return (mine_tokens / mine_seconds) / (their_tokens / their_seconds)

    whole = ratio(pairs)
    count = len(pairs)
    if count < 2:
        return whole, math.nan
    leave_one_out = [ratio(pairs[:index] + pairs[index + 1:]) for index in range(count)]
    mean = sum(leave_one_out) / count
    return whole, math.sqrt((count - 1) / count * sum((value - mean) ** 2 for value in leave_one_out))


def _speedup_cell(ratio: float, error: float) -> str:
    return cell(ratio, ".3f") + ("" if math.isnan(ratio) else "x") + ("" if math.isnan(error) else f" +- {error:.3f}")


def against_best_fixed(results: Sequence[MethodResult]) -> list[tuple[MethodResult, bool, float, float]]:
    """(result, whether it is its method's best fixed K, its paired speed-up over that, the speed-up's standard error)
    for every result whose method has a fixed-K result, in order."""
    best = best_fixed(results)
    compared = []
    for result in results:
        baseline = best.get(method_of(result))
        if baseline is not None:
            compared.append((result, result is baseline, *paired_speedup(result, baseline)))
    return compared


def draft_length_table(results: Sequence[MethodResult]) -> str:
    """A markdown table: every drafting result grouped by method, with its throughput over the method's best fixed
    K's on the same batches, +- its jackknife standard error over batches (with one prompt a batch, over prompts).
    Empty when no method has a fixed-K result."""
    rows = [[method_of(result), policy_of(result) + (" (best fixed)" if is_best else ""),
             with_error(result.acceptance, result.acceptance_se), cell(result.drafts_per_round, ".2f"),
             cell(result.tokens_per_pass, ".2f"), cell(result.tokens_per_second, ".1f"),
             _speedup_cell(ratio, ratio_se)]
            for result, is_best, ratio, ratio_se in against_best_fixed(results)]
    if not rows:
        return ""
    header = ["method", "draft length", "acceptance", "drafts/round", "tokens/pass", "tokens/s",
              "vs best fixed K (paired)"]
    return markdown_rows(header, rows)
