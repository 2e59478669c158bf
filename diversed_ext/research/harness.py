"""One harness for every experiment that runs methods x prompts: the demo, ``diversed eval`` and ``pareto``, and the
end-to-end benchmark.

Rules shared by all of them, so their numbers compare:
  * prompt i runs with seed ``seed + i`` for every method (paired comparisons over prompts);
  * every method first runs once untimed (the first forward passes pay for allocations and lazy imports);
  * prompts run in batches of ``batch_size`` consecutive prompts decoded together (1: one after another), and methods
    alternate batch by batch, so a slow spell of a shared machine does not land on one method;
  * per-prompt statistics (acceptance, tokens per pass) are the prompt's own; a method's acceptance pools its prompts
    (accepted over drafted, with the ratio estimator's standard error over prompts); speed is counted as throughput: a
    method's new tokens over the wall time of its batches (with batch_size 1, each prompt's own time).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from tqdm.auto import tqdm

from ..decoding import (DEFAULT_MAX_DRAFT, DRAFT_MODES, Fly, Gate, NgramDrafter, SpeculativeDecoder, Typical,
                        encode_prompt, summarize)
from .draft_length_report import draft_length_label
from .head_usage import weight_usage
from .divergence_scores import divergence_scorer
from .report import MethodResult, _mean
from .rollouts import draft_steps
from .tasks import Task
from .teacher_forcing import target_scores

DEMO_PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "List three tips for staying focused while studying.",
    "What is the capital of France, and what is it famous for?",
)
DEMO_WEIGHTS = (0.75, 0.5)
PARETO_WEIGHTS = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)  # w = 1 is sd
# Where a comparison of drafts takes them from: the draft model in one of its draft modes, or an n-gram lookup.
DRAFT_SOURCES = DRAFT_MODES + ("ngram",)
WARMUP_TOKENS = 4  # new tokens of each method's untimed first run
# "<method>+fly": static or diversed with FLy (sd with FLy is the method "fly"), one row each on the tables; likewise
# "<method>+gate" with the log-probability gate ("gate": sd with it). Both are lossy verification kinds.
FLY_SUFFIX = "+fly"
GATE_SUFFIX = "+gate"
LOSSY_METHODS = ("static" + FLY_SUFFIX, "diversed" + FLY_SUFFIX, "gate", "static" + GATE_SUFFIX,
                 "diversed" + GATE_SUFFIX, "typical")  # typical: Medusa's typical acceptance, sd's drafts
# FLy's entropy thresholds a pareto sweep tries at every window W in 1..K-1: its frontier is their upper envelope.
FLY_SWEEP_THRESHOLDS = (0.1, 0.3, 0.6)

# (consecutive prompt indices, the first one's seed, max_new_tokens) -> what the experiment records for each prompt
# (prompt i of the batch runs with seed + i)
Runner = Callable[[Sequence[int], int, int], list]


def run_interleaved(runners: Sequence[tuple[str, Runner]], num_prompts: int, *, seed: int, max_new_tokens: int,
                    batch_size: Optional[int] = 1, warmup: bool = True, desc: str = "run", progress: bool = True,
                    wall_seconds: Optional[dict] = None) -> dict[str, list]:
    """Every runner on every prompt under the rules above; returns label -> one result per prompt, in order.
    ``wall_seconds``, when given, receives label -> the wall time of that runner's timed batches."""
    labels = [label for label, _ in runners]
    if len(set(labels)) != len(labels):  # results are kept by label: two runners under one would pool their prompts
        raise ValueError(f"runners must have distinct labels; {next(x for x in labels if labels.count(x) > 1)!r} "
                         "is given twice")
    size = num_prompts if batch_size is None else batch_size
    batches = [list(range(start, min(start + size, num_prompts))) for start in range(0, num_prompts, max(size, 1))]
    if warmup and batches:
        for _, run in runners:
            run(batches[0], seed, min(WARMUP_TOKENS, max_new_tokens))
    results = {label: [] for label, _ in runners}
    seconds = dict.fromkeys(results, 0.0)
    runs = [(batch, label, run) for batch in batches for label, run in runners]
    for batch, label, run in tqdm(runs, desc=desc, unit="batch", disable=not progress):
        start = time.perf_counter()
        results[label].extend(run(batch, seed + batch[0], max_new_tokens))
        seconds[label] += time.perf_counter() - start
    if wall_seconds is not None:
        wall_seconds.update(seconds)
    return results


