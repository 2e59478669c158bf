"""One teacher-forced pass of both models over generated sequences: what the trainer needs per generated token.

For a prompt x and a completion y_1..y_T, both models read x + y once (no cache, no sampling). At the position that
predicts y_t this gives the last hidden states h_draft_t and h_target_t (the head's inputs, exactly those it saw
while decoding) and the logits, from which :func:`diversed_ext.token_stats` takes p_t(y_t), q_t(y_t), their log
probabilities and TV(p_t, q_t) in one pass over the vocabulary, without materialising probabilities; :func:`fidelity_gap` the expected-fidelity term's G_t = E_q[log p] - E_p[log p] (chunked, so small
temporaries); and :func:`~diversed_ext.head.distribution_features` what a head that reads them sees at each position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..head import DISTRIBUTION_FEATURES, distribution_features
from ..ops import distribution_temperature, token_stats


@dataclass
class TokenBatch:
    """Per-token quantities of N sequences, right-padded to the longest completion T."""

    draft_hidden: torch.Tensor  # [N, T, Hd]
    target_hidden: torch.Tensor  # [N, T, Ht]
    target_logprob: torch.Tensor  # [N, T]
    draft_logprob: torch.Tensor  # [N, T]
    total_variation: torch.Tensor  # [N, T]
    mask: torch.Tensor  # [N, T] bool, True at real completion tokens
    fidelity_gap: torch.Tensor  # [N, T] E_q[log p] - E_p[log p] (see fidelity_gap)
    distributions: torch.Tensor  # [N, T, F] distribution_features of both models' logits at each position


LOG_PROB_FLOOR = -100.0  # nats: a token the target rules out (-inf) costs a bounded amount in fidelity_gap


def fidelity_gap(draft_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """G = E_q[log p] - E_p[log p] per position ([..., V] logits -> [...]): how much the expected target
    log-probability of the next token changes per unit of draft weight (1 - w) in the mixture. Computed in float32
    chunks of positions, so the [T, V] temporaries stay small."""
    scale = 1.0 / distribution_temperature(temperature)
    gaps = []
    for target_chunk, draft_chunk in zip(target_logits.float().split(64, dim=-2), draft_logits.float().split(64, dim=-2)):
        target_logprob = (target_chunk * scale).log_softmax(-1).clamp_min(LOG_PROB_FLOOR)
        difference = (draft_chunk * scale).softmax(-1) - target_logprob.exp()
        gaps.append((difference * target_logprob).sum(-1))
    return torch.cat(gaps, dim=-1) if gaps else target_logits.new_zeros(target_logits.shape[:-1], dtype=torch.float32)


def _last_hidden_and_logits(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    output = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    return output.hidden_states[-1], output.logits


@torch.no_grad()
def teacher_forced_tokens(target, draft, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                          temperature: float = 1.0) -> TokenBatch:
    """Hidden states and token statistics for every completion token (one forward pass per model and sequence).

    Args:
        target, draft: Hugging Face causal LMs sharing a tokenizer.
        prompts: N prompt token lists (non-empty).
        completions: N completion token lists (possibly empty).
        temperature: the sampling temperature the completions were drawn at (0 counts as 1).
    """
    if len(prompts) != len(completions):
        raise ValueError(f"prompts ({len(prompts)}) and completions ({len(completions)}) must pair up")
    device = next(target.parameters()).device
    longest = max([len(completion) for completion in completions] + [1])
    rows = []
    for prompt, completion in zip(prompts, completions):
        if len(prompt) == 0:
            raise ValueError("every prompt needs at least one token")
        rows.append(_sequence_tokens(target, draft, list(prompt), list(completion), temperature, device))
    return TokenBatch(*(_pad_stack([row[field] for row in rows], longest) for field in range(8)))


def _sequence_tokens(target, draft, prompt: list[int], completion: list[int], temperature: float,
                     device: torch.device) -> tuple:
    length = len(completion)
    if length == 0:
        return _empty_row(target, draft)
    input_ids = torch.tensor([prompt + completion[:-1]], device=device)
    target_hidden, target_logits = _last_hidden_and_logits(target, input_ids)
    draft_hidden, draft_logits = _last_hidden_and_logits(draft, input_ids.to(next(draft.parameters()).device))
    positions = slice(len(prompt) - 1, len(prompt) - 1 + length)
    target_logits = target_logits[:, positions].float()
    draft_logits = draft_logits[:, positions].float().to(target_logits.device)
    tokens = torch.tensor([completion], device=target_logits.device)
    stats = token_stats(draft_logits.contiguous(), target_logits.contiguous(), tokens, from_logits=True,
                        temperature=distribution_temperature(temperature), check_inputs=False)
    return (draft_hidden[0, positions].float(), target_hidden[0, positions].float(), stats.target_logprob[0],
            stats.draft_logprob[0], stats.total_variation[0], torch.ones(length, dtype=torch.bool),
            fidelity_gap(draft_logits[0], target_logits[0], temperature),
            distribution_features(draft_logits[0], target_logits[0], temperature))


def _empty_row(target, draft) -> tuple:
    draft_size, target_size = draft.config.hidden_size, target.config.hidden_size
    empty = torch.zeros(0)
    return (torch.zeros(0, draft_size), torch.zeros(0, target_size), empty, empty, empty,
            torch.zeros(0, dtype=torch.bool), empty, torch.zeros(0, len(DISTRIBUTION_FEATURES)))


def _pad_stack(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
    padded = []
    for tensor in tensors:
        tensor = tensor.cpu()
        pad_shape = (length - tensor.shape[0],) + tuple(tensor.shape[1:])
        padded.append(torch.cat([tensor, torch.zeros(pad_shape, dtype=tensor.dtype)], dim=0))
    return torch.stack(padded)


@torch.no_grad()
def fidelity(target, prompt: Sequence[int], completion: Sequence[int], temperature: float = 1.0) -> float:
    """Mean target log-probability per generated token (NaN for an empty completion), at the sampling temperature
    (0 counts as 1): how likely the target finds what was generated, for tasks without labels."""
    if not completion:
        return float("nan")
    device = next(target.parameters()).device
    ids = torch.tensor([list(prompt) + list(completion)], dtype=torch.int64, device=device)
    logits = target(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:-1].float()
    scale = distribution_temperature(temperature)
    logprobs = (logits / scale).log_softmax(-1)
    picked = logprobs.gather(-1, torch.tensor(list(completion), device=device).unsqueeze(-1))
    return float(picked.mean())
