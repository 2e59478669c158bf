"""How many tokens each request drafts each round: the draft-length policies of the decoding loop.

A policy answers three questions for one request, with no knowledge of its neighbours in a batch:

    budget(memory)                 before the round: the most drafts it may make (the loop also stops at EOS and
                                   at the request's length budget)
    keep_drafting(memory, drafts)  after each draft: whether to draft one more, from the draft probabilities
                                   q_i(x_i) of this round's drafts so far
    update(memory, outcome)        after verification: what the verifier reported for this round's drafts

``memory`` is the request's own (``policy.start()``, kept on its :class:`~diversed_ext.decoding.DecodingState`), so a
request's draft lengths, and with them its tokens, do not depend on its neighbours.

Why the output law is untouched: every decision reads what is known before the draft at which it stops is verified
(earlier rounds' verdicts, and the draft's own probabilities at positions already drafted), never that draft's own
verdict. A drafted position is then verified as at any fixed K (its token follows nu there), and a position not drafted
gets the bonus token, drawn from the target exactly as at a smaller fixed K; so standard speculative decoding still
follows the target exactly and greedy sd still equals greedy ar.

Policies (``DRAFT_LENGTHS``; each is capped at the decoder's ``max_draft``):

    fixed        K drafts every round (K = ``max_draft``): what the loop always did.
    heuristic    transformers' ``num_assistant_tokens_schedule="heuristic"``: start at ``start`` drafts, two more after
                 a round whose drafts were all kept, one fewer (at least one) otherwise.
    confidence   transformers' ``assistant_confidence_threshold``: stop after a draft whose draft probability
                 q(x) is below the threshold (0.4 at first); after every round the threshold is refitted to the
                 request's own (q(x), kept) pairs by minimising FPR + 3 FNR, as transformers does.
    gain         ours: draft one more only while that raises the round's expected tokens per unit of time. Each
                 draft's chance of being kept is predicted as 1 - w * rho * (1 - q(x)): the draft's own doubt about
                 its token, scaled by the weight w that the method puts on the target (the method's w; a head's
                 running mean w) and by rho, the request's observed rejection against that prediction, read from
                 the verifier's exact acceptance probabilities of every earlier draft (not just kept or not).
                 Time is counted in target passes: a round costs ``1 + ROUND_OVERHEAD`` plus ``draft_cost +
                 VERIFY_TOKEN_COST`` a draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from .. import rules

DRAFT_LENGTHS = ("fixed", "heuristic", "confidence", "gain")
# No policy beat each method's best fixed K on GSM8K with the default pair (docs/RESULTS.md#draft-lengths), so the
# loop drafts max_draft tokens a round unless asked otherwise.
DEFAULT_DRAFT_LENGTH = "fixed"

# transformers' defaults for its two rules (GenerationConfig of an assistant model).
HEURISTIC_START = 5  # num_assistant_tokens of the old default heuristic schedule
HEURISTIC_GROW, HEURISTIC_SHRINK = 2, 1
CONFIDENCE_THRESHOLD = 0.4  # assistant_confidence_threshold
CONFIDENCE_MIN_SAMPLES = 5  # transformers refits only past 5 (q(x), kept) pairs with both outcomes seen
CONFIDENCE_MISS_COST = 3.0  # a kept draft not drafted (false negative) costs 3 wasted drafts (false positives)

# The gain rule's costs in units of one target pass, measured on the default pair on this project's 2-core CPU
# (docs/RESULTS.md): a draft pass 5.8 ms against a target pass of 17.5 ms; each verified token adds about 0.5 ms to the
# target pass, and sampling, verification and bookkeeping about 1.3 ms a round. A GPU pair of a 7B target and a
# 68M-1B draft has a draft_cost of about 0.05-0.2: pass it as draft_cost=.
DEFAULT_DRAFT_COST = 0.33
VERIFY_TOKEN_COST = 0.03
ROUND_OVERHEAD = 0.08
# The gain rule's priors, each worth PRIOR_MASS drafts of evidence: the draft's doubt 1 - q(x) predicts a rejection
# at w = 1 (rho = 1); a head's weight before it has weighed anything.
PRIOR_MASS = 2.0
PRIOR_HEAD_WEIGHT = 0.5
# How much the next draft's doubt is predicted by the last one (the rest by the request's mean doubt).
DOUBT_PERSISTENCE = 0.5
# One more draft is worth more than its own expected token: if kept, it may be followed by more confident drafts,
# which the one-step comparison does not count. Replayed on recorded GSM8K train rounds of the default pair (every
# policy and fixed K from 1 to 8 on the same drafts and verdicts), 1.25 gave the most tokens per unit of time for sd,
# static w = 0.5 and the linear lambda = 4 head (1.0 gave 1-3 % less).
CONTINUATION_VALUE = 1.25


@dataclass
class RoundOutcome:
    """What the verifier reported for one request's round, handed to ``update``.

    Attributes:
        drafted: drafts made this round.
        accepted: drafts kept.
        accept_probs: the verifier's min(1, nu(x)/q(x)) at every drafted position (the exact chance it was kept).
        draft_probs: q_i(x_i) of every draft (empty when no policy read them, or for a drafter without
            distributions).
        weights: the weight on the target at every drafted position (the method's w, or the head's).
    """

    drafted: int
    accepted: int
    accept_probs: Sequence[float]
    draft_probs: Sequence[float]
    weights: Sequence[float]


class DraftLengthPolicy:
    """The fixed policy, and the base of the others: ``max_draft`` drafts every round."""

    name = "fixed"
    reads_draft_probs = False  # whether keep_drafting needs q_i(x_i) (the loop computes it only then)

    def __init__(self, max_draft: int):
        self.max_draft = rules.draft_length(max_draft)

    def start(self) -> object:
        """A new request's memory."""
        return None

    def budget(self, memory) -> int:
        """The most drafts this round (before the loop's own limits)."""
        return self.max_draft

    def keep_drafting(self, memory, draft_probs: Sequence[float]) -> bool:
        """After a draft: whether to draft one more (``draft_probs``: q_i(x_i) of this round's drafts so far)."""
        return True

    def update(self, memory, outcome: RoundOutcome) -> None:
        """Learn from one verified round."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_draft={self.max_draft})"


class HeuristicDraftLength(DraftLengthPolicy):
    """transformers' heuristic schedule, per request (its ``heuristic_transient``: every request starts afresh)."""

    name = "heuristic"

    def __init__(self, max_draft: int, start: int = HEURISTIC_START):
        super().__init__(max_draft)
        self.first = min(rules.draft_length(start, "start"), self.max_draft)

    def start(self) -> list:
        return [self.first]

    def budget(self, memory) -> int:
        return memory[0]

    def update(self, memory, outcome: RoundOutcome) -> None:
        if outcome.drafted == 0:
            return  # a round cut to no drafts by the length budget says nothing about the drafts
        if outcome.accepted == outcome.drafted:
            memory[0] = min(memory[0] + HEURISTIC_GROW, self.max_draft)
        else:
            memory[0] = max(1, memory[0] - HEURISTIC_SHRINK)


