"""The rules for the numbers a user gives, each written once: a weight on the target, a temperature, a draft length,
a seed, FLy's window, threshold and top-k, the gate's margin, the grid and floor of a divergence table. The decoding
loop, the head, the command line, the ops and the vLLM plugin's settings all check through here.

Each rule takes the value and the name it travels under, returns it normalised, and raises TypeError for the wrong
kind of value (a bool, a string) and ValueError for one out of range (NaN included), both naming the argument and what
it must be. The command line words its errors with the same descriptions (``WEIGHT``, ``TEMPERATURE``, ...). The
defaults that several floors share are here too: FLy's threshold and top-k, the gate's margin, a divergence table's
grid and floor.

This module imports neither torch nor vLLM, so a server's configuration checks cost nothing to load.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

__all__ = [
    "WEIGHT", "POSITIVE_WEIGHT", "NON_NEGATIVE", "TEMPERATURE", "DRAFT_LENGTH", "SEED", "FLY_WINDOW", "FLY_THRESHOLD",
    "FLY_TOP_K", "GATE_MARGIN", "GRID_POINTS", "LOG_FLOOR",
    "FLY_DEFAULT_THRESHOLD", "FLY_DEFAULT_TOP_K", "FLY_MAX_TOP_K", "GATE_DEFAULT_MARGIN", "SEED_RANGE",
    "DEFAULT_GRID_POINTS", "MAX_GRID_POINTS", "DEFAULT_LOG_FLOOR",
    "weight", "positive_weight", "non_negative", "temperature", "draft_length", "seed", "fly_window", "fly_threshold",
    "fly_top_k", "gate_margin", "grid_points", "log_floor",
]

FLY_DEFAULT_THRESHOLD = 0.3  # vLLM's FLy defaults
FLY_DEFAULT_TOP_K = 3
FLY_MAX_TOP_K = 32  # the most probabilities FLy's entropy sums (csrc/common/fly_math.h keeps them per thread)
# The lossy setting whose task score stays within 2 s.e. of exact sd at K = 3 and 6 on the generated task, with KL
# to the target above the static line (margin 4 keeps more drafts at a larger KL to the target; README.md and
# docs/RESULTS.md)
GATE_DEFAULT_MARGIN = 1.0
# Seeds and offsets are int64 counters of the verifier's Philox generator.
SEED_RANGE = 2**63
# A divergence table's default grid, w = 0, 1/16, ..., 1, and the most weights mixture_divergence tabulates
# (csrc/common/problems.h: a sum each per row)
DEFAULT_GRID_POINTS = 17
MAX_GRID_POINTS = 1025
DEFAULT_LOG_FLOOR = -100.0  # nats: a divergence's floor of log p, so mass on a token the target rules out costs 100

# What each rule accepts, in words (the errors of the rules and of the command line use them).
WEIGHT = "a number in [0, 1]"
POSITIVE_WEIGHT = "a number in (0, 1]"
NON_NEGATIVE = "a finite number >= 0"
TEMPERATURE = NON_NEGATIVE + " (0 = greedy)"
DRAFT_LENGTH = "an int >= 1"
SEED = "an int that fits in 64 bits"
FLY_WINDOW = "an int >= 0 (0 switches FLy off)"
FLY_THRESHOLD = "a number >= 0"
FLY_TOP_K = f"an int in [1, {FLY_MAX_TOP_K}]"
GATE_MARGIN = "a finite number of nats"
GRID_POINTS = f"an int in [2, {MAX_GRID_POINTS}]"
LOG_FLOOR = "a finite number of nats"

def _real(value, name: str, description: str) -> float:
    """``value`` as a float when it is a real number (not a bool, not a string), else TypeError."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be {description}, got {value!r} ({type(value).__name__})")
    return float(value)


