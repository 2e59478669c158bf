"""Saved results of an evaluation (``results.json``), and several of them read back as one.

A long evaluation is often run in parts: some rules in one process and the rest in another (the same prompts), or
the same rules on more prompts later (the next lines of the data set). Each part is saved with the prompts and
decoding settings it ran under; :func:`merge_result_sets` joins parts on the same prompts rule by rule, then joins
prompt sets prompt by prompt, so the joined rows are what one run over all prompts would report, paired comparisons
included. Rows are joined from their exact counts (tokens, target passes, drafted and accepted tokens), never from
rounded rates.

Two parts on the same prompts must agree on a rule both ran (prompt i's tokens depend only on its seed); parts on
different prompts must share every decoding setting, must not overlap and must continue the seeds (prompt i of the
data set gets the first part's seed plus its distance from the first part's first prompt, as in one run). A rule must
have run under the same settings of its own (its head's folder name and weights digest, its FLy settings: the part's
``"rules"`` record) in every part. Parts must record the same settings: one saved before a setting was recorded
cannot be checked against one that records it, and is refused beside it. Speeds measured in different runs do not
compare (other load, other machines): rows joined from several parts have no tokens/s. Parts saved before the target
entropy was recorded join with NaN at their prompts (where the same rule ran on the same prompts in a newer part too,
the newer one's values are kept); :func:`~.calibration.missing_entropy_note` says which rows that leaves partial.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Sequence

from .report import MethodResult, _mean

# The settings that say which prompts a part ran; everything else in a part's "prompts" record is a decoding setting.
_PROMPT_CHOICE = ("skip", "count", "seed")
# label -> the settings one rule ran under that its label does not say. Parts on the same prompts hold other rules
# by design, so this record is compared rule by rule, not as a whole.
RULE_SETTINGS = "rules"


@dataclass(frozen=True)
class ResultSet:
    """One saved part: ``prompts`` (task, data file, skip, count, seed and the decoding settings), its rows."""

    prompts: dict
    rows: tuple


# Figures derived from the per-prompt values, written for readers of the file (loading recomputes them).
_DERIVED = ("entropy", "entropy_se", "calibration_gap", "calibration_gap_se", "kl", "kl_se", "tv", "tv_se")


def results_records(results: Sequence[MethodResult]) -> list[dict]:
    """Each row's figures and its per-prompt values, as JSON-ready dicts (a head's weight usage left out; the target
    entropy and the calibration gap g with their standard errors added; NaN is written as JSON's NaN)."""
    return [{**{key: value for key, value in dataclasses.asdict(row).items() if key != "weight_usage"},
             **{name: getattr(row, name) for name in _DERIVED}} for row in results]


