"""What the ``diversed train``, ``eval`` and ``pareto`` commands do, as functions that take the models (so tests can
run them on tiny random pairs without the command line).

    build_trainer(...)    a :class:`~diversed_ext.trainer.Trainer` for a task, rollouts through the speculative loop
    evaluate(...)         ar / sd / static / diversed on the same prompts and seeds: acceptance, task quality,
                          fidelity, tokens/s (one :class:`MethodResult` per method)
    pareto_methods(...)   the static sweep plus sd and the DIVERSED point
    markdown_table(...), plot_pareto(...)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from tqdm.auto import tqdm

from .decoding import SpeculativeDecoder, summarize
from .head import EnsembleHead
from .tasks import Task, encode_prompt, fidelity
from .trainer import Trainer, TrainerConfig, mixture_rollout

PARETO_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)


def hidden_size(model) -> int:
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if size is None:
        raise ValueError(f"cannot tell the hidden size of {type(model).__name__}; pass a head built by hand")
    return int(size)


def speculative_rollout(target, draft, head, *, num_draft: int, max_new_tokens: int, temperature: float = 1.0,
                        eos_token_id=None):
    """A rollout that samples from nu through the speculative loop with the current head (SPEC §4: the same
    distribution as :func:`~diversed_ext.trainer.mixture_rollout`, at the cost of deployment)."""
    decoder = SpeculativeDecoder(target, draft, method="diversed", head=head, num_draft=num_draft,
                                 temperature=temperature)

    def rollout(prompt: Sequence[int], seed: int) -> list[int]:
        output = decoder.generate(list(prompt), max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, seed=seed)
        return output.sequences[0].tolist()

    return rollout


def encode_examples(task: Task, examples: Sequence[dict], tokenizer, chat: bool = True) -> list[list[int]]:
    return [encode_prompt(tokenizer, task.prompt(example), chat=chat) for example in examples]


def build_trainer(task: Task, examples: Sequence[dict], target, draft, tokenizer, config: TrainerConfig, *,
                  head: Optional[EnsembleHead] = None, head_hidden: Optional[int] = None, init_weight: float = 0.5,
                  num_draft: int = 3, max_new_tokens: int = 48, rollout: str = "speculative",
                  eos_token_id=None, pair: Optional[dict] = None, chat: bool = True) -> Trainer:
    """A Trainer for ``task``: reward = the task reward (+ ``config.fidelity_coef`` x fidelity, added by the Trainer).

    Args:
        rollout: ``"speculative"`` (the decoding loop with the current head) or ``"mixture"`` (token by token).
        head: a head to keep training; otherwise a new one with ``head_hidden`` and ``init_weight``.
    """
    if head is None:
        head = EnsembleHead(hidden_size(draft), hidden_size(target), hidden=head_hidden, init_weight=init_weight,
                            pair=pair)
    prompts = encode_examples(task, examples, tokenizer, chat)
    if rollout == "speculative":
        sampler = speculative_rollout(target, draft, head, num_draft=num_draft, max_new_tokens=max_new_tokens,
                                      temperature=config.temperature, eos_token_id=eos_token_id)
    elif rollout == "mixture":
        eos = eos_token_id[0] if isinstance(eos_token_id, (list, tuple)) and eos_token_id else eos_token_id
        sampler = mixture_rollout(target, draft, head, max_new_tokens=max_new_tokens,
                                  temperature=config.temperature, eos_token_id=eos)
    else:
        raise ValueError(f"rollout must be 'speculative' or 'mixture', got {rollout!r}")
    decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)  # noqa: E731
    return Trainer(target, draft, head, prompts, list(examples), task.reward, decode, sampler, config)


class _RecordingHead:
    """Wraps a head so the weights it hands the verifier can be averaged afterwards."""

    def __init__(self, head):
        self.head, self.total, self.count = head, 0.0, 0

    def __call__(self, draft_hidden, target_hidden):
        weights = self.head(draft_hidden, target_hidden)
        self.total += float(weights.sum())
        self.count += weights.numel()
        return weights

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan


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

    @property
    def fidelity_se(self) -> float:
        """Standard error of the mean fidelity over prompts."""
        return standard_error([value for value in self.fidelity_per_prompt if not math.isnan(value)])


def method_specs(methods: Sequence[str], weights: Sequence[float], head=None) -> list[tuple[str, dict]]:
    """(label, SpeculativeDecoder kwargs) for each method name; ``static`` expands to one entry per weight."""
    specs = []
    for method in methods:
        if method == "static":
            specs += [(f"static w={weight:g}", {"method": "static", "weight": float(weight)}) for weight in weights]
        elif method == "diversed":
            if head is None:
                raise ValueError("method diversed needs a head (--head PATH)")
            specs.append(("diversed", {"method": "diversed", "head": head}))
        else:
            specs.append((method, {"method": method}))
    return specs


def pareto_methods(weights: Sequence[float] = PARETO_WEIGHTS, head=None) -> list[tuple[str, dict]]:
    """The static sweep (w = 1 is sd) plus the DIVERSED point when a head is given."""
    return method_specs(["static"] + (["diversed"] if head is not None else []), weights, head)


def evaluate(task: Task, examples: Sequence[dict], target, draft, tokenizer, specs: Sequence[tuple[str, dict]], *,
             num_draft: int = 3, max_new_tokens: int = 64, temperature: float = 1.0, seed: int = 0,
             eos_token_id=None, chat: bool = True, progress: bool = True) -> list[MethodResult]:
    """Run every method on every example (prompt i with seed ``seed + i`` for all methods; methods alternate prompt
    by prompt so a slow spell of a shared machine does not land on one method) and score the outputs."""
    prompts = encode_examples(task, examples, tokenizer, chat)
    decoders, recorders = {}, {}
    for label, kwargs in specs:
        kwargs = dict(kwargs)
        if kwargs.get("head") is not None:
            kwargs["head"] = recorders[label] = _RecordingHead(kwargs["head"])
        decoders[label] = SpeculativeDecoder(target, draft if kwargs["method"] != "ar" else None,
                                             num_draft=num_draft, temperature=temperature, **kwargs)
    generations = {label: [] for label, _ in specs}
    quality = {label: [] for label, _ in specs}
    fidelities = {label: [] for label, _ in specs}
    runs = [(index, label) for index in range(len(prompts)) for label, _ in specs]
    for index, label in tqdm(runs, desc=f"eval {task.name}", unit="run", disable=not progress):
        output = decoders[label].generate(prompts[index], max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                                          seed=seed + index)
        tokens = output.sequences[0].tolist()
        generations[label].extend(output.generations)
        quality[label].append(float(task.reward(examples[index],
                                                tokenizer.decode(tokens, skip_special_tokens=True))))
        fidelities[label].append(fidelity(target, prompts[index], tokens, temperature))
    results = []
    for label, kwargs in specs:
        summary = summarize(generations[label])
        if label in recorders:
            weight = recorders[label].mean
        else:
            weight = {"ar": math.nan, "sd": 1.0}.get(kwargs["method"], kwargs.get("weight", math.nan))
        finite_fidelities = [value for value in fidelities[label] if not math.isnan(value)]
        results.append(MethodResult(label, weight, summary.acceptance_rate, summary.tokens_per_pass,
                                    _mean(quality[label]), _mean(finite_fidelities), summary.tokens_per_second,
                                    summary.new_tokens, summary.seconds, tuple(fidelities[label]),
                                    tuple(quality[label])))
    return results


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean of ``values`` (NaN for fewer than two)."""
    if len(values) < 2:
        return math.nan
    mean = _mean(values)
    return math.sqrt(sum((value - mean) ** 2 for value in values) / (len(values) - 1) / len(values))


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
    return sorted((row for row in results if row.label.startswith("static") or row.label == "sd"), key=key)


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
    for low, high in zip(static, static[1:]):
        if low.acceptance <= method.acceptance <= high.acceptance and high.acceptance > low.acceptance:
            t = (method.acceptance - low.acceptance) / (high.acceptance - low.acceptance)
            weight = (1 - t) * low.weight + t * high.weight
            name = f"static frontier at acceptance {method.acceptance:.3f} (w = {weight:.2f})"
            comparisons.append(_difference(method, name,
                                           _interpolate(low.fidelity_per_prompt, high.fidelity_per_prompt, t),
                                           _interpolate(low.quality_per_prompt, high.quality_per_prompt, t)))
            break
    return comparisons


