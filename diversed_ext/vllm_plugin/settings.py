"""What a vLLM user configures, and the one place its rules are checked.

Engine (``LLM(..., additional_config={"diversed": {...}})`` or ``vllm serve --additional-config``):

    {"weight": 0.5}                        every request verified against nu = 0.5 p + 0.5 q (the default is 1.0)
    {"head": "smollm2-135m-lambda4"}       a learned head (a shipped name, "default", or a folder) picks w per token
                                           ("default" in an eagle3 engine: the head trained on EAGLE-3 states)
    {"heads": ["a", "path/to/b"], ...}     more heads loaded at start-up, for requests to pick by name
    {"fly": {"window": 2, "threshold": 0.3, "top_k": 3}}
                                           FLy's deferral on top of the weight (lossy): a draft the test rejects is
                                           kept when the next `window` drafts pass and the target's top-k entropy
                                           is at least `threshold` (vLLM 0.33.0's rejection_sample_method "fly"
                                           sets the same from its own fields)
    {"gate_margin": 4.0}                   the log-probability gate on top of the weight (lossy): a draft is kept
                                           outright when its target log-probability is within the margin of a
                                           rejection's expected one; sampled requests only (greedy ones are not gated)
    {"verifier": "vllm"}                   vLLM's own exact rejection sampling, with its CPU constraints repaired
                                           (a control for benchmarks; weights, heads, FLy and the gate are refused)

Request (``SamplingParams(extra_args={...})``, or the OpenAI server's ``vllm_xargs``):

    {"diversed_weight": 0.7}               a static weight in [0, 1] for this request
    {"diversed_head": "a"}                 one of the engine's heads, by the name the engine config gave it
    {"diversed_fly_window": 1,             this request's FLy window (0: off; below num_speculative_tokens) and
     "diversed_fly_threshold": 0.6}        threshold, beside a weight or head
    {"diversed_gate_margin": 1.0}          this request's gate margin (the gate on for it), beside a weight or head

Nothing here imports vLLM: the rules are plain functions, tested without an engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .. import rules

CONFIG_KEY = "diversed"  # the entry of vLLM's additional_config that switches the plugin on
REQUEST_WEIGHT = "diversed_weight"
REQUEST_HEAD = "diversed_head"
REQUEST_FLY_WINDOW = "diversed_fly_window"
REQUEST_FLY_THRESHOLD = "diversed_fly_threshold"
REQUEST_GATE_MARGIN = "diversed_gate_margin"
REQUEST_KEYS = (REQUEST_WEIGHT, REQUEST_HEAD, REQUEST_FLY_WINDOW, REQUEST_FLY_THRESHOLD, REQUEST_GATE_MARGIN)
REQUEST_PREFIX = "diversed_"  # extra_args keys with this prefix must be ours: a typo is an error, not ignored
VERIFIERS = ("diversed", "vllm")
ENGINE_KEYS = ("weight", "head", "heads", "verifier", "fly", "gate_margin")
FLY_KEYS = ("window", "threshold", "top_k")
DEFAULT_WEIGHT = 1.0


class DiversedConfigError(ValueError):
    """The engine's ``additional_config["diversed"]`` entry is malformed."""


@dataclass(frozen=True)
class FlySettings:
    """FLy's deferral: off with a window of 0 (vLLM's defaults otherwise: threshold 0.3 over the top 3)."""

    window: int = 0
    threshold: float = rules.FLY_DEFAULT_THRESHOLD
    top_k: int = rules.FLY_DEFAULT_TOP_K


@dataclass(frozen=True)
class EngineSettings:
    """The parsed engine entry: the default weight or head, and the heads loaded by name."""

    weight: float = DEFAULT_WEIGHT
    head: Optional[str] = None  # the default head's name (one of head_paths), or None for the static weight
    # The heads to load, each a shipped name, "default" or a folder, as the entry spelled it: requests name them so.
    head_paths: tuple = ()
    verifier: str = "diversed"
    fly: FlySettings = FlySettings()
    gate_margin: Optional[float] = None  # the gate's margin for every request that gives none; None: no gate
    # K, the engine's num_speculative_tokens (None: not known, e.g. no speculative_config): FLy windows stay below it
    num_speculative_tokens: Optional[int] = None


@dataclass(frozen=True)
class RequestChoice:
    """What one request asked for: a static weight, a head by name, or neither (the engine default)."""

    weight: Optional[float] = None
    head: Optional[str] = None
    fly_window: Optional[int] = None  # None: the engine's
    fly_threshold: Optional[float] = None
    gate_margin: Optional[float] = None