@dataclass
class _ConfidenceMemory:
    threshold: float
    draft_probs: list = field(default_factory=list)
    kept: list = field(default_factory=list)


class ConfidenceDraftLength(DraftLengthPolicy):
    """transformers' ``assistant_confidence_threshold``, with its refit after every round (per request)."""

    name = "confidence"
    reads_draft_probs = True

    def __init__(self, max_draft: int, threshold: float = CONFIDENCE_THRESHOLD, adaptive: bool = True):
        super().__init__(max_draft)
        self.threshold = rules.weight(threshold, "threshold")
        self.adaptive = bool(adaptive)

    def start(self) -> _ConfidenceMemory:
        return _ConfidenceMemory(self.threshold)

    def keep_drafting(self, memory: _ConfidenceMemory, draft_probs: Sequence[float]) -> bool:
        return draft_probs[-1] >= memory.threshold

    def update(self, memory: _ConfidenceMemory, outcome: RoundOutcome) -> None:
        if not self.adaptive or outcome.drafted == 0:
            return
        # Drafts past the first rejection were never judged: transformers keeps the kept ones and the first miss.
        judged = min(outcome.accepted + 1, outcome.drafted)
        memory.draft_probs += list(outcome.draft_probs[:judged])
        memory.kept += [1] * outcome.accepted + [0] * (judged - outcome.accepted)
        if len(memory.draft_probs) > CONFIDENCE_MIN_SAMPLES and 0 in memory.kept and 1 in memory.kept:
            memory.threshold = cheapest_threshold(memory.draft_probs, memory.kept)


