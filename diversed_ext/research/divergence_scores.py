"""Each decoded output's divergence to the target, for the harness: the rule's closed-form per-position law
(:mod:`.divergence`) or, for FLy, its Monte Carlo deferral estimate (:mod:`.fly_divergence`), at the positions the
output visited."""

from __future__ import annotations

import math
from typing import Callable, Sequence

from ..decoding.eagle_drafting import is_eagle_head
from ..ops import is_greedy_temperature
from .divergence import RuleLaw, position_divergences, rule_law
from .fly_divergence import fly_divergences, fly_runners

NOT_MEASURED = (math.nan, math.nan)

# (prompt ids, completion ids, prompt index, the draft step of each completion token (.rollouts.draft_steps))
#   -> (mean KL(out || p), mean TV(out, p)) over the completion's positions
Scorer = Callable[[Sequence[int], Sequence[int], int, Sequence[int]], tuple]


def divergence_scorer(target, draft, decoder, score_temperature: float, seed: int = 0,
                      fly_samples: int = 1) -> Scorer:
    """A scorer for ``decoder``'s outputs, p the target at ``score_temperature``: ``ar`` and sd with the exact test
    have law p at the decoding temperature (KL 0 when it is the scoring one; the temperature family's
    KL(p_T' || p_T) otherwise); static, heads, the gate and typical acceptance their closed forms; FLy with a static
    weight (sd's 1 included) its TV from ``fly_samples`` Monte Carlo estimates per position, seeded by ``seed`` + the
    prompt's index (its KL is NaN: not linear in what is estimated). With an EAGLE-3 head for the draft, whose q
    depends on a draft's place in its round, a closed form reads its q at the draft step of each token. NaN, NaN where
    nothing applies: greedy decoding (no law to compare), a callable drafter (no model q), a head with FLy (its weight
    on the branches is not read), and FLy with an EAGLE-3 head (its branches are drafted within the round)."""
    temperature = decoder.temperature
    if is_greedy_temperature(temperature):
        return lambda prompt, completion, index, steps: NOT_MEASURED
    draft_model = None if is_eagle_head(draft) else draft
    law = RuleLaw("exact") if decoder.method == "ar" else rule_law(decoder)
    if law is not None:
        model = None if law.kind == "exact" else draft

        def closed_form(prompt, completion, index, steps):
            return position_divergences(target, model, [prompt], [completion], law, temperature,
                                        score_temperature, [steps])[0]
        return closed_form
    if (decoder.fly is not None and draft_model is not None and decoder.drafter is None and decoder.head is None
            and decoder.gate is None):
        # FLy's TV identity holds against the target it verifies with, at the decoding temperature only.
        if not math.isclose(temperature, score_temperature):
            return lambda prompt, completion, index, steps: NOT_MEASURED
        tokens_only = decoder.draft_mode != "distributions"
        runners = fly_runners(target, draft_model)

        def monte_carlo(prompt, completion, index, steps):
            deferral, tv = fly_divergences(target, draft_model, [prompt], [completion], decoder.fly,
                                           weight=float(decoder.weight), temperature=temperature,
                                           tokens_only=tokens_only, samples=fly_samples, seed=seed + index,
                                           runners=runners)[0]
            return math.nan, tv
        return monte_carlo
    return lambda prompt, completion, index, steps: NOT_MEASURED