def _interpolate(low: Sequence[float], high: Sequence[float], t: float) -> tuple:
    return tuple((1 - t) * a + t * b for a, b in zip(low, high))


def _difference(method: MethodResult, name: str, fidelity_values, quality_values) -> PairedDifference:
    fidelity_mean, fidelity_se = paired_difference(method.fidelity_per_prompt, fidelity_values)
    quality_mean, quality_se = paired_difference(method.quality_per_prompt, quality_values)
    return PairedDifference(name, fidelity_mean, fidelity_se, quality_mean, quality_se)


def comparison_lines(comparisons: Sequence[PairedDifference], label: str = "diversed") -> str:
    """One line per baseline: paired differences with standard errors."""
    return "\n".join(f"{label} - {item.baseline}: fidelity {item.fidelity:+.3f} +- {item.fidelity_se:.3f}, "
                     f"quality {item.quality:+.3f} +- {item.quality_se:.3f} (paired over prompts, +- 1 s.e.)"
                     for item in comparisons)


def _cell(value: float, digits: int = 3) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _fidelity_cell(row: MethodResult) -> str:
    spread = row.fidelity_se  # NaN with fewer than two prompts
    return _cell(row.fidelity) + ("" if math.isnan(spread) else f" +- {spread:.3f}")


def markdown_table(results: Sequence[MethodResult], metric: str = "quality") -> str:
    """The results as a markdown table (``metric`` names the task-quality column)."""
    lines = [f"| method | w (mean) | acceptance | tokens/pass | {metric} | fidelity | tokens/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in results:
        lines.append(f"| {row.label} | {_cell(row.weight, 2)} | {_cell(row.acceptance)} | "
                     f"{_cell(row.tokens_per_pass, 2)} | {_cell(row.quality)} | {_fidelity_cell(row)} | "
                     f"{_cell(row.tokens_per_second, 1)} |")
    return "\n".join(lines)


def plot_pareto(results: Sequence[MethodResult], path: str, metric: str = "quality") -> str:
    """Acceptance and quality/fidelity against w and against tokens/s: static sweep as lines, DIVERSED as a star."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    static = _static_rows(results, key=lambda row: row.weight)
    learned = [row for row in results if row.label == "diversed"]
    panels = [("weight", "acceptance", "w on the target"), ("weight", "fidelity", "w on the target"),
              ("tokens_per_second", "fidelity", "tokens/s"), ("acceptance", "quality", "acceptance rate")]
    figure, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    for axis, (x_name, y_name, x_label) in zip(axes, panels):
        axis.plot([getattr(row, x_name) for row in static], [getattr(row, y_name) for row in static], "o-",
                  label="static ensembles")
        for row in static:
            axis.annotate(f"{row.weight:g}", (getattr(row, x_name), getattr(row, y_name)), fontsize=7)
        for row in learned:
            axis.plot(getattr(row, x_name), getattr(row, y_name), "r*", markersize=13, label="DIVERSED (head)")
        axis.set_xlabel(x_label)
        axis.set_ylabel(metric if y_name == "quality" else y_name)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path

