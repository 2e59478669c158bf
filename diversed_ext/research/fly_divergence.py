"""FLy's divergence to the target, by an unbiased Monte Carlo estimate of its deferral probabilities.

FLy (the verify ops' ``fly_*`` options) keeps a draft x_i that the exact test rejected when the target's top-k entropy
at i (:func:`diversed_ext.ops.fly_entropy`) is at least tau and the next W drafts all pass the exact test. Its
per-position law (the law of the first token emitted at a position where a draft x ~ q is made, as in
:mod:`.divergence`) therefore reads drafts made in the contexts that follow x, which the output never visited: there is
no closed form. At a position with room to defer (W drafts after it), with a(x) the exact test's keep probability, nu
the rule's law without FLy and r its residual,

    out(y) = law(y) + q(y) (1 - a(y)) D(y) - d r(y),     d = sum_x q(x) (1 - a(x)) D(x)

where D(x) is the probability that the next W drafts after x all pass, and d the deferral probability: the share of
the position's tokens FLy keeps that the exact test rejected. The added mass lies where a < 1 (q > p) and the removed
mass where r > 0 (p > q), on the side each already leans, so TV(out, p) = TV(law, p) + d: linear in D, so an
unbiased estimate of d is one of the TV. (Exact for static weights up to drafts the target forbids, whose mass the
verifier sends to r.) KL is not linear in D and is not estimated: FLy has TV on the divergence plane, not KL.

The estimate at a visited position t: draw x ~ q_t, then W drafts x_{t+1..t+W} ~ q along the branch (context, x)
with the draft model, read p at each of them with the target, and take

    d_hat = 1{H_topk(p_t) >= tau} 1{x deferrable} (1 - a_t(x)) prod_j a_{t+j}(x_{t+j})

(the exact test passes each following draft with probability a, so the product is the conditional probability that
all W pass: averaging the uniforms out lowers the variance and keeps the estimate unbiased). E[d_hat] = d_t exactly.
A position whose x the exact test keeps, or whose entropy is below tau, gives 0 without a rollout. A rollout runs as the
loop drafts: off caches of the context, one draft token a pass, so it costs W + 1 short passes whatever the context's
length. A prompt's figure is the mean over its positions of ``samples`` independent estimates each; prompts are
independent, so the standard error over prompts the reports give covers the Monte Carlo noise as well as the spread of
prompts.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..decoding.runners import crop_cache, make_runner, model_device
from ..ops import distribution_temperature, fly_entropy
from .divergence import RuleLaw, _exact_keep, _verifier_mass, divergences, position_law


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return (logits.double() / distribution_temperature(temperature)).softmax(-1)


def _keep_of(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, weight: float, tokens_only: bool) -> torch.Tensor:
    """The exact test's keep probability a(x) of each row's drafted token ([n] from [n, V] rows)."""
    w = torch.full((p.shape[0], 1), float(weight), dtype=torch.float64)
    return _exact_keep(_verifier_mass(p), q, w, tokens_only).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def fly_runners(target, draft) -> tuple:
    """(target runner, draft runner): the incremental forwards the decoding loop uses for these models, built once
    and handed to :func:`fly_divergences` for every prompt (building one packs the model's weights)."""
    return tuple(make_runner(model, model_device(model), fast_forward=True) for model in (target, draft))


def _cropped(cache, keep: int):
    """``cache`` holding its first ``keep`` positions only (None, a new cache, for none)."""
    if keep == 0 or cache is None:
        return None
    crop_cache(cache, cache.get_seq_length(), keep)
    return cache


def _branch_passes(runners, caches, keep: int, drafted: int, fly, *, weight: float, temperature: float,
                   tokens_only: bool, vocab: int, generator) -> tuple:
    """prod_j a_{t+j}(x_{t+j}) along the branch (context[:keep], drafted): W drafts sampled from the draft one by
    one, then the target read at all of them in one pass; each model reads the branch's prefix from its cache, which
    it extends by the branch. Returns the product ([1] float64) and the caches."""
    target_runner, draft_runner = runners
    target_cache, draft_cache = (_cropped(cache, keep) for cache in caches)
    branch, steps = [drafted], []
    for _ in range(fly.window):  # the next W drafts, sampled from the draft as the loop does
        logits, _, (draft_cache,) = draft_runner.run_rows([branch[-1:]], [draft_cache], [1], False)
        step_q = _probs(logits.float().cpu()[:, :vocab], temperature)
        token = torch.multinomial(step_q.float(), 1, generator=generator).squeeze(-1)
        steps.append((step_q, token))
        branch.append(int(token))
    logits, _, (target_cache,) = target_runner.run_rows([branch[:-1]], [target_cache], [fly.window], False)
    branch_p = _probs(logits.float().cpu()[:, :vocab], temperature)
    passes = torch.ones(1, dtype=torch.float64)
    for j, (step_q, token) in enumerate(steps):
        passes = passes * _keep_of(branch_p[j:j + 1], step_q, token, weight, tokens_only)
    return passes, (target_cache, draft_cache)


def deferral_estimates(target, draft, context: Sequence[int], target_logits: torch.Tensor,
                       draft_logits: torch.Tensor, fly, *, weight: float = 1.0, temperature: float = 1.0,
                       tokens_only: bool = False, generator: Optional[torch.Generator] = None,
                       runners: Optional[tuple] = None, caches: Optional[tuple] = None) -> torch.Tensor:
    """One unbiased estimate d_hat of the deferral probability at each of N positions (float64 [N]): position t's
    context is ``context[:start + t]`` where start = len(context) - N, and ``target_logits`` / ``draft_logits`` [N, V]
    are both models' logits there. ``fly`` a :class:`~diversed_ext.decoding.Fly` with its window resolved; ``weight``
    the static weight of the exact test (1: sd). ``runners``: :func:`fly_runners` of the two models (built here when
    None); ``caches``: (target cache, draft cache) holding at least ``context[:-1]``, which the branches crop and
    overwrite (None: filled here).

    Each branch reads its prefix from the caches instead of running it again: branches are rolled out from the last
    position back, so cropping the caches to a branch's prefix only drops positions no later branch reads, and a
    rollout costs W + 1 short passes whatever the context's length."""
    count = target_logits.shape[0]
    start = len(context) - count
    p, q = _probs(target_logits, temperature), _probs(draft_logits, temperature)
    drafted = torch.multinomial(q.float(), 1, generator=generator).squeeze(-1)
    rejected = 1 - _keep_of(p, q, drafted, weight, tokens_only)
    drafted_p = _verifier_mass(p).gather(-1, drafted.unsqueeze(-1)).squeeze(-1)
    entropy = fly_entropy(_verifier_mass(p).float(), fly.top_k)
    estimate = torch.where((entropy >= fly.threshold) & (drafted_p > 0), rejected, torch.zeros_like(rejected))
    rolled = [t for t in range(count) if estimate[t] > 0]
    if not rolled or not fly.window:
        return estimate if fly.window else torch.zeros_like(estimate)
    runners = fly_runners(target, draft) if runners is None else runners
    if caches is None:
        prefix = list(context[:start + rolled[-1]])
        caches = tuple(runner.run_rows([prefix], [None], [1], False)[2][0] if prefix else None
                       for runner in runners)
    for t in reversed(rolled):
        passes, caches = _branch_passes(runners, caches, start + t, int(drafted[t]), fly, weight=weight,
                                        temperature=temperature, tokens_only=tokens_only, vocab=p.shape[-1],
                                        generator=generator)
        estimate[t] = estimate[t] * passes[0]
    return estimate


@torch.no_grad()
def fly_divergences(target, draft, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], fly, *,
                    weight: float = 1.0, temperature: float = 1.0, tokens_only: bool = False, samples: int = 1,
                    seed: int = 0, runners: Optional[tuple] = None) -> list[tuple[float, float]]:
    """(mean deferral probability, mean TV(out, p)) over each completion's positions, TV = TV(law without FLy, p) +
    d_hat (see the module), each position's d_hat the mean of ``samples`` independent estimates drawn with a
    generator seeded by ``seed`` + the prompt's index; (NaN, NaN) for an empty completion. ``runners``: the models'
    :func:`fly_runners`, to build once for many calls (None: built here)."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    law = RuleLaw("exact") if weight == 1.0 else RuleLaw("static", weight, tokens_only=tokens_only)
    results = [(float("nan"), float("nan"))] * len(completions)
    filled = [index for index, completion in enumerate(completions) if completion]
    runners = fly_runners(target, draft) if runners is None and filled else runners
    for index in filled:
        context = list(prompts[index]) + list(completions[index])  # position t reads prompt + completion[:t]
        # One pass per model over the context gives the logits at every position and the caches branches start from.
        outputs = [runner.run_rows([context[:-1]], [None], [len(completions[index])], False) for runner in runners]
        vocab = min(output[0].shape[-1] for output in outputs)
        target_logits, draft_logits = (output[0].float().cpu()[:, :vocab] for output in outputs)
        caches = tuple(output[2][0] for output in outputs)
        generator = torch.Generator().manual_seed(seed + index)
        deferral = torch.zeros(len(completions[index]), dtype=torch.float64)
        for sample in range(samples):  # a sample's branches overwrite the caches: the next one fills its own
            deferral += deferral_estimates(target, draft, context, target_logits, draft_logits, fly, weight=weight,
                                           temperature=temperature, tokens_only=tokens_only, generator=generator,
                                           runners=runners, caches=caches if sample == 0 else None)
        deferral /= samples
        _, tv = divergences(position_law(law, target_logits, draft_logits, temperature), target_logits, temperature)
        results[index] = (float(deferral.mean()), float((tv + deferral).mean()))
    return results
