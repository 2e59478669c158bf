"""FLy's divergence to the target, by an unbiased Monte Carlo estimate of its deferral probabilities.

FLy (:mod:`diversed_ext.ops._fly`) keeps a draft x_i that the exact test rejected when the target's top-k entropy at
i is at least tau and the next W drafts all pass the exact test. Its per-position law (the law of the first token
emitted at a position where a draft x ~ q is made, as in :mod:`.divergence`) therefore reads drafts made in the
contexts that follow x, which the output never visited: there is no closed form. At a position with room to defer
(W drafts after it), with a(x) the exact test's keep probability, nu the rule's law without FLy and r its residual,

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
A position whose x the exact test keeps, or whose entropy is below tau, gives 0 without a rollout. A prompt's figure
is the mean over its positions of ``samples`` independent estimates each; prompts are independent, so the standard
error over prompts the reports give covers the Monte Carlo noise as well as the spread of prompts.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..decoding.runners import make_runner, model_device
from ..ops import distribution_temperature
from ..ops._fly import fly_entropy
from .divergence import RuleLaw, _exact_keep, _verifier_mass, divergences, position_law


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return (logits.double() / distribution_temperature(temperature)).softmax(-1)


def _keep_of(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, weight: float, tokens_only: bool) -> torch.Tensor:
    """The exact test's keep probability a(x) of each row's drafted token ([n] from [n, V] rows)."""
    w = torch.full((p.shape[0], 1), float(weight), dtype=torch.float64)
    return _exact_keep(_verifier_mass(p), q, w, tokens_only).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def deferral_estimates(target, draft, context: Sequence[int], target_logits: torch.Tensor,
                       draft_logits: torch.Tensor, fly, *, weight: float = 1.0, temperature: float = 1.0,
                       tokens_only: bool = False, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One unbiased estimate d_hat of the deferral probability at each of N positions (float64 [N]): position t's
    context is ``context[:start + t]`` where start = len(context) - N, and ``target_logits`` / ``draft_logits`` [N, V]
    are both models' logits there. ``fly`` a :class:`~diversed_ext.decoding.Fly` with its window resolved; ``weight``
    the static weight of the exact test (1: sd)."""
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
    branches = [list(context[:start + t]) + [int(drafted[t])] for t in rolled]
    draft_runner = make_runner(draft, model_device(draft), fast_forward=True)
    target_runner = make_runner(target, model_device(target), fast_forward=True)
    vocab = p.shape[-1]
    branch_q = []
    for _ in range(fly.window):  # the next W drafts along each branch, sampled from the draft as the loop does
        logits, _, _ = draft_runner.run_rows(branches, [None] * len(branches), [1] * len(branches), False)
        step_q = _probs(logits.float().cpu()[:, :vocab], temperature)
        tokens = torch.multinomial(step_q.float(), 1, generator=generator).squeeze(-1)
        branch_q.append((step_q, tokens))
        branches = [branch + [int(token)] for branch, token in zip(branches, tokens)]
    feeds = [branch[:-1] for branch in branches]
    logits, _, _ = target_runner.run_rows(feeds, [None] * len(feeds), [fly.window] * len(feeds), False)
    branch_p = _probs(logits.float().cpu()[:, :vocab], temperature).view(len(feeds), fly.window, vocab)
    passes = torch.ones(len(rolled), dtype=torch.float64)
    for j, (step_q, tokens) in enumerate(branch_q):
        passes = passes * _keep_of(branch_p[:, j], step_q, tokens, weight, tokens_only)
    estimate[rolled] = estimate[rolled] * passes
    return estimate


@torch.no_grad()
def fly_divergences(target, draft, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], fly, *,
                    weight: float = 1.0, temperature: float = 1.0, tokens_only: bool = False, samples: int = 1,
                    seed: int = 0) -> list[tuple[float, float]]:
    """(mean deferral probability, mean TV(out, p)) over each completion's positions, TV = TV(law without FLy, p) +
    d_hat (see the module), each position's d_hat the mean of ``samples`` independent estimates drawn with a
    generator seeded by ``seed`` + the prompt's index; (NaN, NaN) for an empty completion."""
    from .teacher_forcing import _completion_outputs

    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    law = RuleLaw("exact") if weight == 1.0 else RuleLaw("static", weight, tokens_only=tokens_only)
    results = [(float("nan"), float("nan"))] * len(completions)
    filled = [index for index, completion in enumerate(completions) if completion]
    if not filled:
        return results
    pairs = ([list(prompts[index]) for index in filled], [list(completions[index]) for index in filled])
    outputs = zip(_completion_outputs(target, *pairs), _completion_outputs(draft, *pairs))
    for index, ((_, target_logits), (_, draft_logits)) in zip(filled, outputs):
        vocab = min(target_logits.shape[-1], draft_logits.shape[-1])
        target_logits, draft_logits = target_logits.cpu()[:, :vocab], draft_logits.cpu()[:, :vocab]
        context = list(prompts[index]) + list(completions[index])  # position t reads prompt + completion[:t]
        generator = torch.Generator().manual_seed(seed + index)
        deferral = sum(deferral_estimates(target, draft, context, target_logits, draft_logits, fly, weight=weight,
                                          temperature=temperature, tokens_only=tokens_only, generator=generator)
                       for _ in range(samples)) / samples
        _, tv = divergences(position_law(law, target_logits, draft_logits, temperature), target_logits, temperature)
        results[index] = (float(deferral.mean()), float((tv + deferral).mean()))
    return results