@dataclass(frozen=True)
class RequestSettings:
    """What a request is verified with once its choice meets the engine's defaults."""

    weight: float  # the static weight, used for the whole request unless ``head`` names one
    head: Optional[str]
    fly_window: int
    fly_threshold: float
    gate_margin: Optional[float] = None  # None: not gated


def request_settings(choice: RequestChoice, settings: EngineSettings) -> RequestSettings:
    """A request's ``diversed_weight`` wins, then its ``diversed_head``, then the engine's default (its head, else its
    weight); its FLy window and threshold and its gate margin default to the engine's."""
    return RequestSettings(
        weight=settings.weight if choice.weight is None else choice.weight,
        head=None if choice.weight is not None else (choice.head or settings.head),
        fly_window=settings.fly.window if choice.fly_window is None else choice.fly_window,
        fly_threshold=settings.fly.threshold if choice.fly_threshold is None else choice.fly_threshold,
        gate_margin=settings.gate_margin if choice.gate_margin is None else choice.gate_margin)


def engine_entry(additional_config: Any) -> Optional[Any]:
    """The raw ``"diversed"`` entry of vLLM's additional_config, or None when the plugin was not asked for."""
    if isinstance(additional_config, Mapping):
        return additional_config.get(CONFIG_KEY)
    return None


def weight_value(value: Any, name: str) -> float:
    """``value`` as a weight on the target (:func:`diversed_ext.rules.weight`), its errors as the ValueError vLLM
    turns into a request's error."""
    return _as_value_error(rules.weight, value, name)


def _as_value_error(rule, value: Any, name: str):
    """A rule's verdict with its TypeError as the ValueError vLLM turns into a request's error."""
    try:
        return rule(value, name)
    except TypeError as error:
        raise ValueError(str(error)) from None


def parse_fly(entry: Any, prefix: str) -> FlySettings:
    """The engine's ``"fly"`` entry: a mapping of window (>= 0), threshold (>= 0) and top_k (1..32)."""
    if not isinstance(entry, Mapping):
        raise DiversedConfigError(f"{prefix} must be a mapping such as {{'window': 2, 'threshold': 0.3}}, "
                                  f"got {entry!r}")
    unknown = sorted(set(entry) - set(FLY_KEYS))
    if unknown:
        raise DiversedConfigError(f"{prefix} has unknown keys {unknown}; known: {list(FLY_KEYS)}")
    defaults = FlySettings()
    return FlySettings(
        window=_engine_value(rules.fly_window, entry.get("window", defaults.window), f"{prefix}['window']"),
        threshold=_engine_value(rules.fly_threshold, entry.get("threshold", defaults.threshold),
                                f"{prefix}['threshold']"),
        top_k=_engine_value(rules.fly_top_k, entry.get("top_k", defaults.top_k), f"{prefix}['top_k']"))


def fly_window_below(window: int, num_positions: Optional[int], name: str) -> None:
    """A FLy window must be below K (``num_positions``; None: not known): the drafts after a deferred one must fit in
    the step. A ValueError naming ``name`` otherwise; a window of 0 (FLy off) always passes."""
    if window and num_positions is not None and window >= num_positions:
        raise ValueError(f"{name} {window} must be below num_speculative_tokens {num_positions} (the drafts after a "
                         "deferred one must fit in the step), or 0 to switch FLy off")


def _engine_value(rule, value: Any, name: str):
    """A rule's verdict on a value of the engine entry, its errors as the DiversedConfigError start-up reports."""
    try:
        return _as_value_error(rule, value, name)
    except ValueError as error:
        raise DiversedConfigError(str(error)) from None