def cheapest_threshold(scores: Sequence[float], kept: Sequence[int]) -> float:
    """The threshold t minimising FPR(t) + 3 FNR(t) when "score >= t" predicts "kept", over the thresholds of the ROC
    curve (every distinct score, and +inf, which predicts nothing kept): transformers' refit of its confidence
    threshold. Both outcomes must occur in ``kept``. Ties go to the highest threshold, as the ROC curve lists it
    first."""
    positives = sum(kept)
    negatives = len(kept) - positives
    pairs = sorted(zip(scores, kept), reverse=True)
    best_cost, best = CONFIDENCE_MISS_COST, float("inf")  # t = +inf: FPR 0, FNR 1
    true_pos = false_pos = 0
    for index, (score, outcome) in enumerate(pairs):
        true_pos += outcome
        false_pos += 1 - outcome
        if index + 1 < len(pairs) and pairs[index + 1][0] == score:
            continue  # one point of the curve per distinct score
        cost = false_pos / negatives + CONFIDENCE_MISS_COST * (1 - true_pos / positives)
        if cost < best_cost:
            best_cost, best = cost, score
    return best


@dataclass
class _GainMemory:
    observed_rejection: float = 0.0  # sum of 1 - accept_prob over earlier drafts
    predicted_rejection: float = 0.0  # sum of w * (1 - q(x)) over the same drafts
    doubt_sum: float = 0.0  # sum of 1 - q(x)
    weight_sum: float = 0.0
    drafts: int = 0


class GainDraftLength(DraftLengthPolicy):
    """Ours: draft while one more draft raises the round's expected tokens per unit of time (module docstring).

    Args:
        max_draft: the cap on drafts a round.
        weight: the method's weight on the target (1 for sd, w for static), or None when a head picks it per token
            (its running mean over the request is used).
        draft_cost: one draft pass over one target pass (default :data:`DEFAULT_DRAFT_COST`, the default pair's on a
            CPU).
    """

    name = "gain"
    reads_draft_probs = True

    def __init__(self, max_draft: int, weight: Optional[float] = 1.0, draft_cost: float = DEFAULT_DRAFT_COST):
        super().__init__(max_draft)
        self.weight = None if weight is None else rules.weight(weight)
        self.draft_cost = rules.non_negative(draft_cost, "draft_cost")

    def start(self) -> _GainMemory:
        return _GainMemory()

    def _weight(self, memory: _GainMemory) -> float:
        if self.weight is not None:
            return self.weight
        return (memory.weight_sum + PRIOR_MASS * PRIOR_HEAD_WEIGHT) / (memory.drafts + PRIOR_MASS)

    def _rho(self, memory: _GainMemory) -> float:
        return (memory.observed_rejection + PRIOR_MASS) / (memory.predicted_rejection + PRIOR_MASS)

    def _mean_doubt(self, memory: _GainMemory) -> float:
        return (memory.doubt_sum + PRIOR_MASS * 0.5) / (memory.drafts + PRIOR_MASS)

    def keep_probability(self, memory: _GainMemory, doubt: float) -> float:
        """Predicted chance that a draft whose doubt 1 - q(x) is ``doubt`` is kept."""
        return 1.0 - min(1.0, self._weight(memory) * self._rho(memory) * doubt)

    def keep_drafting(self, memory: _GainMemory, draft_probs: Sequence[float]) -> bool:
        reach = 1.0  # the chance every draft so far is kept
        expected_tokens = 1.0  # the bonus or correction token, plus each draft's chance of being reached and kept
        for prob in draft_probs:
            reach *= self.keep_probability(memory, 1.0 - prob)
            expected_tokens += reach
        next_doubt = DOUBT_PERSISTENCE * (1.0 - draft_probs[-1]) + (1 - DOUBT_PERSISTENCE) * self._mean_doubt(memory)
        gain = reach * self.keep_probability(memory, next_doubt)
        per_draft = self.draft_cost + VERIFY_TOKEN_COST
        seconds = 1.0 + ROUND_OVERHEAD + per_draft * len(draft_probs)
        # (tokens + gain) / (seconds + per_draft) > tokens / seconds, with the gain's continuation value
        return CONTINUATION_VALUE * gain * seconds > per_draft * expected_tokens

    def update(self, memory: _GainMemory, outcome: RoundOutcome) -> None:
        if not outcome.draft_probs:
            return
        for accept_prob, draft_prob, weight in zip(outcome.accept_probs, outcome.draft_probs, outcome.weights):
            doubt = 1.0 - draft_prob
            memory.observed_rejection += 1.0 - accept_prob
            memory.predicted_rejection += weight * doubt
            memory.doubt_sum += doubt
            memory.weight_sum += weight
            memory.drafts += 1

    def __repr__(self) -> str:
        return f"GainDraftLength(max_draft={self.max_draft}, weight={self.weight}, draft_cost={self.draft_cost})"


