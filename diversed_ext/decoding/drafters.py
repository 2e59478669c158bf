"""Drafters that give tokens only, for :class:`~diversed_ext.decoding.SpeculativeDecoder`'s ``drafter=``: a callable
``drafter(context_token_ids: list[int], k: int) -> list[int]`` proposing up to k next tokens."""

from __future__ import annotations

from numbers import Integral


class NgramDrafter:
    """Prompt lookup (vLLM's "ngram" drafter): find the most recent earlier place where the context's last n tokens
    occur, for n from ``max_n`` down to ``min_n``, and propose the up to k tokens that followed it there; no match
    proposes nothing (the round then emits one target token). Free to run, and good wherever the output copies its
    context (quoting, editing, code, lists)."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        for name, value in (("max_n", max_n), ("min_n", min_n)):
            if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
                raise ValueError(f"NgramDrafter: {name} must be an int >= 1, got {value!r}")
        if min_n > max_n:
            raise ValueError(f"NgramDrafter: min_n ({min_n}) must not exceed max_n ({max_n})")
        self.max_n, self.min_n = int(max_n), int(min_n)

    def __call__(self, context: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            suffix = context[-n:]
            # Every start but the suffix's own, latest first: a match is followed by at least one token.
            for start in range(len(context) - n - 1, -1, -1):
                if context[start:start + n] == suffix:
                    return context[start + n:start + n + k]
        return []

    def __repr__(self) -> str:
        return f"NgramDrafter(max_n={self.max_n}, min_n={self.min_n})"
