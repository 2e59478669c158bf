"""The DIVERSED ensemble head: a per-token weight on the target, predicted from both models' last hidden states and,
optionally, a few numbers describing the two next-token distributions.

    w_t = sigmoid(head([LayerNorm(h_draft_t) ; LayerNorm(h_target_t) ; f_t]))

f_t (:func:`distribution_features`) holds, for the position t, the entropies of q_t and p_t (over log V), their largest
probabilities and TV(p_t, q_t): all in [0, 1], read by one fused native op from logits the loop computes anyway. They
depend on the context only, never on the drafted token: the verifier's guarantee that tokens follow
nu_t = w_t p_t + (1 - w_t) q_t needs w_t fixed before the draft is seen, so a feature such as q_t(x) of the drafted x
is not offered.

The output layer starts at zero with bias logit(init_weight), so an untrained head returns exactly ``init_weight``
everywhere (0.5 is the midpoint of the static ensembles; 1.0 would be standard speculative decoding). Heads are saved
as ``head.safetensors`` plus ``head.json`` (sizes, init weight, the names of the model pair they were trained for and
the ``diversed train`` options that produced them), and loading one against another pair or other hidden sizes is an
error. A server imports this module to run a head: it needs the ops' distribution features and nothing of the models
or the lean forward.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import torch
from torch import nn

from . import rules
from ._atomic import atomic_path
from .ops import DISTRIBUTION_FEATURES, PROB_DTYPES
from .ops import distribution_features as ops_distribution_features

__all__ = [
    "EnsembleHead", "HeadConfig", "load_head", "head_recipe", "shipped_heads", "resolve_head_path", "hidden_size",
    "distribution_features", "wants_distributions", "HEAD_INPUTS", "CONFIG_NAME", "WEIGHTS_NAME", "SHIPPED_HEADS_DIR",
    "DEFAULT_HEAD_NAME", "DEFAULT_HEAD_DIR", "DEFAULT_EAGLE3_HEAD_NAME",
]

CONFIG_NAME = "head.json"
WEIGHTS_NAME = "head.safetensors"
FORMAT_NAME = "diversed_ext.EnsembleHead"
FORMAT_VERSION = 1
WEIGHT_EPSILON = 1e-6  # init_weight is kept inside (0, 1) so its logit is finite
# What a head reads, by the name the train command takes: (features, use_hidden).
HEAD_INPUTS = {"hidden": ((), True), "distributions": (DISTRIBUTION_FEATURES, False),
               "both": (DISTRIBUTION_FEATURES, True)}


def distribution_features(draft_logits: torch.Tensor, target_logits: torch.Tensor,
                          temperature: float = 1.0) -> torch.Tensor:
    """The :data:`~diversed_ext.DISTRIBUTION_FEATURES` of every position, for logits of any leading shape: [..., V]
    logits (the same shape) -> float32 [..., 5], each in [0, 1], by the fused op
    :func:`diversed_ext.distribution_features` at a scalar temperature (0, greedy, counts as 1). The values are not
    checked on the host, so a server's decoding step never waits on the device for them; a row without a finite logit
    has entropy 0 and largest probability 0."""
    if draft_logits.shape != target_logits.shape:
        raise ValueError(f"draft_logits {tuple(draft_logits.shape)} and target_logits {tuple(target_logits.shape)} "
                         "must have the same shape")
    # each read as it lies when the op takes it (float32, bfloat16, float16, mixed or not)
    if draft_logits.dtype not in PROB_DTYPES:
        draft_logits = draft_logits.float()
    if target_logits.dtype not in PROB_DTYPES:
        target_logits = target_logits.float()
    vocab = target_logits.shape[-1]
    features = ops_distribution_features(draft_logits.reshape(1, -1, vocab), target_logits.reshape(1, -1, vocab),
                                         temperature=temperature, check_inputs=False)
    return features.reshape(*target_logits.shape[:-1], len(DISTRIBUTION_FEATURES))


def wants_distributions(head) -> bool:
    """Whether ``head`` (an :class:`EnsembleHead` or any callable) takes the :func:`distribution_features` of each
    position as its third input; a plain callable takes the two hidden states only."""
    return bool(getattr(head, "wants_distributions", False))


@dataclass
class HeadConfig:
    """What a saved head needs to be rebuilt and checked against a model pair."""

    draft_hidden: int
    target_hidden: int
    hidden: Optional[int] = None
    init_weight: float = 0.5
    pair: dict = field(default_factory=dict)  # {"target": name, "draft": name}; empty when unknown
    features: list = field(default_factory=list)  # names from DISTRIBUTION_FEATURES; empty: hidden states only
    use_hidden: bool = True  # False: the distribution features alone
    # The ``diversed train`` options that produced the head, by name (``diversed train --recipe`` reruns them); empty
    # for a head built by hand.
    recipe: dict = field(default_factory=dict)


class EnsembleHead(nn.Module):
    """Maps (draft hidden state, target hidden state) to the weight w in (0, 1) on the target.

    Args:
        draft_hidden: hidden size of the draft model.
        target_hidden: hidden size of the target model.
        hidden: width of one hidden layer (GELU); None for a linear head.
        init_weight: the weight every token gets before training, in (0, 1].
        pair: optional {"target": name, "draft": name}, recorded when saving and checked when loading.
        features: names from :data:`DISTRIBUTION_FEATURES` the head also reads (default none).
        use_hidden: read the hidden states (default); False needs ``features``.
        recipe: the training options that produce this head, recorded in head.json.
    """

    def __init__(self, draft_hidden: int, target_hidden: int, *, hidden: Optional[int] = None,
                 init_weight: float = 0.5, pair: Optional[dict] = None, features: Sequence[str] = (),
                 use_hidden: bool = True, recipe: Optional[dict] = None):
        super().__init__()
        for name, value in (("draft_hidden", draft_hidden), ("target_hidden", target_hidden)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if hidden is not None and (isinstance(hidden, bool) or not isinstance(hidden, int) or hidden <= 0):
            raise ValueError(f"hidden must be None or a positive int, got {hidden!r}")
        init_weight = rules.positive_weight(init_weight, "init_weight")
        features = _check_features(features, use_hidden)
        self.config = HeadConfig(draft_hidden, target_hidden, hidden, init_weight, dict(pair or {}),
                                 list(features), bool(use_hidden), dict(recipe or {}))
        self.register_buffer("feature_index", torch.tensor([DISTRIBUTION_FEATURES.index(name) for name in features],
                                                           dtype=torch.int64), persistent=False)
        if use_hidden:
            self.draft_norm = nn.LayerNorm(draft_hidden)
            self.target_norm = nn.LayerNorm(target_hidden)
        features = (draft_hidden + target_hidden if use_hidden else 0) + len(features)
        layers: list[nn.Module] = []
        if hidden is not None:
            layers += [nn.Linear(features, hidden), nn.GELU()]
            features = hidden
        self.body = nn.Sequential(*layers)
        self.output = nn.Linear(features, 1)
        self.reset_output(init_weight)

    def reset_output(self, init_weight: float) -> None:
        """Zero the output layer and set its bias so that every token gets ``init_weight``."""
        clipped = min(max(float(init_weight), WEIGHT_EPSILON), 1.0 - WEIGHT_EPSILON)
        with torch.no_grad():
            self.output.weight.zero_()
            self.output.bias.fill_(math.log(clipped / (1.0 - clipped)))

    @property
    def wants_distributions(self) -> bool:
        """Whether :meth:`forward` needs the :func:`distribution_features` of each position."""
        return bool(self.config.features)

    def forward(self, draft_hidden_states: torch.Tensor, target_hidden_states: torch.Tensor,
                distributions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Weights on the target, shape ``draft_hidden_states.shape[:-1]``, in (0, 1). ``distributions`` [..., 5]
        (:func:`distribution_features`) is required when the head reads features, and ignored otherwise."""
        if draft_hidden_states.shape[-1] != self.config.draft_hidden:
            raise ValueError(f"draft_hidden_states has hidden size {draft_hidden_states.shape[-1]}, the head expects "
                             f"{self.config.draft_hidden}")
        if target_hidden_states.shape[-1] != self.config.target_hidden:
            raise ValueError(f"target_hidden_states has hidden size {target_hidden_states.shape[-1]}, the head "
                             f"expects {self.config.target_hidden}")
        if draft_hidden_states.shape[:-1] != target_hidden_states.shape[:-1]:
            raise ValueError(f"draft_hidden_states {tuple(draft_hidden_states.shape)} and target_hidden_states "
                             f"{tuple(target_hidden_states.shape)} must agree on every dimension but the last")
        dtype = self.output.weight.dtype
        inputs = []
        if self.config.use_hidden:
            inputs += [self.draft_norm(draft_hidden_states.to(dtype)), self.target_norm(target_hidden_states.to(dtype))]
        if self.config.features:
            expected = (*draft_hidden_states.shape[:-1], len(DISTRIBUTION_FEATURES))
            if distributions is None or tuple(distributions.shape) != expected:
                got = "none" if distributions is None else f"shape {tuple(distributions.shape)}"
                raise ValueError(f"this head reads distribution features: distributions must have shape {expected} "
                                 f"(distribution_features of both models' logits), got {got}")
            inputs.append(distributions.to(device=self.feature_index.device, dtype=dtype)[..., self.feature_index])
        return torch.sigmoid(self.output(self.body(torch.cat(inputs, dim=-1)))).squeeze(-1)

    # ------------------------------------------------------------------------------------------------ persistence
    def save(self, directory: str) -> None:
        """Write head.safetensors and head.json into ``directory`` (created if needed), atomically per file."""
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in self.state_dict().items()}
        weights_path = os.path.join(directory, WEIGHTS_NAME)
        with atomic_path(weights_path) as staging:
            save_file(tensors, staging)
        config = {"format": FORMAT_NAME, "version": FORMAT_VERSION, **asdict(self.config)}
        with atomic_path(os.path.join(directory, CONFIG_NAME)) as staging, open(staging, "w") as handle:
            json.dump(config, handle, indent=2)

    @classmethod
    def load(cls, directory: str, *, pair: Optional[dict] = None, draft_hidden: Optional[int] = None,
             target_hidden: Optional[int] = None, map_location: str = "cpu") -> "EnsembleHead":
        """Load a saved head, checking it against the model pair and hidden sizes it is about to serve.

        Args:
            directory: folder written by :meth:`save`.
            pair: {"target": name, "draft": name} of the models in use; a head saved for another pair is refused.
            draft_hidden / target_hidden: hidden sizes of the models in use; a mismatch is refused.
            map_location: the device the returned head lives on.
        """
        config_path = os.path.join(directory, CONFIG_NAME)
        weights_path = os.path.join(directory, WEIGHTS_NAME)
        for path in (config_path, weights_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no ensemble head at {directory!r}: missing {os.path.basename(path)}")
        config = _read_config(config_path)
        _check_matches(config, pair, draft_hidden, target_hidden, directory)
        head = cls(config.draft_hidden, config.target_hidden, hidden=config.hidden, init_weight=config.init_weight,
                   pair=config.pair, features=config.features, use_hidden=config.use_hidden, recipe=config.recipe)
        head.load_state_dict(_read_weights(weights_path, head))
        return head.to(map_location)


def _read_config(path: str) -> HeadConfig:
    """The config in head.json, or a ValueError naming the file and what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as handle:
            stored = json.load(handle)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(stored, dict):
        raise ValueError(f"{path} must hold a JSON object, not a {type(stored).__name__}")
    if stored.get("format") != FORMAT_NAME or stored.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path} is not a {FORMAT_NAME} v{FORMAT_VERSION} config")
    required = ("draft_hidden", "target_hidden")
    missing = [name for name in required if name not in stored]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}")
    config = HeadConfig(**{key: stored[key] for key in HeadConfig.__dataclass_fields__ if key in stored})
    for name in required:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{path}: {name} must be a positive integer, got {value!r}")
    if config.hidden is not None and (isinstance(config.hidden, bool) or not isinstance(config.hidden, int)
                                      or config.hidden <= 0):
        raise ValueError(f"{path}: hidden must be null or a positive integer, got {config.hidden!r}")
    try:
        rules.positive_weight(config.init_weight, "init_weight")
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from None
    for name in ("pair", "recipe"):
        if not isinstance(getattr(config, name), dict):
            raise ValueError(f"{path}: {name} must be an object, got {getattr(config, name)!r}")
    if not isinstance(config.features, list) or not isinstance(config.use_hidden, bool):
        raise ValueError(f"{path}: features must be a list and use_hidden a boolean")
    try:
        _check_features(config.features, config.use_hidden)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from None
    return config


def _check_features(features: Sequence[str], use_hidden: bool) -> list:
    """``features`` as a list of known, distinct names; a head must read something."""
    if isinstance(features, str):
        raise TypeError(f"features must be a sequence of names, not the string {features!r}")
    features = list(features)
    unknown = [name for name in features if name not in DISTRIBUTION_FEATURES]
    if unknown or len(set(features)) != len(features):
        raise ValueError(f"features must be distinct names from {', '.join(DISTRIBUTION_FEATURES)}, got {features}")
    if not use_hidden and not features:
        raise ValueError("a head without hidden states (use_hidden=False) needs at least one feature")
    return features


def _read_weights(path: str, head: "EnsembleHead") -> dict:
    """The tensors in head.safetensors, checked against the head the config describes: same names, same shapes,
    every value finite. Anything else is a ValueError naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise ValueError(f"{path} is not a readable safetensors file ({error})") from None
    expected = head.state_dict()
    if set(tensors) != set(expected):
        raise ValueError(f"{path} holds tensors {sorted(tensors)}, the head in its head.json needs {sorted(expected)}")
    for name, tensor in tensors.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"{path}: {name} has shape {tuple(tensor.shape)}, head.json's widths need "
                             f"{tuple(expected[name].shape)}")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{path}: {name} holds NaN or infinite values; refusing to use this head")
    return tensors


