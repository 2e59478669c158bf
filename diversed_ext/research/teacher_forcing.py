"""One teacher-forced pass of both models over generated sequences: what the trainer needs per generated token.

For a prompt x and a completion y_1..y_T, both models read x + y once (no sampling), through the same runner the
decoding loop uses for them. At the position that predicts y_t this gives the last hidden states h_draft_t and
h_target_t (the head's inputs, those it sees while decoding) and the logits, from which :func:`diversed_ext.token_stats`
takes p_t(y_t), q_t(y_t), their log probabilities and TV(p_t, q_t) in one pass over the vocabulary without
materialising probabilities; :func:`fidelity_gap` the expected-fidelity term's G_t = E_q[log p] - E_p[log p]
(chunked, so small temporaries); :func:`mixture_divergence` the expected-divergence term's table of KL(nu_w || p)
over w; and :func:`~diversed_ext.head.distribution_features` what a head that reads them sees at each position. For
scoring decoded outputs, :func:`target_scores` gives a completion's fidelity and the target's entropy at the positions
it visited (one pass of the target).

An EAGLE-3 head as the draft reads the target's aux hidden states instead of the tokens alone, and its q at a position
depends on the step of its round it drafts at (:mod:`.eagle_unrolled`): the target's pass also gives the aux states,
and each token's q and state are the head's at the draft step the decoding loop used there (``draft_steps``, from
:func:`.rollouts.draft_steps`), computed with its float products.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Sequence

import torch

from ..head import distribution_features, wants_distributions
from ..decoding.eagle_drafting import is_eagle_head
from ..decoding.runners import make_runner, model_device
from ..ops import DISTRIBUTION_FEATURES, distribution_temperature, token_stats
from ..ops import mixture_divergence as ops_mixture_divergence
from .eagle_unrolled import unrolled_steps
from .objective import KL_GRID_POINTS


@dataclass
class TokenBatch:
    """Per-token quantities of N sequences, right-padded to the longest completion T, on the target's device."""

    draft_hidden: torch.Tensor  # [N, T, Hd]
    target_hidden: torch.Tensor  # [N, T, Ht]
    target_logprob: torch.Tensor  # [N, T]
    draft_logprob: torch.Tensor  # [N, T]
    total_variation: torch.Tensor  # [N, T]
    mask: torch.Tensor  # [N, T] bool, True at real completion tokens
    fidelity_gap: torch.Tensor  # [N, T] E_q[log p] - E_p[log p] (see fidelity_gap)
    distributions: torch.Tensor  # [N, T, F] distribution_features of both models' logits at each position
    # [N, T, KL_GRID_POINTS] KL(nu_w || p) at w = 0, 1/16, ..., 1 (see mixture_divergence); [N, T, 0] when the pass
    # was asked not to tabulate it (divergence=False)
    kl_table: torch.Tensor

    def to(self, device) -> "TokenBatch":
        """This batch with every tensor on ``device``."""
        return TokenBatch(*(getattr(self, field.name).to(device) for field in fields(self)))

    def head_inputs(self, head) -> tuple:
        """What ``head`` reads at every position: both hidden states, and the distribution features when it takes
        them (:func:`~diversed_ext.head.wants_distributions`)."""
        extra = (self.distributions,) if wants_distributions(head) else ()
        return (self.draft_hidden, self.target_hidden, *extra)


LOG_PROB_FLOOR = -100.0  # nats: a token the target rules out (-inf) costs a bounded amount in fidelity_gap
POSITIONS_PER_CHUNK = 64  # positions whose [positions, V] float32 temporaries exist at once


def _chunked_distributions(draft_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float):
    """(log p floored at LOG_PROB_FLOOR, q) of successive chunks of positions, in float32."""
    scale = 1.0 / distribution_temperature(temperature)
    for target_chunk, draft_chunk in zip(target_logits.float().split(POSITIONS_PER_CHUNK, dim=-2),
                                         draft_logits.float().split(POSITIONS_PER_CHUNK, dim=-2)):
        yield (target_chunk * scale).log_softmax(-1).clamp_min(LOG_PROB_FLOOR), (draft_chunk * scale).softmax(-1)