def _head_name(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise DiversedConfigError(f"{name} must be a head's name or folder (a non-empty string), got {value!r}")
    return value


def parse_engine_entry(entry: Any) -> EngineSettings:
    """The engine entry checked: a mapping of known keys, a weight in [0, 1] or a head, heads as a list of names."""
    prefix = f"additional_config[{CONFIG_KEY!r}]"
    if entry is None:
        entry = {}
    if not isinstance(entry, Mapping):
        raise DiversedConfigError(f"{prefix} must be a mapping such as {{'weight': 0.5}}, got {entry!r}")
    unknown = sorted(set(entry) - set(ENGINE_KEYS))
    if unknown:
        raise DiversedConfigError(f"{prefix} has unknown keys {unknown}; known: {list(ENGINE_KEYS)}")
    verifier = entry.get("verifier", "diversed")
    if verifier not in VERIFIERS:
        raise DiversedConfigError(f"{prefix}['verifier'] must be one of {list(VERIFIERS)}, got {verifier!r}")
    if "weight" in entry and "head" in entry:
        raise DiversedConfigError(f"{prefix}: give 'weight' or 'head' as the default, not both")
    weight = _engine_value(rules.weight, entry.get("weight", DEFAULT_WEIGHT), f"{prefix}['weight']")
    heads = entry.get("heads", [])
    if isinstance(heads, str) or not isinstance(heads, (list, tuple)):
        raise DiversedConfigError(f"{prefix}['heads'] must be a list of head names or folders, got {heads!r}")
    names = [_head_name(value, f"{prefix}['heads'][{index}]") for index, value in enumerate(heads)]
    head = None
    if "head" in entry:
        head = _head_name(entry["head"], f"{prefix}['head']")
        names.insert(0, head)
    if verifier == "vllm" and ("weight" in entry or names or "fly" in entry or "gate_margin" in entry):
        raise DiversedConfigError(f"{prefix}: verifier 'vllm' is exact speculative decoding; it takes no weight "
                                  "or heads, nor FLy or the gate")
    fly = parse_fly(entry["fly"], f"{prefix}['fly']") if "fly" in entry else FlySettings()
    gate_margin = (_engine_value(rules.gate_margin, entry["gate_margin"], f"{prefix}['gate_margin']")
                   if "gate_margin" in entry else None)
    return EngineSettings(weight=weight, head=head, head_paths=tuple(dict.fromkeys(names)),
                          verifier=verifier, fly=fly, gate_margin=gate_margin)


def parse_request(extra_args: Optional[Mapping], settings: Optional[EngineSettings]) -> RequestChoice:
    """One request's choice, or a ValueError naming the field: an unknown ``diversed_*`` key, a weight outside
    [0, 1] (or NaN, or not a number), a head the engine did not load, both at once, a FLy window or threshold or a
    gate margin outside its rule (a window not below the engine's K among them), or any of them when the engine has
    no diversed entry (``settings`` None)."""
    if not extra_args:
        return RequestChoice()
    ours = [key for key in extra_args if isinstance(key, str) and key.startswith(REQUEST_PREFIX)]
    if not ours:
        return RequestChoice()
    unknown = sorted(set(ours) - set(REQUEST_KEYS))
    if unknown:
        raise ValueError(f"unknown request field {unknown[0]!r}; DIVERSED takes {list(REQUEST_KEYS)}")
    if settings is None:
        raise ValueError(f"{ours[0]} was given but this engine has no additional_config[{CONFIG_KEY!r}] entry")
    if settings.verifier != "diversed":
        raise ValueError(f"{ours[0]} was given but this engine verifies exactly (verifier {settings.verifier!r})")
    if REQUEST_WEIGHT in extra_args and REQUEST_HEAD in extra_args:
        raise ValueError(f"give {REQUEST_WEIGHT} or {REQUEST_HEAD}, not both")
    beside = {}  # FLy and the gate go with a weight, a head or the default
    if REQUEST_FLY_WINDOW in extra_args:
        beside["fly_window"] = _as_value_error(rules.fly_window, extra_args[REQUEST_FLY_WINDOW], REQUEST_FLY_WINDOW)
        fly_window_below(beside["fly_window"], settings.num_speculative_tokens, REQUEST_FLY_WINDOW)
    if REQUEST_FLY_THRESHOLD in extra_args:
        beside["fly_threshold"] = _as_value_error(rules.fly_threshold, extra_args[REQUEST_FLY_THRESHOLD],
                                                  REQUEST_FLY_THRESHOLD)
    if REQUEST_GATE_MARGIN in extra_args:
        beside["gate_margin"] = _as_value_error(rules.gate_margin, extra_args[REQUEST_GATE_MARGIN],
                                                REQUEST_GATE_MARGIN)
    if REQUEST_WEIGHT in extra_args:
        return RequestChoice(weight=weight_value(extra_args[REQUEST_WEIGHT], REQUEST_WEIGHT), **beside)
    if REQUEST_HEAD not in extra_args:
        return RequestChoice(**beside)
    head = extra_args[REQUEST_HEAD]
    if not isinstance(head, str) or head not in settings.head_paths:
        loaded = sorted(settings.head_paths) or "none"
        raise ValueError(f"{REQUEST_HEAD} must name a head this engine loaded ({loaded}), got {head!r}")
    return RequestChoice(head=head, **beside)