def hidden_size(model) -> int:
    """Width of a causal LM's last hidden state (what the head reads), from its config."""
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if size is None:
        raise ValueError(f"cannot tell the hidden size of {type(model).__name__}; pass a head built by hand")
    return int(size)


def _check_matches(config: HeadConfig, pair: Optional[dict], draft_hidden: Optional[int],
                   target_hidden: Optional[int], directory: str) -> None:
    if draft_hidden is not None and draft_hidden != config.draft_hidden:
        raise ValueError(f"the head at {directory!r} expects draft hidden size {config.draft_hidden}, "
                         f"the draft model has {draft_hidden}")
    if target_hidden is not None and target_hidden != config.target_hidden:
        raise ValueError(f"the head at {directory!r} expects target hidden size {config.target_hidden}, "
                         f"the target model has {target_hidden}")
    if pair and config.pair:
        for role in ("target", "draft"):
            if role in pair and role in config.pair and pair[role] != config.pair[role]:
                raise ValueError(f"the head at {directory!r} was trained for {role} {config.pair[role]!r}, "
                                 f"not {pair[role]!r}")


SHIPPED_HEADS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heads")
# The head `--head default` and the demo load: the family's lambda = 4 recipe with a hidden layer, ahead of the
# linear lambda = 4 head on task score, KL and TV at K = 3 and 6 and on GSM8K test (docs/training.md, "Why the
# shipped heads are as they are").
DEFAULT_HEAD_NAME = "smollm2-135m-lambda4-hidden"
DEFAULT_HEAD_DIR = os.path.join(SHIPPED_HEADS_DIR, DEFAULT_HEAD_NAME)
# The same recipe, hidden layer included, trained on the states of the EAGLE-3 drafter shipped for the same pair with
# a third of its rollouts on synthetic problems: what "default" names when an EAGLE-3 head drafts. Off the drafter's
# task it stays nearer the target's law than the head trained on GSM8K alone (KL to the target 1.63 nats lower on
# synthetic problems, 0.28 on HumanEval) for a little of that head's lead on GSM8K (docs/training.md, "Heads for the
# EAGLE-3 drafter").
DEFAULT_EAGLE3_HEAD_NAME = "smollm2-135m-eagle3-lambda4-mixed"