def fidelity_gap(draft_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """G = E_q[log p] - E_p[log p] per position ([..., V] logits -> [...]): how much the expected target
    log-probability of the next token changes per unit of draft weight (1 - w) in the mixture. Computed in float32
    chunks of positions, so the [T, V] temporaries stay small."""
    gaps = [((draft_probs - target_logprob.exp()) * target_logprob).sum(-1)
            for target_logprob, draft_probs in _chunked_distributions(draft_logits, target_logits, temperature)]
    return torch.cat(gaps, dim=-1) if gaps else target_logits.new_zeros(target_logits.shape[:-1], dtype=torch.float32)


def mixture_divergence(draft_logits: torch.Tensor, target_logits: torch.Tensor,
                       temperature: float = 1.0) -> torch.Tensor:
    """KL(nu_w || p) per position at the ``KL_GRID_POINTS`` weights w = 0, 1/16, ..., 1 of the mixture
    nu_w = w p + (1 - w) q ([..., V] logits -> [..., KL_GRID_POINTS]): the expected-divergence term's table
    (objective.py), by :func:`diversed_ext.mixture_divergence` with log p floored as in :func:`fidelity_gap`, so a
    draft that puts mass on a token the target rules out costs a bounded amount."""
    vocab = target_logits.shape[-1]
    table = ops_mixture_divergence(draft_logits.reshape(1, -1, vocab), target_logits.reshape(1, -1, vocab),
                                   temperature=distribution_temperature(temperature), grid_points=KL_GRID_POINTS,
                                   log_floor=LOG_PROB_FLOOR, check_inputs=False)
    return table.view(target_logits.shape[:-1] + (KL_GRID_POINTS,))


SEQUENCES_PER_PASS = 8  # sequences per forward call: their [tokens, V] logits stay a few hundred MB


def _completion_outputs(model, prompts: Sequence[list[int]], completions: Sequence[list[int]], aux_layers=None):
    """(hidden [T_n, H], logits [T_n, V]) at the positions that predicted each token of every completion, through the
    runner the decoding loop uses for this model; with ``aux_layers``, third, the aux hidden states of every position
    read [P_n + T_n - 1, A]. On the lean Llama forward several sequences share one call, and an int8 draft quantises
    each sequence's rows as it does while decoding, so the head trains on the very hidden states and distributions it
    sees when it runs."""
    runner = make_runner(model, model_device(model), fast_forward=True)
    outputs = []
    for start in range(0, len(prompts), SEQUENCES_PER_PASS):
        chunk = range(start, min(start + SEQUENCES_PER_PASS, len(prompts)))
        lengths = [len(completions[index]) for index in chunk]
        feeds = [prompts[index] + completions[index][:-1] for index in chunk]
        results = runner.run_rows(feeds, [None] * len(feeds), lengths, True, aux_layers)
        parts = [results[1].float().split(lengths), results[0].float().split(lengths)]
        if aux_layers is not None:
            parts.append(results[3].split([len(feed) for feed in feeds]))
        outputs += zip(*parts)
    return outputs


def _eagle_outputs(head, prompt: list[int], completion: list[int], aux: torch.Tensor, steps) -> tuple:
    """(pre-norm states [T, H], full-vocabulary logits [T, V]) with which the EAGLE-3 ``head`` drafts each token of
    ``completion`` at its draft step (``steps[t]``, 0-based; None: every token at step 0), from the target's ``aux``
    hidden states at positions 0 .. P + T - 2."""
    steps = [0] * len(completion) if steps is None else [int(step) for step in steps]
    if len(steps) != len(completion):
        raise ValueError(f"draft_steps: {len(steps)} steps for a completion of {len(completion)} tokens")
    if any(not 0 <= step <= index for index, step in enumerate(steps)):
        raise ValueError("draft_steps: token t of a completion is drafted at a step in 0 .. t (its round starts "
                         "inside the completion)")
    if len(prompt) < 2:
        raise ValueError("an EAGLE-3 draft needs prompts of at least 2 tokens: its first draft reads the target's "
                         "features of the position before the prompt's last")
    depth = max(steps) + 1
    # Token P + t at step j is drafted from anchor P + t - j - 2: index t - j of the anchors from P - 2 on.
    tokens = torch.tensor([prompt + completion + [0] * depth], device=aux.device)
    logits, states, _ = unrolled_steps(head, {"tokens": tokens, "aux": aux.unsqueeze(0),
                                              "first_label": len(prompt) - 1}, depth)
    step = torch.tensor(steps, device=aux.device)
    anchor = torch.arange(len(completion), device=aux.device) - step
    chosen_logits = torch.stack([row[0] for row in logits])[step, anchor]
    chosen_states = torch.stack([row[0] for row in states])[step, anchor]
    return chosen_states.float(), head.full_vocab_logits(chosen_logits.float())


def pair_outputs(target, draft, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                 draft_steps: Optional[Sequence[Optional[Sequence[int]]]] = None) -> tuple[list, list, Optional[list]]:
    """(filled, target's, draft's): the indices of the non-empty completions, and for each of them the (hidden
    [T_n, H], logits [T_n, V]) at the positions that predicted its tokens: a draft model's over the same tokens; an
    EAGLE-3 head's at each token's draft step (``draft_steps`` as :func:`teacher_forced_tokens` takes them), from the
    aux states of the target's same pass. ``draft`` None: the target's alone (None for the draft's)."""
    if draft_steps is not None and len(draft_steps) != len(completions):
        raise ValueError(f"draft_steps ({len(draft_steps)}) and completions ({len(completions)}) must pair up")
    filled = [index for index, completion in enumerate(completions) if completion]
    prompts = [list(prompts[index]) for index in filled]
    completions = [list(completions[index]) for index in filled]
    if draft is None:
        return filled, _completion_outputs(target, prompts, completions), None
    if not is_eagle_head(draft):
        return (filled, _completion_outputs(target, prompts, completions),
                _completion_outputs(draft, prompts, completions))
    steps = [None if draft_steps is None else draft_steps[index] for index in filled]
    target_outputs = _completion_outputs(target, prompts, completions, aux_layers=tuple(draft.config.aux_layer_ids))
    draft_outputs = [_eagle_outputs(draft, prompt, completion, aux, row_steps) for prompt, completion, (_, _, aux),
                     row_steps in zip(prompts, completions, target_outputs, steps)]
    return filled, [output[:2] for output in target_outputs], draft_outputs


@torch.no_grad()
def teacher_forced_tokens(target, draft, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                          temperature: float = 1.0,
                          draft_steps: Optional[Sequence[Optional[Sequence[int]]]] = None, *,
                          divergence: bool = True) -> TokenBatch:
    """Hidden states and token statistics for every completion token (one forward pass of each model over every
    sequence).

    Args:
        target, draft: Hugging Face causal LMs sharing a tokenizer, or an EAGLE-3 head on the target as the draft.
        prompts: N prompt token lists (non-empty; at least 2 tokens with an EAGLE-3 draft).
        completions: N completion token lists (possibly empty).
        temperature: the sampling temperature the completions were drawn at (0 counts as 1).
        draft_steps: for an EAGLE-3 draft, each completion's draft step of every token (:func:`.rollouts.draft_steps`;
            None, or a None entry: step 0 everywhere). A draft model's q does not depend on it.
        divergence: tabulate KL(nu_w || p) over w (``kl_table``), 17 passes over each position's vocabulary that only
            the expected-divergence term and ``validate`` read; False leaves ``kl_table`` [N, T, 0].
    """
    if len(prompts) != len(completions):
        raise ValueError(f"prompts ({len(prompts)}) and completions ({len(completions)}) must pair up")
    if any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("every prompt needs at least one token")
    longest = max([len(completion) for completion in completions] + [1])
    filled, target_outputs, draft_outputs = pair_outputs(target, draft, prompts, completions, draft_steps)
    device = model_device(target)  # the batch's: a draft on another device hands its outputs over
    rows = [_empty_row(target, draft, device, divergence) for _ in completions]
    for index, (target_hidden, target_logits), (draft_hidden, draft_logits) in zip(filled, target_outputs,
                                                                                  draft_outputs):
        rows[index] = _sequence_tokens(completions[index], target_hidden, target_logits,
                                       draft_hidden.to(device), draft_logits.to(device), temperature, divergence)
    return TokenBatch(*(_pad_stack([row[field] for row in rows], longest) for field in range(len(fields(TokenBatch)))))


def _sequence_tokens(completion: Sequence[int], target_hidden, target_logits, draft_hidden, draft_logits,
                     temperature: float, divergence: bool) -> tuple:
    tokens = torch.tensor([list(completion)], device=target_logits.device)
    stats = token_stats(draft_logits.unsqueeze(0).contiguous(), target_logits.unsqueeze(0).contiguous(), tokens,
                        from_logits=True, temperature=distribution_temperature(temperature), check_inputs=False)
    return (draft_hidden, target_hidden, stats.target_logprob[0], stats.draft_logprob[0], stats.total_variation[0],
            torch.ones(len(completion), dtype=torch.bool, device=target_logits.device),
            fidelity_gap(draft_logits, target_logits, temperature),
            distribution_features(draft_logits, target_logits, temperature),
            mixture_divergence(draft_logits, target_logits, temperature) if divergence
            else target_logits.new_zeros(len(completion), 0))


def _empty_row(target, draft, device: torch.device, divergence: bool) -> tuple:
    draft_size, target_size = draft.config.hidden_size, target.config.hidden_size
    empty = torch.zeros(0, device=device)
    return (torch.zeros(0, draft_size, device=device), torch.zeros(0, target_size, device=device), empty, empty, empty,
            torch.zeros(0, dtype=torch.bool, device=device), empty,
            torch.zeros(0, len(DISTRIBUTION_FEATURES), device=device),
            torch.zeros(0, KL_GRID_POINTS if divergence else 0, device=device))


def _pad_stack(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
    padded = []
    for tensor in tensors:
        pad_shape = (length - tensor.shape[0],) + tuple(tensor.shape[1:])
        padded.append(torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=0))
    return torch.stack(padded)


@torch.no_grad()
def fidelity(target, prompt: Sequence[int], completion: Sequence[int], temperature: float = 1.0) -> float:
    """Mean target log-probability per generated token (NaN for an empty completion), at the sampling temperature
    (0 counts as 1): how likely the target finds what was generated, for tasks without labels."""
    return target_scores(target, prompt, completion, temperature)[0]


@torch.no_grad()
def target_scores(target, prompt: Sequence[int], completion: Sequence[int],
                  temperature: float = 1.0) -> tuple[float, float]:
    """(fidelity, entropy) of a completion under the target at ``temperature`` (0 counts as 1), from one forward pass:
    the mean of log p_t(y_t) and the mean of H(p_t) over the positions that predicted its tokens (NaN, NaN for an
    empty completion).

    Their sum is the completion's calibration gap (:mod:`.calibration`): E[log p_t(y_t)] = -H(p_t) when y_t is drawn
    from p_t, so the sum of log p_t(y_t) + H(p_t) over the completion is 0 in expectation for exact sampling, but not
    this mean over its positions once EOS ends it at a length that depends on its tokens: the reports pool the sums
    over prompts, each mean times the completion's length."""
    if not completion:
        return float("nan"), float("nan")
    device = next(target.parameters()).device
    ids = torch.tensor([list(prompt) + list(completion)], dtype=torch.int64, device=device)
    logits = target(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:-1].float()
    logprobs = (logits / distribution_temperature(temperature)).log_softmax(-1)
    picked = logprobs.gather(-1, torch.tensor(list(completion), device=device).unsqueeze(-1))
    probs = logprobs.exp()
    # Tokens the target rules out (log p = -inf) add 0 to the entropy, not 0 * -inf = NaN.
    entropy = -torch.where(probs > 0, probs * logprobs, torch.zeros_like(probs)).sum(-1)
    return float(picked.mean()), float(entropy.mean())
