"""What an engine that asks for DIVERSED must be, checked before it starts: never a silent exact fallback.

An engine with an ``additional_config["diversed"]`` entry starts only if every drafted token will be verified by
diversed_ext as asked. Refused, each with what to change:

- a vLLM whose hooked code differs from every release the plugin was tested with (:mod:`.seams`), naming the
  function;
- no speculative decoding, or a speculative method whose drafts DIVERSED cannot verify as asked on the engine's model
  runner (:func:`.drafters.drafter_problems`: a method it does not know, one vLLM runs on the other runner only, or
  learned heads with a drafter that has no hidden states);
- an acceptance rule of vLLM's other than the standard one and FLy (``rejection_sample_method`` "synthetic" or
  "block"), adaptive verification (V2 compacts the logits it verifies) or watermarking: each replaces the rule the
  plugin replaces (vLLM's FLy becomes the ops' FLy, on top of the weights);
- parallel drafting, and a draft whose distributions cover another vocabulary than the target's where learned heads
  or probabilistic drafts would read them (:func:`draft_layout_problems`);
- a FLy window not below the number of drafted tokens (a request's own window is refused the same way, as that
  request's error: :func:`.settings.parse_request`);
- a head folder that does not exist.

The workers check the rest once their runner is built (:func:`require_hooked`): a runner whose rejection sampler is
not the plugin's (a model with its own sampler, a runner the plugin does not hook) refuses to start.
"""

from __future__ import annotations

import os

from dataclasses import replace

from .drafters import drafter_problems, variant_problems
from .settings import CONFIG_KEY, EngineSettings, engine_entry, fly_window_below, parse_engine_entry, parse_fly

STANDARD_ACCEPTANCE = "standard"
FLY_ACCEPTANCE = "fly"  # vLLM 0.33.0's FLy: the plugin verifies with the ops' FLy, composed with the weights
NEEDS_SPECULATION = (f"additional_config[{CONFIG_KEY!r}] needs speculative decoding: pass a speculative_config "
                     "(a draft model, EAGLE, EAGLE-3, MTP or n-gram drafts)")


class DiversedStartupError(RuntimeError):
    """DIVERSED was asked for but this engine would not verify with it (vLLM's code, configuration, heads)."""


def engine_settings(vllm_config) -> EngineSettings | None:
    """The engine's parsed settings, or None without a ``"diversed"`` entry (the plugin then stays out). vLLM's own
    FLy (``rejection_sample_method="fly"``, vLLM 0.33.0) becomes the plugin's FLy when the entry has none."""
    additional = getattr(vllm_config, "additional_config", None)
    if not isinstance(additional, dict) or CONFIG_KEY not in additional:
        return None
    settings = parse_engine_entry(engine_entry(additional))
    spec = getattr(vllm_config, "speculative_config", None)
    if getattr(spec, "rejection_sample_method", None) == FLY_ACCEPTANCE and settings.fly.window == 0:
        entry = {"window": spec.fly_window_size, "threshold": spec.fly_entropy_threshold,
                 "top_k": spec.fly_entropy_top_k}
        settings = replace(settings, fly=parse_fly(entry, "speculative_config's FLy"))
    num_positions = getattr(spec, "num_speculative_tokens", None)
    return settings if num_positions is None else replace(settings, num_speculative_tokens=num_positions)


def require_tested_vllm() -> None:
    """Refuse a vLLM whose hooked functions are not code the plugin was tested with."""
    from .seams import seam_problems

    problems = seam_problems()
    if problems:
        raise DiversedStartupError(
            f"DIVERSED was asked for (additional_config[{CONFIG_KEY!r}]) but this vLLM's code differs from every "
            "release the plugin was tested with: " + "; ".join(problems)
            + ". Install a tested vLLM (see the README) or run without the diversed entry.")


def uses_v2_runner(vllm_config) -> bool:
    """Whether vLLM will build this engine's workers on its V2 model runner (vLLM decides it from the configuration,
    the environment and whether Triton is there; older configurations without the property run V1)."""
    return bool(getattr(vllm_config, "use_v2_model_runner", False))