def save_results(path: str, prompts: dict, results: Sequence[MethodResult]) -> str:
    """Write ``results`` and the ``prompts`` record they ran on to ``path`` (JSON); returns the path."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"prompts": prompts, "rows": results_records(results)}, handle, indent=1)
    return path


def load_results(path: str) -> ResultSet:
    """A part written by :func:`save_results`. ValueError for a file that is not one."""
    with open(path, encoding="utf-8") as handle:
        try:
            saved = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"not JSON ({error})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("prompts"), dict) or not isinstance(saved.get("rows"),
                                                                                                    list):
        raise ValueError("not a results file written by `diversed pareto` (no \"prompts\" and \"rows\")")
    if not saved["rows"]:
        raise ValueError("holds no rows")
    _check_prompts_record(saved["prompts"])
    try:
        rows = tuple(_result_of(row, int(saved["prompts"]["count"])) for row in saved["rows"])
    except TypeError as error:
        raise ValueError(f"a row is not a result ({error})") from None
    return ResultSet(saved["prompts"], rows)


def _check_prompts_record(prompts: dict) -> None:
    """ValueError unless the fields of a part's "prompts" record that the join computes with are of their kind."""
    for name, what, least in (("count", "prompt count", 0), ("skip", "first prompt", 0), ("seed", "seed", None)):
        value = prompts.get(name)
        if (name == "count" or name in prompts) and not _is_whole(value, least):
            raise ValueError(f"its \"prompts\" record has no {what} (\"{name}\": {value!r})")
    if not isinstance(prompts.get("task", ""), (str, type(None))):
        raise ValueError(f"its \"prompts\" record names no task (\"task\": {prompts['task']!r})")
    rules = prompts.get(RULE_SETTINGS, {})
    if not (isinstance(rules, dict) and all(isinstance(settings, dict) for settings in rules.values())):
        raise ValueError(f"its \"prompts\" record's \"{RULE_SETTINGS}\" is not label -> settings: {rules!r}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_whole(value, least) -> bool:
    return _is_number(value) and math.isfinite(value) and value == int(value) and (least is None or value >= least)


def _result_of(row, count: int) -> MethodResult:
    """A saved row as a MethodResult, each field of the kind the report reads (numbers, per-prompt lists of ``count``
    numbers, batch_work's pairs), or ValueError naming the row and the field."""
    if not isinstance(row, dict):
        raise ValueError(f"a row is not an object: {row!r}")
    values = {}
    for field in dataclasses.fields(MethodResult):
        if field.name not in row or field.name == "weight_usage":
            continue
        value, kind = row[field.name], field.type
        if kind in ("str", str):
            ok = isinstance(value, str)
        elif kind in ("float", "int", float, int):
            ok = _is_number(value)
        elif field.name == "batch_work":
            ok = isinstance(value, list) and all(isinstance(pair, list) and len(pair) == 2 and
                                                 all(map(_is_number, pair)) for pair in value)
        else:  # per-prompt values: none saved, or one per prompt
            ok = isinstance(value, list) and all(map(_is_number, value)) and len(value) in (0, count)
        if not ok:
            raise ValueError(f"row {row.get('label')!r}: {field.name} is not what a results file holds: {value!r}")
        values[field.name] = tuple(map(tuple, value)) if field.name == "batch_work" else (
            tuple(value) if isinstance(value, list) else value)
    return MethodResult(**values)


def merge_result_sets(parts: Sequence[ResultSet]) -> tuple[dict, list[MethodResult]]:
    """(prompts, rows): ``parts`` joined, rules of parts on the same prompts side by side, then prompt sets one after
    the other in the order of their first prompt. A rule that some prompt set lacks is left out. ValueError where
    parts cannot be joined: other decoding settings or settings recorded, one rule under two settings of its own or
    with two outcomes, overlapping prompts, or seeds that do not continue."""
    if not parts:
        raise ValueError("no results to merge")
    _check_recorded_alike(parts)
    by_prompts: dict = {}
    rule_settings: dict = {}  # label -> its settings in the first part that ran it
    for part in parts:
        shared = {key: value for key, value in part.prompts.items() if key != RULE_SETTINGS}
        rules = by_prompts.setdefault(json.dumps(shared, sort_keys=True), {})
        for row in part.rows:
            settings = part.prompts.get(RULE_SETTINGS, {}).get(row.label)
            if rule_settings.setdefault(row.label, settings) != settings:
                raise ValueError(f"{row.label!r} ran under other settings in another part "
                                 f"({_words(rule_settings[row.label])}; {_words(settings)}): they cannot be joined")
            known = rules.get(row.label)
            if known is not None and not _same_values(known.fidelity_per_prompt, row.fidelity_per_prompt):
                raise ValueError(f"{row.label!r} ran twice on the same prompts with different outcomes")
            if known is None or (not known.entropy_per_prompt and row.entropy_per_prompt) or (
                    not known.kl_per_prompt and row.kl_per_prompt):
                rules[row.label] = row  # a part that recorded the entropy or the divergences wins over one that did not
    prompt_sets = sorted(((json.loads(key), rules) for key, rules in by_prompts.items()),
                         key=lambda item: item[0].get("skip", 0))
    _check_joinable([prompts for prompts, _ in prompt_sets])
    labels = [label for label in prompt_sets[0][1] if all(label in rules for _, rules in prompt_sets)]
    joined = [_join_prompts([rules[label] for _, rules in prompt_sets]) for label in labels]
    if len(parts) > 1:
        joined = [dataclasses.replace(row, tokens_per_second=math.nan) for row in joined]
    first = prompt_sets[0][0]
    prompts = {**first, "count": sum(prompts.get("count", 0) for prompts, _ in prompt_sets),
               "parts": [{key: prompts.get(key) for key in _PROMPT_CHOICE} for prompts, _ in prompt_sets]}
    if RULE_SETTINGS in parts[0].prompts:
        prompts[RULE_SETTINGS] = {label: rule_settings[label] for label in labels if rule_settings[label] is not None}
    return prompts, joined


def _check_recorded_alike(parts: Sequence[ResultSet]) -> None:
    """Every part records the same settings: a setting one part lacks (saved before it was recorded) cannot be
    checked against another's, so such parts are refused together rather than joined unchecked."""
    recorded = [set(part.prompts) - {"parts"} for part in parts]
    missing = sorted(set.union(*recorded) - set.intersection(*recorded))
    if missing:
        raise ValueError(f"some parts record {', '.join(missing)} and others do not (saved by an older diversed): "
                         "they cannot be checked against each other; rerun the older parts")


def _words(settings) -> str:
    return "none recorded" if not settings else ", ".join(f"{key} {value}" for key, value in settings.items())


def _same_values(first: Sequence[float], second: Sequence[float]) -> bool:
    """Equal prompt by prompt, NaN (nothing generated) equal to NaN."""
    return len(first) == len(second) and all(a == b or (math.isnan(a) and math.isnan(b))
                                              for a, b in zip(first, second))


def _check_joinable(prompt_sets: Sequence[dict]) -> None:
    def settings(prompts):
        return {key: value for key, value in prompts.items() if key not in _PROMPT_CHOICE + ("parts",)}

    first = settings(prompt_sets[0])
    for other in map(settings, prompt_sets[1:]):
        if other != first:
            differing = sorted(key for key in set(other) | set(first) if other.get(key) != first.get(key))
            raise ValueError(f"parts ran under different settings ({', '.join(differing)}): they cannot be joined")
    skip, seed = prompt_sets[0].get("skip", 0), prompt_sets[0].get("seed")
    for other in prompt_sets[1:]:
        continued = None if seed is None else seed + other.get("skip", 0) - skip
        if other.get("seed") != continued:
            raise ValueError(f"parts do not continue the seeds: the part from prompt {other.get('skip', 0)} ran with "
                             f"seed {other.get('seed')}, where one run from prompt {skip} with seed {seed} gives that "
                             f"prompt seed {continued}: rerun it with --seed {continued}")
    for before, after in zip(prompt_sets, prompt_sets[1:]):
        if before.get("skip", 0) + before.get("count", 0) > after.get("skip", 0):
            raise ValueError(f"parts overlap: prompts from {before.get('skip', 0)} ({before.get('count', 0)} of them) "
                             f"and from {after.get('skip', 0)}")


def _join_prompts(rows: Sequence[MethodResult]) -> MethodResult:
    """One rule's rows over consecutive prompt sets as one row (its tokens/s left to :func:`merge_result_sets`)."""
    if len(rows) == 1:
        return rows[0]
    drafted = sum(row.drafted for row in rows)
    accepted = sum(row.accepted for row in rows)
    passes = sum(row.target_passes for row in rows)
    new_tokens = sum(row.new_tokens for row in rows)
    fidelities = sum((tuple(row.fidelity_per_prompt) for row in rows), ())
    quality = sum((tuple(row.quality_per_prompt) for row in rows), ())
    # A head's mean weight is a mean over its drafted tokens.
    weight = (sum(row.weight * row.drafted for row in rows) / drafted
              if drafted and len({row.weight for row in rows}) > 1 else rows[0].weight)
    return dataclasses.replace(
        rows[0], weight=weight, acceptance=accepted / drafted if drafted else math.nan,
        tokens_per_pass=new_tokens / passes if passes else math.nan, quality=_mean(quality),
        fidelity=_mean([value for value in fidelities if not math.isnan(value)]),
        new_tokens=new_tokens, seconds=sum(row.seconds for row in rows),
        fidelity_per_prompt=fidelities, quality_per_prompt=quality,
        acceptance_per_prompt=sum((tuple(row.acceptance_per_prompt) for row in rows), ()), weight_usage=None,
        drafts_per_round=drafted / passes if passes else math.nan,
        batch_work=sum((tuple(row.batch_work) for row in rows), ()), target_passes=passes, drafted=drafted,
        accepted=accepted, entropy_per_prompt=sum((row.entropy_values for row in rows), ()),
        kl_per_prompt=sum((row.kl_values for row in rows), ()), tv_per_prompt=sum((row.tv_values for row in rows), ()),
        tokens_per_prompt=_joined_counts(rows, "tokens_per_prompt", "fidelity_per_prompt"),
        drafted_per_prompt=_joined_counts(rows, "drafted_per_prompt", "acceptance_per_prompt"))


def _joined_counts(rows: Sequence[MethodResult], name: str, prompts_field: str) -> tuple:
    """A per-prompt count (``name``) over the parts, NaN at the prompts of a part saved without it: g and the
    acceptance's standard error then fall back to weighing prompts alike (report.MethodResult); () where no part
    has it."""
    if not any(getattr(row, name) for row in rows):
        return ()
    return sum((tuple(getattr(row, name)) or (math.nan,) * len(getattr(row, prompts_field)) for row in rows), ())
