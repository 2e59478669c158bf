"""Rollouts for the trainer: completions sampled with the current head, and where each token was drawn from.

:func:`speculative_rollout` samples through the speculative loop, as in deployment. A token at a position where a
draft was verified (a kept draft, or the correction sampled from the residual at the first rejection) follows
nu = w p + (1 - w) q; a round that keeps all its drafts (or drafts none) then adds a bonus token drawn from the target
p alone, where w changes nothing. So the loop's completions do not follow nu token by token: each records which of
its tokens were verified (:func:`verified_tokens`), and the trainer leaves the bonus tokens out of the head's terms.
:func:`mixture_rollout` samples nu token by token with full forward passes (every token from nu: the tests'
reference, and a fallback for models the loop does not support). An EAGLE-3 head's q also depends on how many steps
into its round it drafts, so it rolls out through the loop only, and each completion says at which step every token
was drafted (:func:`draft_steps`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import torch

from ..decoding import DEFAULT_MAX_DRAFT, SpeculativeDecoder
from ..decoding.eagle_drafting import is_eagle_head
from ..decoding.runners import model_device
from ..head import EnsembleHead, distribution_features, wants_distributions
from ..ops import distribution_temperature, is_greedy_temperature


class Completion(NamedTuple):
    """One rollout: its token ids; for each the draft step (0-based) whose q the loop mixed in there, or None where
    every token's q is the one a fresh round would draft it with; and for each whether it was drawn from nu (a draft
    was verified there) rather than from p (a bonus token), or None where every token was drawn from nu (both None
    for token-by-token sampling)."""

    tokens: list[int]
    draft_steps: Optional[list[int]] = None
    verified: Optional[list[bool]] = None


# (prompts' token ids, one rollout seed per prompt) -> one Completion per prompt
Rollout = Callable[[Sequence[Sequence[int]], Sequence[int]], list[Completion]]


def draft_steps(rounds) -> list[int]:
    """The draft step (0-based) of every token a generation emitted, from its rounds
    (:class:`~diversed_ext.decoding.RoundStats`): token m of a round that drafted d tokens was drafted at step m
    when m < d. A token no draft covered (a round's bonus token, sampled from p alone, and the first round's) counts
    as step 0: the q a fresh round would draft it with."""
    steps = []
    for round_stats in rounds:
        steps += [m if m < round_stats.drafted else 0 for m in range(round_stats.emitted)]
    return steps


def verified_tokens(rounds) -> list[bool]:
    """For every token a generation emitted, from its rounds (:class:`~diversed_ext.decoding.RoundStats`), whether
    a draft was verified at its position: token m of a round that drafted d tokens was when m < d (a kept draft, or
    the correction after the first rejection: either way drawn from nu). Token d, emitted only when all d drafts were
    kept, is the bonus token, drawn from p (so is the token of a round that drafted nothing)."""
    verified = []
    for round_stats in rounds:
        verified += [m < round_stats.drafted for m in range(round_stats.emitted)]
    return verified


def nu_mask(completions: Sequence[Completion], mask: torch.Tensor) -> torch.Tensor:
    """[N, T] bool: ``mask`` (True at the completions' tokens, right-padded to T) where the token was drawn from nu,
    False at bonus tokens (:attr:`Completion.verified`; None: every token from nu)."""
    if len(completions) != mask.shape[0]:
        raise ValueError(f"{len(completions)} completions for a mask of {mask.shape[0]} rows")
    drawn = mask.clone()
    for row, completion in enumerate(completions):
        if completion.verified is None:
            continue
        if len(completion.verified) != len(completion.tokens):
            raise ValueError(f"verified: {len(completion.verified)} flags for a completion of "
                             f"{len(completion.tokens)} tokens")
        flags = torch.tensor(list(completion.verified), dtype=torch.bool, device=mask.device)
        drawn[row, :len(flags)] &= flags
    return drawn


def speculative_rollout(target, draft, head, *, max_draft: int = DEFAULT_MAX_DRAFT, max_new_tokens: int,
                        temperature: float = 1.0, eos_token_id=None, batch_size: Optional[int] = None):
    """A rollout through the speculative loop with the current head, at the cost of deployment: verified tokens
    follow nu, bonus tokens p (each completion flags which, :func:`verified_tokens`); the prompts are decoded
    together, up to ``batch_size`` at a time (None: all), each with its own seed."""
    decoder = SpeculativeDecoder(target, draft, method="diversed", head=head, max_draft=max_draft,
                                 temperature=temperature)

    def rollout(prompts: Sequence[Sequence[int]], seeds: Sequence[int]) -> list[Completion]:
        output = decoder.generate([list(prompt) for prompt in prompts], max_new_tokens=max_new_tokens,
                                  eos_token_id=eos_token_id, seed=list(seeds), batch_size=batch_size)
        return [Completion(generation.tokens.tolist(), draft_steps(generation.rounds),
                           verified_tokens(generation.rounds)) for generation in output.generations]

    return rollout


def mixture_rollout(target, draft, head: EnsembleHead, *, max_new_tokens: int, temperature: float = 1.0,
                    eos_token_id: Optional[int] = None) -> Rollout:
    """A rollout that samples nu = w p + (1 - w) q token by token with full forward passes.

    Every token is drawn from nu (the speculative loop draws its bonus tokens from p instead), so this is the
    reference rollout of the tests and a fallback for models the speculative decoder does not support. Raises
    ValueError for an EAGLE-3 ``draft``, whose q exists only inside the loop's rounds.
    """
    if is_eagle_head(draft):
        raise ValueError("rollout: an EAGLE-3 draft's q depends on the step of its round it drafts at, so it rolls "
                         "out through the speculative loop only (rollout='speculative')")

    target_device = model_device(target)  # where the head meets both models' outputs

    def rollout(prompts: Sequence[Sequence[int]], seeds: Sequence[int]) -> list[Completion]:
        return [Completion(rollout_one(prompt, seed)) for prompt, seed in zip(prompts, seeds)]

    @torch.no_grad()
    def rollout_one(prompt: Sequence[int], seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(int(seed))
        sequence = list(prompt)
        for _ in range(max_new_tokens):
            target_hidden, target_logits = _last_position(target, sequence, target_device)
            draft_hidden, draft_logits = _last_position(draft, sequence, target_device)
            extra = ()
            if wants_distributions(head):
                extra = (distribution_features(draft_logits, target_logits, temperature),)
            weight = head(draft_hidden, target_hidden, *extra)
            scale = distribution_temperature(temperature)
            mixture = weight * (target_logits / scale).softmax(-1) + (1 - weight) * (draft_logits / scale).softmax(-1)
            # Sampled on the CPU with the CPU generator: the same seed gives the same draws wherever the models run.
            mixture = mixture.cpu()
            token = (int(mixture.argmax()) if is_greedy_temperature(temperature)
                     else int(torch.multinomial(mixture, 1, generator=generator)))
            sequence.append(token)
            if eos_token_id is not None and token == eos_token_id:
                break
        return sequence[len(prompt):]

    return rollout


def _last_position(model, sequence: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(last hidden state, logits) of ``model`` at the sequence's last position, in float32 on ``device``."""
    input_ids = torch.tensor([sequence], device=model_device(model))
    output = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    return output.hidden_states[-1][0, -1].float().to(device), output.logits[0, -1].float().to(device)
