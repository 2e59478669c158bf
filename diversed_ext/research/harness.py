"""One harness for every experiment that runs methods x prompts: the demo, ``diversed eval`` and ``pareto``, and the
end-to-end benchmark.

Rules shared by all of them, so their numbers compare:
  * prompt i runs with seed ``seed + i`` for every method (paired comparisons over prompts);
  * every method first runs once untimed (the first forward passes pay for allocations and lazy imports);
  * methods alternate prompt by prompt, so a slow spell of a shared machine does not land on one method.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Sequence

from tqdm.auto import tqdm

from ..decoding import SpeculativeDecoder, encode_prompt, summarize
from .head_usage import weight_usage
from .report import MethodResult, _mean
from .tasks import Task
from .teacher_forcing import fidelity

DEMO_PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "List three tips for staying focused while studying.",
    "What is the capital of France, and what is it famous for?",
)
DEMO_WEIGHTS = (0.75, 0.5)
# Drafts per round in the demo: the K with the most diversed tokens/s in `bench/bench_e2e.py --k 1 2 3 4 5` (4 demo
# prompts, 48 new tokens, 2 threads, 2026-11-23, lean int8 draft, two-row target products): diversed 1.31/1.26/1.38/
# 1.18/1.00x ar at K = 1..5; static w=0.5 1.37/1.28/1.30/1.37/1.09x and sd 1.31/1.29/1.15/1.21/0.89x are flat within
# noise up to K = 4. Past K = 4 the target's verify pass grows faster than acceptance pays (docs/RESULTS.md).
DEMO_NUM_DRAFT = 3
PARETO_WEIGHTS = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)  # w = 1 is sd
WARMUP_TOKENS = 4  # new tokens of each method's untimed first run

# (prompt index, seed, max_new_tokens) -> whatever the experiment records for that run
Runner = Callable[[int, int, int], Any]


def run_interleaved(runners: Sequence[tuple[str, Runner]], num_prompts: int, *, seed: int, max_new_tokens: int,
                    warmup: bool = True, desc: str = "run", progress: bool = True) -> dict[str, list]:
    """Every runner on every prompt under the rules above; returns label -> one result per prompt, in order."""
    if warmup and num_prompts:
        for _, run in runners:
            run(0, seed, min(WARMUP_TOKENS, max_new_tokens))
    results = {label: [] for label, _ in runners}
    runs = [(index, label, run) for index in range(num_prompts) for label, run in runners]
    for index, label, run in tqdm(runs, desc=desc, unit="run", disable=not progress):
        results[label].append(run(index, seed + index, max_new_tokens))
    return results


def decoder_runner(decoder: SpeculativeDecoder, prompts: Sequence[Sequence[int]], eos_token_id=None) -> Runner:
    """A runner returning the :class:`~diversed_ext.decoding.Generation` of ``decoder`` on prompt i."""

    def run(index: int, seed: int, max_new_tokens: int):
        output = decoder.generate(list(prompts[index]), max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                                  seed=seed)
        return output.generations[0]

    return run


def build_decoders(target, draft, specs: Sequence[tuple[str, dict]], *, num_draft: int,
                   temperature: float) -> dict[str, SpeculativeDecoder]:
    """One decoder per (label, SpeculativeDecoder keyword arguments); ``ar`` runs without the draft."""
    return {label: SpeculativeDecoder(target, draft if kwargs["method"] != "ar" else None, num_draft=num_draft,
                                      temperature=temperature, **kwargs)
            for label, kwargs in specs}


def encode_examples(task: Task, examples: Sequence[dict], tokenizer, chat: bool = True) -> list[list[int]]:
    return [encode_prompt(tokenizer, task.prompt(example), chat=chat) for example in examples]


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


def pareto_methods(weights: Sequence[float] = PARETO_WEIGHTS, head=None,
                   heads: Optional[Mapping[str, Any]] = None) -> list[tuple[str, dict]]:
    """The static sweep (w = 1 is sd) plus one DIVERSED point per head: ``head`` is labelled "diversed", each of
    ``heads`` (label -> head) by its label."""
    heads = dict(heads or {})
    if head is not None:
        heads = {"diversed": head, **heads}
    return method_specs(["static"], weights) + [(label, {"method": "diversed", "head": learned})
                                                for label, learned in heads.items()]


def demo_methods(weights: Sequence[float] = DEMO_WEIGHTS, head=None) -> list[tuple[str, dict]]:
    """The demo's methods: ar, sd, static at each weight, and diversed when a head is given."""
    return method_specs(["ar", "sd", "static"] + (["diversed"] if head is not None else []), weights, head)


def run_demo(target, draft, prompts: Sequence[Sequence[int]], specs: Sequence[tuple[str, dict]], *, num_draft: int,
             max_new_tokens: int, temperature: float, seed: int, eos_token_id=None, progress: bool = True):
    """label -> the generations of each method on every prompt."""
    decoders = build_decoders(target, draft, specs, num_draft=num_draft, temperature=temperature)
    runners = [(label, decoder_runner(decoders[label], prompts, eos_token_id)) for label, _ in specs]
    return run_interleaved(runners, len(prompts), seed=seed, max_new_tokens=max_new_tokens, desc="demo",
                           progress=progress)


def evaluate(task: Task, examples: Sequence[dict], target, draft, tokenizer, specs: Sequence[tuple[str, dict]], *,
             num_draft: int = 3, max_new_tokens: int = 64, temperature: float = 1.0, seed: int = 0,
             eos_token_id=None, chat: bool = True, progress: bool = True) -> list[MethodResult]:
    """Run every method on every example and score the outputs: task reward and fidelity per prompt."""
    prompts = encode_examples(task, examples, tokenizer, chat)
    decoders = build_decoders(target, draft, specs, num_draft=num_draft, temperature=temperature)

    def scored(label: str) -> Runner:
        generate = decoder_runner(decoders[label], prompts, eos_token_id)

        def run(index: int, seed: int, max_new_tokens: int):
            generation = generate(index, seed, max_new_tokens)
            tokens = generation.tokens.tolist()
            quality = float(task.reward(examples[index], tokenizer.decode(tokens, skip_special_tokens=True)))
            return generation, quality, fidelity(target, prompts[index], tokens, temperature)
        return run

    runs = run_interleaved([(label, scored(label)) for label, _ in specs], len(prompts), seed=seed,
                           max_new_tokens=max_new_tokens, warmup=False, desc=f"eval {task.name}", progress=progress)
    return [_method_result(label, kwargs, runs[label]) for label, kwargs in specs]


def _method_result(label: str, kwargs: dict, runs: list) -> MethodResult:
    generations, quality, fidelities = ([run[i] for run in runs] for i in range(3))
    summary = summarize(generations)
    usage = weight_usage(generations)
    if usage is not None:
        weight = usage.mean
    else:
        weight = {"ar": math.nan, "sd": 1.0}.get(kwargs["method"], kwargs.get("weight", math.nan))
    finite_fidelities = [value for value in fidelities if not math.isnan(value)]
    return MethodResult(label, weight, summary.acceptance_rate, summary.tokens_per_pass, _mean(quality),
                        _mean(finite_fidelities), summary.tokens_per_second, summary.new_tokens, summary.seconds,
                        tuple(fidelities), tuple(quality),
                        tuple(generation.summary().acceptance_rate for generation in generations), usage)
