"""An EAGLE-3 draft head for a Llama target, computed exactly as vLLM's ``Eagle3LlamaForCausalLM`` computes it, so that
one checkpoint drafts the same tokens in vLLM and in this package's loop.

The head reads three of the target's hidden states at each position, fuses them with ``fc`` into one feature, and runs
one Llama decoder layer whose attention reads ``[input_layernorm(token embedding), hidden_norm(feature)]`` (input
width 2H); its own LM head scores a reduced draft vocabulary whose ids map to the target's by ``d2t``.

Conventions:

* aux layer id ``l`` is the residual stream ENTERING target decoder layer ``l`` (``l = 0`` is the token embedding):
  vLLM's Llama collects ``hidden_states + residual`` after layer ``l - 1``, which is Hugging Face's
  ``output_hidden_states[l]`` (see :func:`aux_hidden_states`).
* draft position ``i`` pairs the fused target feature of position ``i`` with the token at position ``i + 1`` and
  predicts the token at ``i + 2``; its rotary position is ``i`` (vLLM shifts the input ids and keeps the positions).
* each step returns the post-norm state's logits and the PRE-norm state (``mlp out + residual``), which vLLM feeds back
  as the next step's feature (``norm_output`` unset).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .eagle3_layers import Eagle3Cache, fast_steps, rotary_inverse_frequencies, step_weights

AUX_LAYERS_DEFAULT = (2, 15, 27)  # vLLM's default for a 30-layer Llama: (2, L // 2, L - 3)
ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_FILE = "model.safetensors"
SHIPPED_NAME = "smollm2-135m-eagle3"  # the head trained for the default pair, in diversed_ext/drafters/


@dataclass(frozen=True)
class Eagle3Config:
    """Shapes of an EAGLE-3 head: the target's layer geometry, the draft vocabulary size and the aux layer ids."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: Tuple[int, ...] = AUX_LAYERS_DEFAULT

    def __post_init__(self):
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                     "vocab_size", "draft_vocab_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"Eagle3Config.{name} must be positive, got {getattr(self, name)}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"Eagle3Config.draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size "
                             f"({self.vocab_size})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("Eagle3Config.num_attention_heads must be a multiple of num_key_value_heads")
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if not self.aux_layer_ids:
            raise ValueError("Eagle3Config.aux_layer_ids must name at least one target layer")

    @classmethod
    def from_target(cls, target_config: dict, draft_vocab_size: int,
                    aux_layer_ids: Sequence[int] = AUX_LAYERS_DEFAULT) -> "Eagle3Config":
        """The head for a target whose Hugging Face ``config.json`` is ``target_config`` (a dict)."""
        hidden, heads = target_config["hidden_size"], target_config["num_attention_heads"]
        return cls(hidden_size=hidden, num_attention_heads=heads,
                   num_key_value_heads=target_config.get("num_key_value_heads", heads),
                   head_dim=target_config.get("head_dim") or hidden // heads,
                   intermediate_size=target_config["intermediate_size"], rms_norm_eps=target_config["rms_norm_eps"],
                   rope_theta=_rope_theta(target_config),
                   max_position_embeddings=target_config["max_position_embeddings"],
                   vocab_size=target_config["vocab_size"], draft_vocab_size=int(draft_vocab_size),
                   aux_layer_ids=tuple(aux_layer_ids))

    def to_hf(self) -> dict:
        """The ``config.json`` vLLM's eagle3 method loads (architecture ``LlamaForCausalLMEagle3``)."""
        return {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_act": "silu",
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
                "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
                "max_position_embeddings": self.max_position_embeddings, "vocab_size": self.vocab_size,
                "num_hidden_layers": 1, "tie_word_embeddings": False, "draft_vocab_size": self.draft_vocab_size,
                "target_hidden_size": self.hidden_size,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                                 "use_aux_hidden_state": True}}

    @classmethod
    def from_hf(cls, config: dict) -> "Eagle3Config":
        """Reads a head's ``config.json`` (as :meth:`to_hf` writes it, or another EAGLE-3 Llama checkpoint's)."""
        for key, value in (("norm_before_fc", False), ("fc_norm", False), ("norm_output", False),
                           ("norm_before_residual", False), ("attention_bias", False), ("num_hidden_layers", 1)):
            for where in (config, config.get("eagle_config") or {}):  # vLLM reads some of them from either
                if where.get(key, value) != value:
                    raise ValueError(f"EAGLE-3 config: {key}={where.get(key)} is not supported (need {value})")
        if config.get("target_hidden_size", config["hidden_size"]) != config["hidden_size"]:
            raise ValueError("EAGLE-3 config: target_hidden_size must equal hidden_size")
        aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or AUX_LAYERS_DEFAULT
        return cls.from_target(config, config.get("draft_vocab_size") or config["vocab_size"], aux)