PolicyLike = Union[str, DraftLengthPolicy]


def make_policy(draft_length: PolicyLike, max_draft: int, *, weight: Optional[float] = 1.0,
                draft_cost: Optional[float] = None) -> DraftLengthPolicy:
    """The policy named ``draft_length`` (one of :data:`DRAFT_LENGTHS`) capped at ``max_draft``, or ``draft_length``
    itself when it is already a policy. ``weight``: the method's weight on the target, None when a head chooses it;
    ``draft_cost`` (gain only): a draft pass over a target pass."""
    if isinstance(draft_length, DraftLengthPolicy):
        if draft_cost is not None:
            raise ValueError("draft_cost applies to draft_length='gain' given by name; set it on the policy object")
        return draft_length
    if draft_length not in DRAFT_LENGTHS:
        raise ValueError(f"draft_length must be one of {', '.join(DRAFT_LENGTHS)} or a DraftLengthPolicy; "
                         f"got {draft_length!r}")
    if draft_cost is not None and draft_length != "gain":
        raise ValueError(f"draft_cost applies to draft_length='gain', not {draft_length!r}")
    if draft_length == "gain":
        return GainDraftLength(max_draft, weight, DEFAULT_DRAFT_COST if draft_cost is None else draft_cost)
    return {"fixed": DraftLengthPolicy, "heuristic": HeuristicDraftLength,
            "confidence": ConfidenceDraftLength}[draft_length](max_draft)


def check_draft_length(draft_length, max_draft: int, *, method: str, weight: float, drafter,
                       draft_cost) -> DraftLengthPolicy:
    """The decoder's draft-length policy: a name (capped at ``max_draft``) or a policy object. Policies that read the
    draft's probabilities need a draft model."""
    if not isinstance(draft_length, (str, DraftLengthPolicy)):
        raise TypeError(f"draft_length must be a policy name or a DraftLengthPolicy, got {type(draft_length).__name__}")
    policy = make_policy(draft_length, max_draft, weight=None if method == "diversed" else weight,
                         draft_cost=draft_cost)
    if drafter is not None and policy.reads_draft_probs:
        raise ValueError(f"draft_length {policy.name!r} reads the draft model's probabilities, which a callable "
                         "drafter does not give: use 'fixed' or 'heuristic' with drafter=")
    return policy