def decoder_runner(decoder: SpeculativeDecoder, prompts: Sequence[Sequence[int]], eos_token_id=None) -> Runner:
    """A runner returning the :class:`~diversed_ext.decoding.Generation` of ``decoder`` on each prompt of a batch,
    the batch's prompts decoded together."""

    def run(indices: Sequence[int], seed: int, max_new_tokens: int):
        output = decoder.generate([list(prompts[index]) for index in indices], max_new_tokens=max_new_tokens,
                                  eos_token_id=eos_token_id, seed=seed)
        return output.generations

    return run


def throughput_summary(generations, wall_seconds: float):
    """The generations' totals, with their time replaced by the wall time they took together (tokens/s = throughput)."""
    return dataclasses.replace(summarize(generations), seconds=wall_seconds)


def build_decoders(target, draft, specs: Sequence[tuple[str, dict]], *, max_draft: int, temperature: float,
                   draft_cost: Optional[float] = None) -> dict[str, SpeculativeDecoder]:
    """One decoder per (label, SpeculativeDecoder keyword arguments); ``ar`` and a callable drafter run without the
    draft model. ``max_draft`` is the default of specs that do not set their own; ``draft_cost`` goes to the specs
    whose draft length is ``"gain"``."""
    decoders = {}
    for label, kwargs in specs:
        kwargs = {"max_draft": max_draft, "temperature": temperature, **kwargs}  # a spec may run at its own T
        if draft_cost is not None and kwargs.get("draft_length") == "gain":
            kwargs["draft_cost"] = draft_cost
        model = None if kwargs["method"] == "ar" or "drafter" in kwargs else draft
        decoders[label] = SpeculativeDecoder(target, model, **kwargs)
    return decoders


def encode_examples(task: Task, examples: Sequence[dict], tokenizer, chat: bool = True) -> list[list[int]]:
    """Token ids of each example's prompt: through the chat template when ``chat`` and the task both want it (a
    completion task, ``Task.chat`` False, is always plain text)."""
    return [encode_prompt(tokenizer, task.prompt(example), chat=chat and task.chat) for example in examples]


def method_specs(methods: Sequence[str], weights: Sequence[float], head=None,
                 draft_lengths: Sequence[str] = (), fixed_ks: Sequence[int] = (), fly=None,
                 gate=None) -> list[tuple[str, dict]]:
    """(label, SpeculativeDecoder kwargs) for each method name; ``static`` expands to one entry per weight, and each
    method that drafts to one entry per draft length (see :func:`with_draft_lengths`). ``fly`` (sd with FLy) and the
    FLy variants ``static+fly`` and ``diversed+fly`` take ``fly`` (a :class:`~diversed_ext.decoding.Fly`; None:
    its defaults); ``gate`` (sd with the gate), ``static+gate`` and ``diversed+gate`` take ``gate`` (a
    :class:`~diversed_ext.decoding.Gate`; None: its default margin); ``typical`` is sd with Medusa's typical acceptance
    at its published settings."""
    specs = _plain_method_specs(methods, weights, head, fly, gate)
    return with_draft_lengths(specs, draft_lengths, fixed_ks) if draft_lengths else specs


def with_draft_lengths(specs: Sequence[tuple[str, dict]], draft_lengths: Sequence[str],
                       fixed_ks: Sequence[int] = ()) -> list[tuple[str, dict]]:
    """Each spec that drafts once per draft-length policy, labelled "<label> / <policy>": ``"fixed"`` once per K of
    ``fixed_ks`` ("<label> / K=3"; with no ``fixed_ks``, at the decoders' max_draft), the others capped at the
    decoders' max_draft. Specs of ``ar`` stay as they are; each spec's entries stay together."""
    out = []
    for label, kwargs in specs:
        if kwargs["method"] == "ar":
            out.append((label, kwargs))
            continue
        for name in draft_lengths:
            if name == "fixed" and fixed_ks:
                out += [(draft_length_label(label, f"K={k}"), {**kwargs, "draft_length": "fixed", "max_draft": int(k)})
                        for k in fixed_ks]
            else:
                out.append((draft_length_label(label, name), {**kwargs, "draft_length": name}))
    return out