def _rope_theta(config: dict) -> float:
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"EAGLE-3 head: rope_type {rope.get('rope_type')!r} is not supported (only 'default')")
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


class RMSNorm(torch.nn.Module):
    """Llama's RMSNorm, computed in float32 as vLLM does."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalises the last dimension and scales by ``weight``."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding (neox halves) of ``x`` [..., T, head_dim] at integer ``positions`` [..., T]."""
    half = x.shape[-1] // 2
    inv = rotary_inverse_frequencies(x.shape[-1], theta, x.device)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class _Attention(torch.nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.q_proj = torch.nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = torch.nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = torch.nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = torch.nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(torch.nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = torch.nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(torch.nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Eagle3Head(torch.nn.Module):
    """EAGLE-3 draft head: ``fc`` fuses the target's aux hidden states; ``midlayer`` is one Llama layer over
    [embedding, feature]; ``norm`` and ``lm_head`` score the draft vocabulary. Parameter names are the checkpoint's.
    The target's ``embed_tokens`` is shared (held, not registered: it is neither trained nor saved)."""

    def __init__(self, config: Eagle3Config, embed_tokens: torch.nn.Embedding):
        super().__init__()
        if embed_tokens.weight.shape != (config.vocab_size, config.hidden_size):
            raise ValueError(f"Eagle3Head: embed_tokens has shape {tuple(embed_tokens.weight.shape)}, expected "
                             f"({config.vocab_size}, {config.hidden_size})")
        self.config = config
        self._embed = (embed_tokens,)  # a tuple keeps it out of parameters() and state_dict()
        h = config.hidden_size
        self.fc = torch.nn.Linear(len(config.aux_layer_ids) * h, h, bias=False)
        self.midlayer = _MidLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = torch.nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size), persistent=False)

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        """The target's token embedding the head reads."""
        return self._embed[0]

    def set_draft_vocabulary(self, target_ids: torch.Tensor) -> None:
        """Sets the draft vocabulary: ``target_ids`` [Vd], strictly ascending target ids."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).flatten()
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"set_draft_vocabulary: target_ids has {ids.numel()} ids, expected "
                             f"{self.config.draft_vocab_size}")
        if (ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all())) or int(ids.min()) < 0 \
                or int(ids.max()) >= self.config.vocab_size:
            raise ValueError("set_draft_vocabulary: target_ids must be strictly ascending ids in [0, vocab_size)")
        self.draft_to_target.copy_(ids.to(self.draft_to_target.device))

    def use_int8_products(self, enabled: bool = True) -> "Eagle3Head":
        """Run the inference steps' products on int8 copies of the weights (CPU, float32 parameters; elsewhere
        ignored): a quarter of the bytes a float32 step reads. Drafts differ slightly from the float weights' (vLLM
        runs those), and teacher forcing (:mod:`diversed_ext.research.eagle_unrolled` without gradients) reads the
        same int8 products, so it gives the states and q the loop drafted with. Training stays float. Returns the
        head."""
        self.__dict__["_int8_products"] = bool(enabled)
        return self

    def new_cache(self) -> Eagle3Cache:
        """An empty cache for one sequence."""
        return Eagle3Cache()

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """``fc`` over the concatenated aux hidden states [N, len(aux) * H] -> the first step's features [N, H]."""
        aux_hidden = aux_hidden.to(self.fc.weight.dtype)
        return step_weights(self).linear(aux_hidden, "fc") if self._inference() else self.fc(aux_hidden)

    def _inference(self) -> bool:
        # No gradient can flow: the prepared (detached, packed) weights stand in for the parameters.
        return not (torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()))

    # The layer in two halves, batch dims first, so that training can run its own attention pattern between them.
    def project(self, token_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor):
        """Rotated queries [..., heads, T, d], keys and values [..., kv_heads, T, d] for ``token_ids`` [..., T]
        and ``features`` [..., T, H] at ``positions`` [..., T]."""
        c, layer = self.config, self.midlayer
        embeds = self.embed_tokens(token_ids).to(features.dtype)
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(features)], dim=-1)

        def heads(t, n):
            return t.unflatten(-1, (n, c.head_dim)).transpose(-2, -3)

        attention = layer.self_attn
        q, k, v = self._products(x, "qkv", attention.q_proj, attention.k_proj, attention.v_proj)
        q, k, v = heads(q, c.num_attention_heads), heads(k, c.num_key_value_heads), heads(v, c.num_key_value_heads)
        pos = positions.unsqueeze(-2)
        return rotate(q, pos, c.rope_theta), rotate(k, pos, c.rope_theta), v

    def finish(self, attended: torch.Tensor, features: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """From the attention output [..., heads, T, d] and the features (the residual) to draft logits
        [..., T, Vd] and the pre-norm state [..., T, H] fed back as the next step's feature."""
        layer, mlp = self.midlayer, self.midlayer.mlp
        residual = features + self._products(attended.transpose(-2, -3).flatten(-2), "o", layer.self_attn.o_proj)[0]
        gate, up = self._products(layer.post_attention_layernorm(residual), "gate_up", mlp.gate_proj, mlp.up_proj)
        prenorm = residual + self._products(F.silu(gate) * up, "down", mlp.down_proj)[0]
        return self._products(self.norm(prenorm), "lm_head", self.lm_head)[0], prenorm

    def _products(self, x: torch.Tensor, group: str, *modules: torch.nn.Linear) -> tuple:
        """``module(x)`` for each of ``modules``, the product group ``group`` of a drafting step: with int8 products
        and no gradient to flow, through the step's int8 weights, so teacher forcing computes what drafting
        computes; else through the modules themselves (float products equal the step's up to rounding)."""
        if x.dtype == torch.float32 and self._inference():
            weights = step_weights(self)
            if group in weights.int8_groups:
                return weights.linear(x, group).split([module.out_features for module in modules], dim=-1)
        return tuple(module(x) for module in modules)

    def step(self, token_ids: torch.Tensor, features: torch.Tensor,
             cache: Eagle3Cache) -> Tuple[torch.Tensor, torch.Tensor]:
        """Feeds T new positions ``cache.length ..``: position ``i`` reads ``features[i]`` [T, H] and the embedding
        of ``token_ids[i]`` [T], and predicts the token after ``token_ids[i]``. Returns draft-vocabulary logits
        [T, Vd] and the pre-norm states [T, H] (the next step's features); appends to ``cache``. Where no gradient
        can flow it runs :func:`~diversed_ext.models.eagle3_layers.fast_steps` (the same outputs up to rounding)."""
        logits, hidden = self.step_rows([token_ids], [features], [cache])
        return logits[0], hidden[0]

    def step_rows(self, token_ids: Sequence[torch.Tensor], features: Sequence[torch.Tensor],
                  caches: Sequence[Eagle3Cache]) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """:meth:`step` for several sequences, each with its own cache: sequence r feeds ``token_ids[r]`` [T_r] and
        ``features[r]`` [T_r, H]. Returns the lists of their logits and pre-norm states. Where no gradient can flow
        the sequences' products run together, reading the weights once for all of them, and attention runs sequence
        by sequence; each sequence's outputs are what :meth:`step` gives it alone."""
        if not len(token_ids) == len(features) == len(caches):
            raise ValueError(f"Eagle3Head.step_rows: one token_ids, features and cache per sequence; got "
                             f"{len(token_ids)}, {len(features)} and {len(caches)}")
        features = [self._step_features(ids, rows) for ids, rows in zip(token_ids, features)]
        if self._inference() and token_ids:
            return fast_steps(self, token_ids, features, caches)
        outputs = [self._plain_step(ids, rows, cache) for ids, rows, cache in zip(token_ids, features, caches)]
        return [logits for logits, _ in outputs], [hidden for _, hidden in outputs]

    def _plain_step(self, token_ids: torch.Tensor, features: torch.Tensor,
                    cache: Eagle3Cache) -> Tuple[torch.Tensor, torch.Tensor]:
        # With gradients: the layer op by op (training itself runs project and finish with its own attention).
        start = cache.length
        positions = torch.arange(start, start + token_ids.shape[0], device=features.device)
        q, k, v = self.project(token_ids, features, positions)
        cache.append(k, v)
        group = self.config.num_attention_heads // self.config.num_key_value_heads
        keys = cache.keys.repeat_interleave(group, dim=0)
        values = cache.values.repeat_interleave(group, dim=0)
        # query t (position start + t) sees every cached position up to its own
        visible = torch.arange(cache.length, device=q.device) <= positions.unsqueeze(-1)
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible,
                                                  scale=1.0 / math.sqrt(self.config.head_dim))
        return self.finish(attended, features)

    def _step_features(self, token_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        if token_ids.dim() != 1 or features.dim() != 2 or features.shape[0] != token_ids.shape[0]:
            raise ValueError(f"Eagle3Head.step: token_ids must be [T] and features [T, H]; got "
                             f"{tuple(token_ids.shape)} and {tuple(features.shape)}")
        return features.to(self.fc.weight.dtype)

    def full_vocab_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., Vd] placed in the target's vocabulary [..., V], ``-inf`` outside the draft vocabulary
        (as vLLM's ``compute_logits`` hands them over)."""
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., self.draft_to_target] = draft_logits
        return out

    def checkpoint_tensors(self, dtype: torch.dtype = None) -> dict:
        """The tensors of the checkpoint vLLM loads: parameters by name, ``d2t`` (target id = draft id +
        d2t[draft id]) and ``t2d`` (bool over the target vocabulary)."""
        tensors = {name: (p.detach().to(dtype) if dtype else p.detach()).contiguous().cpu()
                   for name, p in self.named_parameters()}
        ids = self.draft_to_target.cpu()
        t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        tensors.update(d2t=(ids - torch.arange(ids.numel())).to(torch.int64), t2d=t2d)
        return tensors

    def save_pretrained(self, folder: Union[str, Path], dtype: torch.dtype = None) -> Path:
        """Writes ``config.json`` and ``model.safetensors`` as vLLM's eagle3 method loads them (weights in ``dtype``,
        default the head's own)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = self.config.to_hf()
        config["dtype"] = str(dtype or self.fc.weight.dtype).replace("torch.", "")
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(self.checkpoint_tensors(dtype), str(folder / WEIGHTS_FILE))
        return folder

    @classmethod
    def from_pretrained(cls, folder: Union[str, Path], embed_tokens: torch.nn.Embedding,
                        dtype: torch.dtype = torch.float32) -> "Eagle3Head":
        """Loads a head written by :meth:`save_pretrained` (or another Llama EAGLE-3 checkpoint), weights cast to
        ``dtype``."""
        from safetensors.torch import load_file

        folder = Path(folder)
        if not (folder / "config.json").is_file() or not (folder / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(f"Eagle3Head.from_pretrained: {folder} needs config.json and {WEIGHTS_FILE}")
        config = Eagle3Config.from_hf(json.loads((folder / "config.json").read_text()))
        head = cls(config, embed_tokens)
        tensors = load_file(str(folder / WEIGHTS_FILE))
        d2t = tensors.pop("d2t", None)
        tensors.pop("t2d", None)
        missing, unexpected = head.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False)
        if missing or unexpected:
            raise ValueError(f"Eagle3Head.from_pretrained: {folder} missing {missing}, unexpected {unexpected}")
        if d2t is not None:
            head.set_draft_vocabulary(torch.arange(d2t.numel()) + d2t.long())
        return head.to(dtype).eval()


def aux_hidden_states(hf_hidden_states: tuple, layer_ids: Sequence[int] = AUX_LAYERS_DEFAULT) -> torch.Tensor:
    """The concatenated aux states [..., len(layer_ids) * H] from Hugging Face's ``output_hidden_states`` (index
    ``l`` = the residual stream entering decoder layer ``l``, as vLLM's Llama collects aux layer ``l``). The last
    entry of that tuple is post-norm in Hugging Face, so a layer id must be below the number of layers."""
    count = len(hf_hidden_states) - 1  # the embeddings, then one entry per decoder layer
    for layer in layer_ids:
        if not 0 <= layer < count:
            raise ValueError(f"aux_hidden_states: layer id {layer} outside [0, {count}) for a {count}-layer target")
    return torch.cat([hf_hidden_states[layer] for layer in layer_ids], dim=-1)


def default_drafter_path() -> Path:
    """The folder of the EAGLE-3 head shipped for the default pair (``config.json`` + ``model.safetensors``)."""
    path = Path(__file__).resolve().parent.parent / "drafters" / SHIPPED_NAME
    if not (path / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"the shipped EAGLE-3 head is missing: {path} has no {WEIGHTS_FILE}")
    return path


def load_default_drafter(embed_tokens: torch.nn.Embedding, dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """The shipped EAGLE-3 head for the default pair, sharing the target's ``embed_tokens``."""
    return Eagle3Head.from_pretrained(default_drafter_path(), embed_tokens, dtype=dtype)