def speculation_problems(vllm_config, heads: bool = False) -> list:
    """Why this engine's speculative decoding would not be verified by the plugin (empty when it would); ``heads``:
    the engine loads learned heads."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return [NEEDS_SPECULATION]
    v2 = uses_v2_runner(vllm_config)
    problems = drafter_problems(getattr(spec, "method", None), v2=v2, heads=heads)
    problems += variant_problems(spec, v2=v2, heads=heads)
    acceptance = getattr(spec, "rejection_sample_method", STANDARD_ACCEPTANCE)
    if acceptance not in (STANDARD_ACCEPTANCE, FLY_ACCEPTANCE):
        problems.append(f"rejection_sample_method {acceptance!r} replaces the acceptance rule DIVERSED replaces; "
                        f"use {STANDARD_ACCEPTANCE!r} or {FLY_ACCEPTANCE!r}")
    if getattr(spec, "enable_adaptive_verification", False):
        problems.append("enable_adaptive_verification compacts the rows DIVERSED verifies; switch it off")
    if getattr(vllm_config, "watermark_config", None) is not None:
        problems.append("watermarking samples with its own rule; DIVERSED cannot verify a watermarked engine")
    return problems + draft_layout_problems(vllm_config, heads)


def draft_layout_problems(vllm_config, heads: bool) -> list:
    """Drafts the plugin would read wrongly mid-step rather than refuse: parallel drafting (all K drafts from one
    pass, whose hidden states and distributions are not laid out one draft step per position), and a draft model with
    its own vocabulary (vLLM's ``use_heterogeneous_vocab``) where the plugin would read its distributions (learned
    heads, or probabilistic drafts); its token-only drafts are target ids (vLLM maps them) and verify as tokens."""
    spec = vllm_config.speculative_config
    problems = []
    if getattr(spec, "parallel_drafting", False):
        problems.append("speculative_config parallel_drafting=True drafts all positions in one pass, which DIVERSED "
                        "does not read position by position; set parallel_drafting to False")
    draft, target = getattr(spec, "draft_model_config", None), getattr(vllm_config, "model_config", None)
    if draft is None or target is None:
        return problems
    # The rows the plugin reads have the draft config's vocab_size columns: an EAGLE-3 head with a reduced draft
    # vocabulary (draft_vocab_size, d2t) hands over target-vocabulary rows, -inf outside its own ids.
    draft_vocabulary = draft.get_vocab_size()
    target_vocabulary = target.get_vocab_size()
    probabilistic = getattr(spec, "draft_sample_method", None) == "probabilistic"
    if draft_vocabulary != target_vocabulary and (heads or probabilistic):
        setting = "learned heads (their features compare q and p token by token)" if heads else \
            "draft_sample_method 'probabilistic' (q and p must be distributions over the same ids)"
        problems.append(f"the draft model's vocabulary ({draft_vocabulary} tokens"
                        f"{', use_heterogeneous_vocab' if getattr(spec, 'use_heterogeneous_vocab', False) else ''}) "
                        f"differs from the target's ({target_vocabulary}), which {setting} cannot take: use a draft "
                        "with the target's vocabulary, or greedy drafts and a static weight")
    return problems


def check_engine(vllm_config) -> EngineSettings | None:
    """Before any engine process starts: the entry's rules, vLLM's code, the speculative configuration, and every
    head's folder (loading them is the workers' job). Returns the settings, or None without a diversed entry."""
    from ..head import CONFIG_NAME, resolve_head_path

    settings = engine_settings(vllm_config)
    if settings is None:
        return None
    require_tested_vllm()
    problems = speculation_problems(vllm_config, heads=bool(settings.head_paths))
    try:
        fly_window_below(settings.fly.window, settings.num_speculative_tokens, "FLy's window")
    except ValueError as error:
        problems.append(str(error))
    if problems:
        raise DiversedStartupError("DIVERSED was asked for but " + "; ".join(problems))
    for name in settings.head_paths:
        if not os.path.isfile(os.path.join(resolve_head_path(name), CONFIG_NAME)):
            raise DiversedStartupError(f"head {name!r}: no {CONFIG_NAME} at {resolve_head_path(name)!r} (give a "
                                       "shipped head's name, 'default', or a folder written by diversed train)")
    return settings


def require_hooked(runner, settings: EngineSettings) -> None:
    """In a worker whose runner is built: refuse to start unless the runner verifies with the plugin (a pipeline
    stage that does not sample has no rejection sampler and nothing to verify)."""
    sampler = getattr(runner, "rejection_sampler", None)
    if sampler is None:
        return
    if not getattr(sampler, "diversed_verifier", None):
        raise DiversedStartupError(
            f"DIVERSED was asked for but this worker's model runner ({type(runner).__module__}."
            f"{type(runner).__name__}) verifies with {type(sampler).__module__}.{type(sampler).__name__}, which the "
            "plugin does not replace: use vLLM's V1 or V2 GPU/CPU model runner without a model-specific sampler")