def with_draft_length(specs: Sequence[tuple[str, dict]], draft_length: str) -> list[tuple[str, dict]]:
    """The specs with every drafting one set to ``draft_length``, labels unchanged."""
    return [(label, kwargs if kwargs["method"] == "ar" else {**kwargs, "draft_length": draft_length})
            for label, kwargs in specs]


def _plain_method_specs(methods: Sequence[str], weights: Sequence[float], head=None,
                        fly=None, gate=None) -> list[tuple[str, dict]]:
    specs = []
    for name in methods:
        method, extra = name, {}
        if name.endswith(FLY_SUFFIX) or name == "fly":
            method, extra = name.removesuffix(FLY_SUFFIX), {"fly": fly if fly is not None else Fly()}
        elif name.endswith(GATE_SUFFIX) or name == "gate":
            method = "sd" if name == "gate" else name.removesuffix(GATE_SUFFIX)
            extra = {"gate": gate if gate is not None else Gate()}
        elif name == "typical":  # Medusa's typical acceptance at its published settings (sd's drafts)
            method, extra = "sd", {"typical": Typical()}
        if method == "static":
            specs += [(f"{name} w={weight:g}", {"method": "static", "weight": float(weight), **extra})
                      for weight in weights]
        elif method == "diversed":
            if head is None:
                raise ValueError(f"method {name} needs a head (--head PATH)")
            specs.append((name, {"method": "diversed", "head": head, **extra}))
        else:
            specs.append((name, {"method": method, **extra}))
    return specs


def draft_source_specs(sources: Sequence[str], weights: Sequence[float]) -> list[tuple[str, dict]]:
    """sd and static at each weight, once per draft source (one of :data:`DRAFT_SOURCES`): the draft model in that
    ``draft_mode``, or ``"ngram"``, an :class:`~diversed_ext.decoding.NgramDrafter` in its place. Labelled
    "<method> / <source>", the sources of one method next to each other."""
    unknown = [source for source in sources if source not in DRAFT_SOURCES]
    if unknown:
        raise ValueError(f"unknown draft source {unknown[0]!r}; known: {', '.join(DRAFT_SOURCES)}")
    return [(f"{label} / {source}", {**kwargs, **({"drafter": NgramDrafter()} if source == "ngram"
                                                  else {"draft_mode": source})})
            for label, kwargs in method_specs(["sd", "static"], weights) for source in sources]


def pareto_methods(weights: Sequence[float] = PARETO_WEIGHTS, head=None,
                   heads: Optional[Mapping[str, Any]] = None, fly=None, fly_sweep: Sequence = (),
                   gates: Sequence = (), temperatures: Sequence[float] = (),
                   typicals: Sequence = ()) -> list[tuple[str, dict]]:
    """The static sweep (w = 1 is sd) plus one DIVERSED point per head: ``head`` is labelled "diversed", each of
    ``heads`` (label -> head) by its label. ``fly_sweep``: FLy's points (each a :class:`~diversed_ext.decoding.Fly`,
    sd with FLy, labelled "fly W=.. tau=..": see :func:`fly_sweep`). With ``fly``, each head's point with FLy
    ("<label>+fly"). ``gates``: for each :class:`~diversed_ext.decoding.Gate`, sd's point with it ("gate margin=..")
    and each head's ("<label>+gate margin=.."). The free baselines: ``temperatures``, sd run at each T' (labelled
    "sd T=.."; scored at the user's T, the temperature family) and ``typicals``, Medusa's typical acceptance at each
    :class:`~diversed_ext.decoding.Typical` ("typical eps=.. delta=..")."""
    heads = dict(heads or {})
    if head is not None:
        heads = {"diversed": head, **heads}
    specs = method_specs(["static"], weights) + [(label, {"method": "diversed", "head": learned})
                                                 for label, learned in heads.items()]
    specs += [(f"fly {setting.label}", {"method": "fly", "fly": setting}) for setting in fly_sweep]
    if fly is not None:
        specs += [(label + FLY_SUFFIX, {"method": "diversed", "head": learned, "fly": fly})
                  for label, learned in heads.items()]
    specs += [(temperature_label(value), {"method": "sd", "temperature": float(value)}) for value in temperatures]
    specs += [(f"typical {setting.label}", {"method": "sd", "typical": setting}) for setting in typicals]
    for gate in gates:
        specs += [(f"gate {gate.label}", {"method": "sd", "gate": gate})]
        specs += [(f"{label}{GATE_SUFFIX} {gate.label}", {"method": "diversed", "head": learned, "gate": gate})
                  for label, learned in heads.items()]
    return specs


