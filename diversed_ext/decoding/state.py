"""One request in flight (:class:`DecodingState`) and how a round's tokens are appended to it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from .stats import Generation, RoundStats


@dataclass
class DecodingState:
    """One prompt in flight: the tokens so far, both models' caches and the statistics. Built by
    :meth:`SpeculativeDecoder.start`, advanced by :meth:`SpeculativeDecoder.step` (alone) or
    :meth:`SpeculativeDecoder.step_batch` (with other requests in the same passes).

    Invariant between rounds: each cache holds a prefix of ``tokens`` and never its last token, which is fed in the
    next round. ``target_cached == len(tokens) - 1`` after the first round; the draft may lag by one token (the last
    draft of a fully accepted block, which the draft never had to read).
    """

    tokens: list[int]
    prompt_length: int
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    seed: int
    generator: torch.Generator
    target_cache: object = None
    draft_cache: object = None
    target_cached: int = 0
    draft_cached: int = 0
    draft_features: object = None  # an EAGLE-3 head's pending target features [n, H] (decoding/eagle_drafting.py)
    round_index: int = 0
    draft_length_policy: object = None  # the draft-length policy whose memory the request holds
    draft_length_memory: object = None  # what that policy learnt of this request (draft_lengths.py)
    finish_reason: Optional[str] = None
    rounds: list[RoundStats] = field(default_factory=list)
    started_at: float = field(default_factory=time.perf_counter)

    @property
    def new_tokens(self) -> list[int]:
        """Tokens generated so far (the prompt excluded)."""
        return self.tokens[self.prompt_length:]

    @property
    def remaining(self) -> int:
        """Tokens this request may still emit."""
        return self.max_new_tokens - (len(self.tokens) - self.prompt_length)

    @property
    def finished(self) -> bool:
        """True once EOS was emitted or max_new_tokens reached."""
        return self.finish_reason is not None

    def generation(self) -> Generation:
        """The new tokens and statistics so far, as a :class:`Generation`."""
        return Generation(prompt_length=self.prompt_length, tokens=torch.tensor(self.new_tokens, dtype=torch.int64),
                          rounds=list(self.rounds), seconds=time.perf_counter() - self.started_at,
                          finish_reason=self.finish_reason or "unfinished", seed=self.seed)


def commit_tokens(state: DecodingState, new_tokens: list[int], remaining: int) -> int:
    """Append the round's tokens, cut at the first EOS and at max_new_tokens; returns how many were kept."""
    kept = new_tokens[:remaining]
    for position, token in enumerate(kept):
        if token in state.eos_token_ids:
            kept = kept[:position + 1]
            state.finish_reason = "eos"
            break
    state.tokens.extend(kept)
    if state.finish_reason is None and len(state.new_tokens) >= state.max_new_tokens:
        state.finish_reason = "length"
    return len(kept)