def _integer(value, name: str, description: str) -> int:
    """``value`` as an int when it is an integer (not a bool), else TypeError."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be {description}, got {value!r} ({type(value).__name__})")
    return int(value)


def _finite(value, name: str, description: str) -> float:
    """``value`` as a float when it is a finite real number (TypeError / ValueError otherwise)."""
    value = _real(value, name, description)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be {description}, got {value}")
    return value


def weight(value, name: str = "weight") -> float:
    """A weight on the target: a real number in [0, 1] (w = 1 is standard speculative decoding, w = 0 the draft)."""
    if type(value) is float and 0.0 <= value <= 1.0:  # the common case: one type test, one range test
        return value
    value = _real(value, name, WEIGHT)
    if not 0.0 <= value <= 1.0:  # also refuses NaN
        raise ValueError(f"{name} must be {WEIGHT}, got {value}")
    return value


def positive_weight(value, name: str = "init_weight") -> float:
    """A weight in (0, 1]: what an untrained head may return everywhere (its logit must be finite)."""
    value = _real(value, name, POSITIVE_WEIGHT)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be {POSITIVE_WEIGHT}, got {value}")
    return value


def non_negative(value, name: str, description: str = NON_NEGATIVE) -> float:
    """A finite real number >= 0 (a cost, a coefficient); ``description`` words the error."""
    if type(value) is float and 0.0 <= value < math.inf:  # the common case; NaN fails it too
        return value
    value = _real(value, name, description)
    if not 0.0 <= value < math.inf:
        raise ValueError(f"{name} must be {description}, got {value}")
    return value


def temperature(value, name: str = "temperature") -> float:
    """A sampling temperature: a finite real number >= 0; 0 asks for greedy decisions."""
    return non_negative(value, name, TEMPERATURE)


def draft_length(value, name: str = "max_draft") -> int:
    """The most tokens drafted a round (K): an int >= 1."""
    value = _integer(value, name, DRAFT_LENGTH)
    if value < 1:
        raise ValueError(f"{name} (K) must be >= 1, got {value}")
    return value


def fly_window(value, name: str = "fly_window") -> int:
    """FLy's window W: how many following drafts must pass the exact test for a rejected draft to be kept."""
    if type(value) is int and value >= 0:
        return value
    value = _integer(value, name, FLY_WINDOW)
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (0 switches FLy off), got {value}")
    return value


def fly_threshold(value, name: str = "fly_threshold") -> float:
    """FLy's entropy threshold tau: a rejected draft is kept only where the target's top-k entropy is at least it
    (infinity: never)."""
    if type(value) is float and value >= 0.0:  # NaN fails the comparison
        return value
    value = _real(value, name, FLY_THRESHOLD)
    if math.isnan(value) or value < 0.0:
        raise ValueError(f"{name} must be >= 0 and not NaN, got {value}")
    return value


def fly_top_k(value, name: str = "fly_top_k") -> int:
    """How many of the target's largest probabilities FLy's entropy sums."""
    value = _integer(value, name, FLY_TOP_K)
    if not 1 <= value <= FLY_MAX_TOP_K:
        raise ValueError(f"{name} must lie in [1, {FLY_MAX_TOP_K}], got {value}")
    return value


def gate_margin(value, name: str = "margin") -> float:
    """The log-probability gate's margin: a finite real number of nats (negative keeps fewer drafts than none)."""
    return _finite(value, name, GATE_MARGIN)


def grid_points(value, name: str = "grid_points") -> int:
    """How many evenly spaced weights w = 0 .. 1 a divergence table holds (both ends included)."""
    value = _integer(value, name, GRID_POINTS)
    if not 2 <= value <= MAX_GRID_POINTS:
        raise ValueError(f"{name} must lie in [2, {MAX_GRID_POINTS}], got {value}")
    return value


def log_floor(value, name: str = "log_floor") -> float:
    """The floor of a log-probability in a divergence: a finite real number of nats."""
    return _finite(value, name, LOG_FLOOR)


def seed(value, name: str = "seed") -> int:
    """A seed: an int that fits in 64 bits, signed or unsigned, as the signed int64 the verifier's generator takes
    (values in [2**63, 2**64) wrap to negative, so unsigned 64-bit seeds work too)."""
    if type(value) is int and -SEED_RANGE <= value < SEED_RANGE:  # the common case, without the abstract Integral
        return value
    value = _integer(value, name, SEED)
    if not -SEED_RANGE <= value < 2 * SEED_RANGE:
        raise ValueError(f"{name} must be {SEED}, got {value}")
    return value - 2 * SEED_RANGE if value >= SEED_RANGE else value
