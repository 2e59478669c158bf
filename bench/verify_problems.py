"""The problems bench_verify.py times its ops on, and what each op must read of them: random draft/target logits and
their probabilities, the bytes a fused kernel cannot avoid reading (the floors' numerators), and torch.sum over
exactly those bytes (the streaming floor)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

DRAFT_TARGET_AGREEMENT = 1.0  # scale of the noise between draft and target logits: about half the drafts pass at w=1


@dataclass
class Problem:
    draft_tokens: torch.Tensor
    draft_logits: torch.Tensor
    target_logits: torch.Tensor
    draft_probs: torch.Tensor
    target_probs: torch.Tensor


@dataclass
class OpBench:
    name: str
    fused: Callable[[Problem], object]
    reference: Callable[[Problem], object]
    fused_checked: Callable[[Problem], object] | None
    bytes_read: Callable[[int, int, int, int], int]  # (B, K, V, element size) -> bytes the fused kernel must read
    streaming: Callable[[Problem], object]  # torch.sum over exactly the bytes the fused kernel must read
    plain: Callable[[Problem, torch.Tensor], object] | None = None  # careful plain PyTorch, on explicit uniforms
    reference_on: Callable[[Problem, torch.Tensor], object] | None = None  # the reference on the same uniforms
    one_hot: Callable[[Problem], object] | None = None  # tokens only: the fused call on materialised one-hot rows


def make_problem(batch, num_positions, vocab, dtype, device, seed=0) -> Problem:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    draft_logits = torch.randn(batch, num_positions + 1, vocab, generator=generator) * 2.0
    target_logits = draft_logits + torch.randn(draft_logits.shape, generator=generator) * DRAFT_TARGET_AGREEMENT
    draft_logits = draft_logits[:, :num_positions].contiguous()
    draft_probs = draft_logits.softmax(-1)
    tokens = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=generator).reshape(batch, num_positions)
    return Problem(tokens.to(device), draft_logits.to(device=device, dtype=dtype),
                   target_logits.to(device=device, dtype=dtype), draft_probs.to(device=device, dtype=dtype),
                   target_logits.softmax(-1).to(device=device, dtype=dtype))


def verify_bytes(batch, num_positions, vocab, element_size):
    # Gathered values are negligible; the correction row needs p and q at one position per request.
    return batch * 2 * vocab * element_size


def all_rows_bytes(batch, num_positions, vocab, element_size):
    # Logits need every row's normaliser: draft [B, K, V] and target [B, K+1, V] are read whole.
    return batch * (2 * num_positions + 1) * vocab * element_size


def pair_bytes(batch, num_positions, vocab, element_size):
    return batch * 2 * num_positions * vocab * element_size


def stream_logits(pr: Problem):
    return torch.sum(pr.draft_logits), torch.sum(pr.target_logits)


def target_row_bytes(batch, num_positions, vocab, element_size):
    # Tokens only: no draft row; the gathers are a few values and the final token reads one target row per request.
    return batch * vocab * element_size


def target_rows_bytes(batch, num_positions, vocab, element_size):
    # Tokens only, from logits: every target row the request reads needs its normaliser.
    return batch * (num_positions + 1) * vocab * element_size


def stream_two_rows(pr: Problem):
    # The two rows per request that verify reads whole: p and q at one position (the gathers are a few values).
    return torch.sum(pr.target_probs[:, 0]), torch.sum(pr.draft_probs[:, 0])