def temperature_label(temperature: float) -> str:
    """The label of sd run at ``temperature`` in the temperature family: "sd T=0.7"."""
    return f"sd T={temperature:g}"


def fly_sweep(max_draft: int, thresholds: Sequence[float] = FLY_SWEEP_THRESHOLDS, top_k: Optional[int] = None) -> list:
    """FLy at every window W in 1..K-1 and every threshold: the settings whose upper envelope is FLy's frontier at
    K = ``max_draft``."""
    extra = {} if top_k is None else {"top_k": top_k}
    return [Fly(window, threshold, **extra) for window in range(1, max_draft) for threshold in thresholds]


def demo_methods(weights: Sequence[float] = DEMO_WEIGHTS, head=None, gate: bool = True) -> list[tuple[str, dict]]:
    """The demo's methods: ar, sd, static at each weight, diversed when a head is given, and with ``gate`` sd with
    the log-probability gate at its default margin (it needs a sampling temperature)."""
    methods = ["ar", "sd", "static"] + (["diversed"] if head is not None else []) + (["gate"] if gate else [])
    return method_specs(methods, weights, head)


def run_demo(target, draft, prompts: Sequence[Sequence[int]], specs: Sequence[tuple[str, dict]], *,
             max_draft: int = DEFAULT_MAX_DRAFT, max_new_tokens: int = 48, temperature: float = 1.0, seed: int = 0,
             eos_token_id=None, progress: bool = True, batch_size: Optional[int] = 1,
             wall_seconds: Optional[dict] = None, draft_cost: Optional[float] = None):
    """label -> the generations of each method on every prompt (``wall_seconds`` as in :func:`run_interleaved`);
    ``draft_cost``: for specs drafting with ``"gain"``.

    One request at a time by default: speculation buys latency per request. On a small CPU a batch already keeps the
    cores busy, so batched ar gains as much as speculation would (at batch 4 on 2 cores, sd ran at 0.78x and diversed
    at 0.98x of batched ar); ``batch_size`` shows that trade-off."""
    decoders = build_decoders(target, draft, specs, max_draft=max_draft, temperature=temperature,
                              draft_cost=draft_cost)
    runners = [(label, decoder_runner(decoders[label], prompts, eos_token_id)) for label, _ in specs]
    return run_interleaved(runners, len(prompts), seed=seed, max_new_tokens=max_new_tokens, batch_size=batch_size,
                           desc="demo", progress=progress, wall_seconds=wall_seconds)


