"""The decoding loop with FLy: the settings reach the verifier each round (a window the round cannot fit defers
nothing), a threshold no entropy reaches decodes as without FLy, and FLy keeps more drafts (tiny random Llama pair
from helpers)."""

import math

import pytest
import torch

pytest.importorskip("transformers")

from helpers import PROMPT, sequences  # noqa: E402
from diversed_ext.decoding import Fly, SpeculativeDecoder  # noqa: E402
from diversed_ext.decoding import batch as batch_module  # noqa: E402
from diversed_ext.research.harness import method_specs  # noqa: E402

PROMPTS = [PROMPT, [5], [7, 7, 8, 30, 2, 11], [4, 9, 4, 9, 4]]


def test_fly_with_an_unreachable_threshold_decodes_as_without(wide_pair):
    target, draft = wide_pair
    kwargs = dict(max_draft=4, fast_forward=False)
    plain = SpeculativeDecoder(target, draft, method="static", weight=0.7, **kwargs)
    never = SpeculativeDecoder(target, draft, method="static", weight=0.7, fly=Fly(2, math.inf), **kwargs)
    assert sequences(never.generate(PROMPTS, max_new_tokens=12, seed=3)) == \
        sequences(plain.generate(PROMPTS, max_new_tokens=12, seed=3))


def test_method_fly_keeps_more_drafts_than_sd(wide_pair):
    target, draft = wide_pair
    sd = SpeculativeDecoder(target, draft, method="sd", max_draft=4, fast_forward=False)
    fly = SpeculativeDecoder(target, draft, method="fly", fly=Fly(1, 0.0), max_draft=4, fast_forward=False)
    assert fly.method == "sd" and fly.fly == Fly(1, 0.0)

    def accepted(decoder):
        output = decoder.generate(PROMPTS * 3, max_new_tokens=16, seed=1)
        rounds = [r for generation in output.generations for r in generation.rounds]
        return sum(r.accepted for r in rounds) / max(sum(r.drafted for r in rounds), 1)

    assert accepted(fly) > accepted(sd)


def test_the_window_reaches_the_verifier_only_where_it_fits(wide_pair, monkeypatch):
    target, draft = wide_pair
    seen = []
    verify_logits = batch_module.verify_logits

    def spy(*args, **kwargs):
        seen.append((args[0].shape[1], kwargs.get("fly_window"), kwargs.get("fly_threshold")))
        return verify_logits(*args, **kwargs)

    monkeypatch.setattr(batch_module, "verify_logits", spy)
    decoder = SpeculativeDecoder(target, draft, method="fly", max_draft=4, fast_forward=False, check_inputs=True)
    assert decoder.fly == Fly(3)  # vLLM's default window: min(6, K - 1)
    decoder.generate(PROMPT, max_new_tokens=6, seed=0)
    rounds = [call for call in seen if call[0] > 0]  # calls with K = 0 (a row with nothing drafted) take no FLy
    assert rounds and all(window == (3 if width > 3 else 0) and threshold == 0.3 for width, window, threshold in rounds)


@pytest.mark.parametrize("kwargs,error", [
    (dict(method="fly", fly=Fly(4)), "Fly window must be < max_draft = 4"),
    (dict(method="ar", fly=Fly(1)), "fly applies to methods that draft"),
    (dict(method="sd", fly=2), "fly must be a diversed_ext.decoding.Fly"),
])
def test_bad_fly_settings_raise(wide_pair, kwargs, error):
    target, draft = wide_pair
    with pytest.raises((TypeError, ValueError), match=error):
        SpeculativeDecoder(target, draft, max_draft=4, fast_forward=False, **kwargs)


def test_fly_refuses_a_window_of_zero_or_a_bad_top_k():
    with pytest.raises(ValueError, match="window must be >= 1"):
        Fly(0)
    with pytest.raises(ValueError, match="fly_top_k"):
        Fly(1, top_k=0)


def test_method_specs_put_fly_beside_the_other_methods():
    labels = [label for label, _ in method_specs(["sd", "fly", "static", "static+fly"], [0.5], fly=Fly(2, 0.4))]
    assert labels == ["sd", "fly", "static w=0.5", "static+fly w=0.5"]
    specs = dict(method_specs(["fly", "static+fly"], [0.5], fly=Fly(2, 0.4)))
    assert specs["fly"] == {"method": "fly", "fly": Fly(2, 0.4)}
    assert specs["static+fly w=0.5"] == {"method": "static", "weight": 0.5, "fly": Fly(2, 0.4)}
