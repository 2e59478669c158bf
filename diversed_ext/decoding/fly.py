"""FLy settings of a decoder: the verifier's entropy-gated deferral (:func:`diversed_ext.verify_logits`' fly_window,
fly_threshold and fly_top_k) applied every round. Lossy: with FLy the tokens no longer follow nu (nor the target for
``sd``); a rejected draft is kept when the next drafts pass and the target is unsure there."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from .. import rules

# vLLM's default window: min(6, K - 1) for K drafted tokens a round.
MAX_DEFAULT_FLY_WINDOW = 6


@dataclass(frozen=True)
class Fly:
    """FLy's settings: ``window`` W (None: vLLM's default, min(6, K - 1) for the decoder's K), the entropy threshold
    tau and how many of the target's largest probabilities the entropy sums."""

    window: Optional[int] = None
    threshold: float = rules.FLY_DEFAULT_THRESHOLD
    top_k: int = rules.FLY_DEFAULT_TOP_K

    def __post_init__(self):
        if self.window is not None and rules.fly_window(self.window) < 1:
            raise ValueError(f"Fly window must be >= 1 (leave fly=None for no FLy), got {self.window}")
        object.__setattr__(self, "threshold", rules.fly_threshold(self.threshold))
        object.__setattr__(self, "top_k", rules.fly_top_k(self.top_k))

    def for_max_draft(self, max_draft: int) -> "Fly":
        """These settings with the window resolved for a decoder drafting up to ``max_draft`` tokens a round; a
        window must leave room to defer (W < K)."""
        if self.window is None:
            window = min(MAX_DEFAULT_FLY_WINDOW, max_draft - 1)
            return replace(self, window=window if window >= 1 else None)  # K = 1 leaves no room: nothing defers
        if self.window >= max_draft:
            raise ValueError(f"Fly window must be < max_draft = {max_draft} (W < K), got {self.window}")
        return self

    def verify_arguments(self, width: int) -> dict:
        """verify_logits' FLy arguments for a round drafting up to ``width`` tokens: a window the round cannot fit
        (W >= width) defers nothing, as in vLLM, so FLy is off for that round."""
        window = self.window if self.window is not None and self.window < width else 0
        return dict(fly_window=window, fly_threshold=self.threshold, fly_top_k=self.top_k)

    @property
    def label(self) -> str:
        top_k = f" k={self.top_k}" if self.top_k != rules.FLY_DEFAULT_TOP_K else ""
        return f"W={self.window} tau={self.threshold:g}{top_k}"