def evaluate(task: Task, examples: Sequence[dict], target, draft, tokenizer, specs: Sequence[tuple[str, dict]], *,
             max_draft: int = DEFAULT_MAX_DRAFT, max_new_tokens: int = 64, temperature: float = 1.0, seed: int = 0,
             eos_token_id=None, chat: bool = True, progress: bool = True, batch_size: Optional[int] = 8,
             draft_cost: Optional[float] = None, warmup: bool = False,
             score_temperature: Optional[float] = None) -> list[MethodResult]:
    """Run every method on every example and score the outputs: task reward, fidelity and the target entropy at the
    positions visited (one pass of the target: :func:`~.teacher_forcing.target_scores`) and the rule's per-position
    KL and TV to the target there (:mod:`.divergence_scores`) per prompt, the target taken at ``score_temperature``
    (default: ``temperature``, the user's; a spec may set its own decoding temperature). ``draft_cost``: for specs
    drafting with ``"gain"``; ``warmup``: run each method once untimed first (for benchmarks; the results are
    unchanged)."""
    prompts = encode_examples(task, examples, tokenizer, chat)
    decoders = build_decoders(target, draft, specs, max_draft=max_draft, temperature=temperature,
                              draft_cost=draft_cost)

    def scored(label: str) -> Runner:
        generate = decoder_runner(decoders[label], prompts, eos_token_id)

        def run(indices: Sequence[int], seed: int, max_new_tokens: int):
            start = time.perf_counter()
            generations = generate(indices, seed, max_new_tokens)
            elapsed = time.perf_counter() - start  # scoring below is not decoding time
            batch_work[label].append((sum(len(generation.tokens) for generation in generations), elapsed))
            return [(generation, *_score(generation, index, label))
                    for generation, index in zip(generations, indices)]
        return run

    scoring = temperature if score_temperature is None else score_temperature

    divergence = {label: divergence_scorer(target, draft, decoders[label], scoring, seed) for label, _ in specs}

    def _score(generation, index: int, label: str) -> tuple:
        tokens = generation.tokens.tolist()
        quality = float(task.reward(examples[index], tokenizer.decode(tokens, skip_special_tokens=True)))
        return (quality, *target_scores(target, prompts[index], tokens, scoring),
                *divergence[label](prompts[index], tokens, index, draft_steps(generation.rounds)))

    # (new tokens, decoding seconds) of each batch: the method's decoding time, and the unit of paired comparisons
    batch_work = {label: [] for label, _ in specs}
    if warmup and prompts:
        for decoder in decoders.values():
            decoder.generate(prompts[0], max_new_tokens=min(WARMUP_TOKENS, max_new_tokens), seed=seed)
    runs = run_interleaved([(label, scored(label)) for label, _ in specs], len(prompts), seed=seed,
                           max_new_tokens=max_new_tokens, batch_size=batch_size, warmup=False,
                           desc=f"eval {task.name}", progress=progress)
    return [_method_result(label, kwargs, runs[label], tuple(batch_work[label]), decoders[label].draft_length.name)
            for label, kwargs in specs]


def _method_result(label: str, kwargs: dict, runs: list, batch_work: tuple, draft_length: str) -> MethodResult:
    generations, quality, fidelities, entropies, kls, tvs = ([run[i] for run in runs] for i in range(6))
    summary = throughput_summary(generations, sum(seconds for _, seconds in batch_work))
    usage = weight_usage(generations)
    if usage is not None:
        weight = usage.mean
    else:
        weight = {"ar": math.nan, "sd": 1.0, "fly": 1.0}.get(kwargs["method"], kwargs.get("weight", math.nan))
    finite_fidelities = [value for value in fidelities if not math.isnan(value)]
    own = [generation.summary() for generation in generations]
    return MethodResult(label, weight, summary.acceptance_rate, summary.tokens_per_pass, _mean(quality),
                        _mean(finite_fidelities), summary.tokens_per_second, summary.new_tokens, summary.seconds,
                        tuple(fidelities), tuple(quality), tuple(prompt.acceptance_rate for prompt in own), usage,
                        drafts_per_round=summary.drafts_per_round, batch_work=batch_work,
                        draft_length=draft_length if kwargs["method"] != "ar" else "",
                        target_passes=summary.target_passes, drafted=summary.drafted, accepted=summary.accepted,
                        entropy_per_prompt=tuple(entropies), kl_per_prompt=tuple(kls), tv_per_prompt=tuple(tvs),
                        # what each prompt's fidelity and entropy are means over, and its acceptance's denominator:
                        # the pooled g and acceptance weight prompts by them
                        tokens_per_prompt=tuple(len(generation.tokens) for generation in generations),
                        drafted_per_prompt=tuple(prompt.drafted for prompt in own))
