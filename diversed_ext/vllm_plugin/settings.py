"""What a vLLM user configures, and the one place its rules are checked.

Engine (``LLM(..., additional_config={"diversed": {...}})`` or ``vllm serve --additional-config``):

    {"weight": 0.5}                        every request verified against nu = 0.5 p + 0.5 q (the default is 1.0)
    {"head": "smollm2-135m-lambda4"}       a learned head (a shipped name, "default", or a folder) picks w per token
    {"heads": ["a", "path/to/b"], ...}     more heads loaded at start-up, for requests to pick by name
    {"verifier": "vllm"}                   vLLM's own exact rejection sampling, with its CPU constraints repaired
                                           (a control for benchmarks; weights and heads are refused with it)

Request (``SamplingParams(extra_args={...})``, or the OpenAI server's ``vllm_xargs``):

    {"diversed_weight": 0.7}               a static weight in [0, 1] for this request
    {"diversed_head": "a"}                 one of the engine's heads, by the name the engine config gave it

Nothing here imports vLLM: the rules are plain functions, tested without an engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .. import rules

CONFIG_KEY = "diversed"  # the entry of vLLM's additional_config that switches the plugin on
REQUEST_WEIGHT = "diversed_weight"
REQUEST_HEAD = "diversed_head"
REQUEST_KEYS = (REQUEST_WEIGHT, REQUEST_HEAD)
REQUEST_PREFIX = "diversed_"  # extra_args keys with this prefix must be ours: a typo is an error, not ignored
VERIFIERS = ("diversed", "vllm")
ENGINE_KEYS = ("weight", "head", "heads", "verifier")
DEFAULT_WEIGHT = 1.0


class DiversedConfigError(ValueError):
    """The engine's ``additional_config["diversed"]`` entry is malformed."""


@dataclass(frozen=True)
class EngineSettings:
    """The parsed engine entry: the default weight or head, and the heads loaded by name."""

    weight: float = DEFAULT_WEIGHT
    head: Optional[str] = None  # the default head's name (one of head_paths), or None for the static weight
    # The heads to load, each a shipped name, "default" or a folder, as the entry spelled it: requests name them so.
    head_paths: tuple = ()
    verifier: str = "diversed"


@dataclass(frozen=True)
class RequestChoice:
    """What one request asked for: a static weight, a head by name, or neither (the engine default)."""

    weight: Optional[float] = None
    head: Optional[str] = None


def engine_entry(additional_config: Any) -> Optional[Any]:
    """The raw ``"diversed"`` entry of vLLM's additional_config, or None when the plugin was not asked for."""
    if isinstance(additional_config, Mapping):
        return additional_config.get(CONFIG_KEY)
    return None


def weight_value(value: Any, name: str) -> float:
    """``value`` as a weight on the target (:func:`diversed_ext.rules.weight`), its errors as the ValueError vLLM
    turns into a request's error."""
    try:
        return rules.weight(value, name)
    except TypeError as error:
        raise ValueError(str(error)) from None


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
    try:
        weight = weight_value(entry.get("weight", DEFAULT_WEIGHT), f"{prefix}['weight']")
    except ValueError as error:
        raise DiversedConfigError(str(error)) from None
    heads = entry.get("heads", [])
    if isinstance(heads, str) or not isinstance(heads, (list, tuple)):
        raise DiversedConfigError(f"{prefix}['heads'] must be a list of head names or folders, got {heads!r}")
    names = [_head_name(value, f"{prefix}['heads'][{index}]") for index, value in enumerate(heads)]
    head = None
    if "head" in entry:
        head = _head_name(entry["head"], f"{prefix}['head']")
        names.insert(0, head)
    if verifier == "vllm" and ("weight" in entry or names):
        raise DiversedConfigError(f"{prefix}: verifier 'vllm' is exact speculative decoding; it takes no weight "
                                  "or heads")
    return EngineSettings(weight=weight, head=head, head_paths=tuple(dict.fromkeys(names)),
                          verifier=verifier)


def parse_request(extra_args: Optional[Mapping], settings: Optional[EngineSettings]) -> RequestChoice:
    """One request's choice, or a ValueError naming the field: an unknown ``diversed_*`` key, a weight outside
    [0, 1] (or NaN, or not a number), a head the engine did not load, both at once, or either when the engine has no
    diversed entry (``settings`` None)."""
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
    if REQUEST_WEIGHT in extra_args:
        return RequestChoice(weight=weight_value(extra_args[REQUEST_WEIGHT], REQUEST_WEIGHT))
    head = extra_args[REQUEST_HEAD]
    if not isinstance(head, str) or head not in settings.head_paths:
        loaded = sorted(settings.head_paths) or "none"
        raise ValueError(f"{REQUEST_HEAD} must name a head this engine loaded ({loaded}), got {head!r}")
    return RequestChoice(head=head)