def shipped_heads() -> list[str]:
    """Names of the heads shipped with the package (folders of ``diversed_ext/heads/`` holding a head.json)."""
    if not os.path.isdir(SHIPPED_HEADS_DIR):
        return []
    return sorted(name for name in os.listdir(SHIPPED_HEADS_DIR)
                  if os.path.isfile(os.path.join(SHIPPED_HEADS_DIR, name, CONFIG_NAME)))


def resolve_head_path(path: str, *, eagle3_drafter: bool = False) -> str:
    """The folder a head argument names: an existing path, ``"default"``, or the name of a shipped head. With
    ``eagle3_drafter`` (an EAGLE-3 head drafts), ``"default"`` is the default recipe trained on such a head's states
    (:data:`DEFAULT_EAGLE3_HEAD_NAME`)."""
    if path == "default":
        return os.path.join(SHIPPED_HEADS_DIR, DEFAULT_EAGLE3_HEAD_NAME) if eagle3_drafter else DEFAULT_HEAD_DIR
    if not os.path.exists(path) and path in shipped_heads():
        return os.path.join(SHIPPED_HEADS_DIR, path)
    return path


def head_recipe(path: str) -> dict:
    """The ``diversed train`` options recorded in the head.json of a head (a folder, ``"default"`` or a shipped
    head's name): what ``diversed train --recipe`` reruns. Empty for a head built by hand."""
    path = resolve_head_path(path)
    config_path = path if os.path.isfile(path) else os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no ensemble head at {path!r}: missing {CONFIG_NAME}")
    return dict(_read_config(config_path).recipe)


def load_head(path: str, *, target=None, draft=None, eagle3_drafter: bool = False, **checks) -> EnsembleHead:
    """A saved :class:`EnsembleHead` in eval mode: ``path`` is its folder (or a file inside it), ``"default"`` for
    the head shipped with the package for the default SmolLM2-135M pair (with ``eagle3_drafter``, the one for its
    EAGLE-3 drafter: :func:`resolve_head_path`), or the name of another shipped head (:func:`shipped_heads`). Nothing
    is unpickled.

    With ``target`` and ``draft`` given, a head built for other hidden sizes is refused; other ``checks`` go to
    :meth:`EnsembleHead.load`."""
    if target is not None and draft is not None:
        checks.update(draft_hidden=hidden_size(draft), target_hidden=hidden_size(target))
    path = resolve_head_path(path, eagle3_drafter=eagle3_drafter)
    if os.path.isfile(path):
        if os.path.basename(path) not in (CONFIG_NAME, WEIGHTS_NAME):
            raise FileNotFoundError(f"{path!r} is a file, not a head's folder nor its {CONFIG_NAME} or {WEIGHTS_NAME}")
        path = os.path.dirname(path) or "."
    return EnsembleHead.load(path, **checks).eval()
