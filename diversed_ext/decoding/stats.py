"""What a decoding run measured: per round, per generation, and totals over many generations."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Iterable

import torch


@dataclass
class RoundStats:
    """What one round (one target forward pass) did and how long each part took.

    Attributes:
        drafted: tokens the draft proposed (0 for ``ar`` and when one token is left to emit).
        accepted: drafts the verifier accepted (before any cut at EOS or max_new_tokens).
        emitted: tokens appended to the output this round (after that cut).
        draft_seconds: the draft's forward passes.
        target_seconds: the target's forward pass.
        head_seconds: the weight head (``diversed`` only).
        verify_seconds: the verification call (fused softmax of both models' logits, accept tests, final sample).
        round_seconds: wall time of the whole round; the rest is sampling, bookkeeping and cache cropping.
        draft_tokens: the tokens the draft proposed, in order (accepted or not).
        weights: the w the head chose for each of ``draft_tokens`` (``diversed`` only; empty otherwise), so a run
            can show what its head learned.
    """

    drafted: int
    accepted: int
    emitted: int
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    head_seconds: float = 0.0
    verify_seconds: float = 0.0
    round_seconds: float = 0.0
    draft_tokens: tuple = ()
    weights: tuple = ()

    @property
    def overhead_seconds(self) -> float:
        """Time of the round spent outside the two models' forward passes."""
        return self.round_seconds - self.draft_seconds - self.target_seconds


@dataclass
class Generation:
    """One prompt's continuation and the rounds that produced it.

    Attributes:
        prompt_length: tokens in the prompt.
        tokens: int64 [N] new tokens only (N <= max_new_tokens; ends with EOS when ``finish_reason == "eos"``).
        rounds: one :class:`RoundStats` per target forward pass.
        seconds: wall time of the whole generation.
        finish_reason: ``"eos"`` or ``"length"``.
        seed: the seed this prompt ran with (draft sampling and verification).
    """

    prompt_length: int
    tokens: torch.Tensor
    rounds: list[RoundStats]
    seconds: float
    finish_reason: str
    seed: int

    def summary(self) -> "DecodingSummary":
        """This generation's totals."""
        rounds = self.rounds
        return DecodingSummary(
            prompts=1, new_tokens=len(self.tokens), target_passes=len(rounds),
            drafted=sum(stats.drafted for stats in rounds), accepted=sum(stats.accepted for stats in rounds),
            seconds=self.seconds, draft_seconds=sum(stats.draft_seconds for stats in rounds),
            target_seconds=sum(stats.target_seconds for stats in rounds),
            head_seconds=sum(stats.head_seconds for stats in rounds),
            verify_seconds=sum(stats.verify_seconds for stats in rounds),
            round_seconds=sum(stats.round_seconds for stats in rounds))


@dataclass
class DecodingSummary:
    """Totals over one or more generations (see :func:`summarize`)."""

    prompts: int
    new_tokens: int
    target_passes: int
    drafted: int
    accepted: int
    seconds: float
    draft_seconds: float
    target_seconds: float
    head_seconds: float
    verify_seconds: float
    round_seconds: float

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafted tokens (NaN when nothing was drafted, as for ``ar``)."""
        return self.accepted / self.drafted if self.drafted else math.nan

    @property
    def tokens_per_pass(self) -> float:
        """Mean tokens emitted per target forward pass (1 for ``ar``, up to K + 1)."""
        return self.new_tokens / self.target_passes if self.target_passes else math.nan

    @property
    def drafts_per_round(self) -> float:
        """Mean tokens drafted per round (per target pass): what a draft-length policy chose, on average."""
        return self.drafted / self.target_passes if self.target_passes else math.nan

    @property
    def tokens_per_second(self) -> float:
        """New tokens over the wall time of the generations."""
        return self.new_tokens / self.seconds if self.seconds > 0 else math.nan

    @property
    def overhead_fraction(self) -> float:
        """Share of the rounds' time spent outside the two models' forward passes."""
        if self.round_seconds <= 0:
            return math.nan
        return (self.round_seconds - self.draft_seconds - self.target_seconds) / self.round_seconds


@dataclass
class GenerationOutput:
    """What :meth:`SpeculativeDecoder.generate` returns: one :class:`Generation` per prompt, in order, and the wall
    time of the whole call (``seconds``): with several prompts in the same passes, the prompts' own times overlap, so
    throughput is their tokens over this time (:attr:`tokens_per_second`)."""

    generations: list[Generation]
    seconds: float = math.nan

    @property
    def tokens_per_second(self) -> float:
        """Throughput: every prompt's new tokens over the wall time of the call."""
        return sum(len(tokens) for tokens in self.sequences) / self.seconds if self.seconds > 0 else math.nan

    @property
    def sequences(self) -> list[torch.Tensor]:
        """New tokens of every prompt (int64 1-D tensors of possibly different lengths)."""
        return [generation.tokens for generation in self.generations]

    @property
    def rounds(self) -> list[list[RoundStats]]:
        """Per-round statistics of every prompt."""
        return [generation.rounds for generation in self.generations]

    def padded(self, pad_value: int = -1) -> torch.Tensor:
        """New tokens as one int64 [num_prompts, longest] tensor, shorter rows filled with ``pad_value``."""
        longest = max((len(tokens) for tokens in self.sequences), default=0)
        out = torch.full((len(self.generations), longest), pad_value, dtype=torch.int64)
        for row, tokens in enumerate(self.sequences):
            out[row, :len(tokens)] = tokens.cpu()
        return out

    def summary(self) -> DecodingSummary:
        """Totals over all prompts (acceptance rate, tokens per pass, tokens/s, time split)."""
        return summarize(self.generations)


def add_summaries(summaries: Iterable[DecodingSummary]) -> DecodingSummary:
    """Field-wise totals of several summaries (for example one per prompt); all zeros for none."""
    names = [item.name for item in fields(DecodingSummary)]
    totals = dict.fromkeys(names, 0)
    for summary in summaries:
        for name in names:
            totals[name] += getattr(summary, name)
    return DecodingSummary(**totals)


def summarize(generations: Iterable[Generation]) -> DecodingSummary:
    """Add up the statistics of several generations (for example one method over many prompts and seeds)."""
    return add_summaries(generation.summary() for generation in generations)
